package producer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/producer"
)

// A handler behind the middleware does all its writes through the request's
// transaction: the business row, the outbox message and the stored response commit
// together, so a retry with the same Idempotency-Key replays the first response and
// writes nothing.
func ExampleMiddleware() {
	ctx := context.Background()
	// A throwaway Postgres database with idem's tables and the application's own,
	// and an embedded JetStream (unused here: a worker's relay would publish the
	// outbox).
	env, err := testenv.Open(ctx, func(ctx context.Context, pool *pgxpool.Pool) error {
		_, err := pool.Exec(ctx, `CREATE TABLE payments (
			id bigserial PRIMARY KEY, scope text NOT NULL, idempotency_key text NOT NULL,
			account text NOT NULL, amount_cents bigint NOT NULL)`)
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	defer env.Close()

	// The installation knows the stream's subjects, so a wrong subject fails the
	// request while the client can still be told.
	inst, err := install.New(env.Pool, env.NC, install.Config{
		Stream: install.Stream{Name: "PAYMENTS", Subjects: []string{"payments.>"}},
	})
	if err != nil {
		log.Fatal(err)
	}
	// Zero fields mean the defaults: 48h key lifetime, 5s wait, 1 MiB bodies.
	mw, err := producer.NewMiddleware(inst, producer.Config{})
	if err != nil {
		log.Fatal(err)
	}

	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		in, ok := producer.IntentFrom(ctx)
		if !ok {
			producer.WriteError(w, http.StatusInternalServerError, "no_intent", "not behind the idempotency middleware")
			return
		}
		var req struct {
			Account     string `json:"account"`
			AmountCents int64  `json:"amount_cents"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			// A 4xx is a final answer: stored and replayed like a success.
			producer.WriteError(w, http.StatusBadRequest, "bad_request", err.Error())
			return
		}
		var id int64
		err := in.Tx.QueryRow(ctx,
			`INSERT INTO payments (scope, idempotency_key, account, amount_cents) VALUES ($1, $2, $3, $4) RETURNING id`,
			in.Scope, string(in.Key), req.Account, req.AmountCents).Scan(&id)
		if err == nil {
			// The message carries the scoped key, so two tenants' equal keys stay apart.
			payload, _ := json.Marshal(map[string]any{"payment_id": id, "account": req.Account, "amount_cents": req.AmountCents})
			err = in.Enqueue(ctx, "payments.charge", payload, nil)
		}
		if err != nil {
			// A 5xx rolls everything back and stores nothing: the retry runs again.
			producer.WriteError(w, http.StatusInternalServerError, "internal_error", "try again with the same key")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusAccepted)
		_ = json.NewEncoder(w).Encode(map[string]any{"payment_id": id, "status": "accepted"})
	})

	mux := http.NewServeMux()
	mux.Handle("POST /charges", mw.Wrap(charge))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	// The client mints the key once, before the first send, and reuses it for the
	// retry (say the first answer was lost on the way back).
	key := idem.NewKey()
	for _, attempt := range []string{"first", "retry"} {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader(`{"account":"acct_1","amount_cents":1250}`))
		if err != nil {
			log.Fatal(err)
		}
		req.Header.Set(idem.HeaderKey, key.String())
		resp, err := srv.Client().Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("%s: %d %s=%q %s", attempt, resp.StatusCode, idem.HeaderReplayed, resp.Header.Get(idem.HeaderReplayed), body)
	}

	var payments, messages int
	if err := env.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM payments), (SELECT count(*) FROM idem_outbox)`).Scan(&payments, &messages); err != nil {
		log.Fatal(err)
	}
	fmt.Println("payments:", payments, "outbox messages:", messages)
	// Output:
	// first: 202 Idempotent-Replayed="" {"payment_id":1,"status":"accepted"}
	// retry: 202 Idempotent-Replayed="true" {"payment_id":1,"status":"accepted"}
	// payments: 1 outbox messages: 1
}
