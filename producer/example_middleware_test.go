package producer_test

import (
	"context"
	"encoding/json"
	"log"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/producer"
)

// A handler behind the middleware does all its writes through the request's
// transaction: the business row, the outbox message and the stored response commit
// together, so a retry with the same Idempotency-Key replays the first response and
// writes nothing.
//
// This example needs a migrated Postgres, so it is compiled but not run.
func ExampleMiddleware() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	// The zero config means the defaults: 48h key lifetime, 5s wait, 1 MiB bodies.
	mw, err := producer.NewMiddleware(pool, producer.MiddlewareConfig{})
	if err != nil {
		log.Fatal(err)
	}

	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx, _ := producer.TxFromContext(ctx)
		key, _ := producer.KeyFromContext(ctx)
		scoped, _ := producer.ScopedKeyFromContext(ctx)

		var id int64
		err := tx.QueryRow(ctx,
			`INSERT INTO payments (scope, idempotency_key, account, amount_cents) VALUES ($1, $2, 'acct_1', 1250) RETURNING id`,
			producer.ScopeFromContext(ctx), string(key)).Scan(&id)
		if err != nil {
			// A 5xx rolls everything back and stores nothing: the retry runs again.
			http.Error(w, "try again", http.StatusInternalServerError)
			return
		}
		// The message carries the scoped key, so two tenants' equal keys stay apart.
		msg := idem.Message{Key: scoped, Subject: idem.SubjectCharge, Payload: []byte(`{"account":"acct_1","amount_cents":1250}`)}
		if err := outbox.Enqueue(ctx, tx, msg); err != nil {
			http.Error(w, "try again", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusAccepted)
		_ = json.NewEncoder(w).Encode(map[string]any{"key": key, "payment_id": id, "status": "accepted"})
	})

	mux := http.NewServeMux()
	mux.Handle("POST /charges", mw.Wrap(charge))
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", mux))
}
