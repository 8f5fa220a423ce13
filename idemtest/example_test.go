package idemtest_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/idemtest"
)

// A well-behaved handler writes one row of its own table through the transaction
// it is given; every scenario leaves exactly one row for the key.
func Example() {
	ctx := context.Background()
	env, err := idemtest.Start(ctx, idemtest.Config{
		NATSURL: newServer(),
		Migrate: func(ctx context.Context, pool *pgxpool.Pool) error {
			_, err := pool.Exec(ctx, `CREATE TABLE shipments (key text NOT NULL, payload bytea NOT NULL)`)
			return err
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()

	ship := consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		_, err := tx.Exec(ctx, `INSERT INTO shipments (key, payload) VALUES ($1, $2)`, d.Key, d.Payload)
		return nil, err
	})
	report, err := idemtest.Check(ctx, env, idemtest.Case{
		Consumer: consumer.Config{Name: "shipping", Subject: "orders.paid", Handler: ship},
		Message:  idem.Message{Subject: "orders.paid", Payload: []byte(`{"order":42}`)},
		Effects: func(ctx context.Context, pool *pgxpool.Pool, key string) (n int, err error) {
			err = pool.QueryRow(ctx, `SELECT count(*) FROM shipments WHERE key = $1`, key).Scan(&n)
			return n, err
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, s := range report.Scenarios {
		fmt.Printf("%s: %d\n", s.Name, s.Effects)
	}
	fmt.Println("exactly once:", report.OK())
	// Output:
	// first delivery: 1
	// crash after the effect, before commit: 1
	// crash after commit, before ack: 1
	// broker redelivery of the same stream message: 1
	// re-sent with a new Nats-Msg-Id: 1
	// same key, changed payload: 1
	// exactly once: true
}

// An External handler passes downstream the key Effect.KeyFor derives, and a
// downstream that honours it (a fake SMS provider here) executes each intent once,
// however often the handler runs. Effects counts the provider's executions under
// that key, which KeyFor derives from the scoped key alike.
func Example_external() {
	ctx := context.Background()
	env, err := idemtest.Start(ctx, idemtest.Config{NATSURL: newServer()})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()

	var mu sync.Mutex
	executed := map[string]int{} // by Idempotency-Key
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		if key := r.Header.Get("Idempotency-Key"); executed[key] == 0 { // a key seen before is replayed
			executed[key]++
		}
		fmt.Fprint(w, "queued")
	}))
	defer provider.Close()

	sms := consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, provider.URL, bytes.NewReader(e.Payload))
		if err != nil {
			return nil, consumer.Permanent(err)
		}
		req.Header.Set("Idempotency-Key", e.KeyFor("send"))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil, err
		}
		resp.Body.Close()
		return nil, nil
	})
	report, err := idemtest.Check(ctx, env, idemtest.Case{
		Consumer: consumer.Config{Name: "sms", Subject: "notifications.created", External: sms},
		Message:  idem.Message{Subject: "notifications.created", Payload: []byte(`{"to":"+15550100"}`)},
		Effects: func(_ context.Context, _ *pgxpool.Pool, key string) (int, error) {
			mu.Lock()
			defer mu.Unlock()
			return executed[idemtest.KeyFor(key, "send")], nil
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, s := range report.Scenarios {
		fmt.Printf("%s: %d\n", s.Name, s.Effects)
	}
	fmt.Println("exactly once:", report.OK())
	// Output:
	// first delivery: 1
	// error after the effect reached the downstream: 1
	// crash after the effect, before its outcome was recorded: 1
	// broker redelivery of the same stream message: 1
	// re-sent with a new Nats-Msg-Id: 1
	// same key, changed payload: 1
	// exactly once: true
}
