package scenario

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// plainHTTP serves the floor of "one commit per request": the reference
// application's route, writing the payment row in one transaction, with no
// idempotency and no outbox.
type plainHTTP struct{}

func (plainHTTP) Name() string { return "plain-http" }

func (plainHTTP) Summary() string {
	return "an HTTP server whose handler commits the payment row alone, one request per intent: the floor of one commit per request"
}

func (s plainHTTP) Rows(o Options) []string { return httpRows(s.Name(), o) }

func (s plainHTTP) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	return httpScenario{name: s.Name(), serve: servePlainHTTP}.run(ctx, h)
}

func servePlainHTTP(_ context.Context, env *benchenv.Env, _ *Harness, _ map[string]int, _ int) (*httpTarget, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/payments", func(w http.ResponseWriter, r *http.Request) {
		var c refapp.Charge
		if err := json.NewDecoder(r.Body).Decode(&c); err != nil || c.Validate() != nil {
			http.Error(w, "bad charge", http.StatusBadRequest)
			return
		}
		err := pgx.BeginFunc(r.Context(), env.Pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(r.Context(), `INSERT INTO payments (idempotency_key, account, amount_cents) VALUES ($1, $2, $3)`,
				r.Header.Get(idem.HeaderKey), c.Account, c.AmountCents)
			return err
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusAccepted)
		_, _ = w.Write([]byte(`{"status":"accepted"}`))
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintf(os.Stderr, "plain-http: %v\n", err)
		}
	}()
	return &httpTarget{url: "http://" + ln.Addr().String() + "/v1/payments", stop: srv.Shutdown}, nil
}
