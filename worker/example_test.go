package worker_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/producer"
	"github.com/idemkit/idem/worker"
)

// The composition root runs a whole service's idem side from one Config: here an
// order API whose POST /orders is guarded by the worker's Ingress, and a consumer
// that ships each order. The request is sent twice with one Idempotency-Key, as a
// client whose first response was lost would; there is one order and one shipment.
func Example() {
	ctx := context.Background()
	// A throwaway database with the service's own tables, and an embedded JetStream.
	env, err := testenv.Open(ctx, func(ctx context.Context, pool *pgxpool.Pool) error {
		_, err := pool.Exec(ctx, `CREATE TABLE orders (key text, item text); CREATE TABLE shipments (key text, item text)`)
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	defer env.Close()

	ship := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		_, err := tx.Exec(ctx, `INSERT INTO shipments VALUES ($1, $2)`, d.Key, string(d.Payload))
		return nil, err
	}
	// The installation: idem's tables in the pool's database, the service's stream.
	inst, err := install.New(env.Pool, env.NC, install.Config{
		Stream: install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}},
	})
	if err != nil {
		log.Fatal(err)
	}
	w, err := worker.New(inst, worker.Config{
		Consumers: []consumer.Config{{Name: "shipping", Subject: "orders.created", Handler: consumer.HandlerFunc(ship)}},
		Ingress:   &producer.Config{},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer w.Stop(ctx) //nolint:errcheck
	for _, l := range w.Lifetimes() {
		fmt.Printf("checked %s: inbox keys %s > stream MaxAge %s\n", l.For, l.InboxKey, l.StreamMaxAge)
	}

	createOrder := func(rw http.ResponseWriter, r *http.Request) {
		in, _ := producer.IntentFrom(r.Context())
		item, _ := io.ReadAll(r.Body)
		if _, err := in.Tx.Exec(r.Context(), `INSERT INTO orders VALUES ($1, $2)`, in.ScopedKey(), string(item)); err != nil {
			http.Error(rw, err.Error(), http.StatusInternalServerError)
			return
		}
		if err := in.Enqueue(r.Context(), "orders.created", item, nil); err != nil {
			http.Error(rw, err.Error(), http.StatusInternalServerError)
			return
		}
		rw.WriteHeader(http.StatusAccepted)
	}
	srv := httptest.NewServer(w.Ingress().Wrap(http.HandlerFunc(createOrder)))
	defer srv.Close()

	key := string(idem.NewKey())
	for range 2 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("teapot"))
		req.Header.Set(idem.HeaderKey, key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
		fmt.Printf("POST /orders: %d, replayed=%q\n", resp.StatusCode, resp.Header.Get(idem.HeaderReplayed))
	}
	count := func(table string) (n int) {
		_ = env.Pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n)
		return n
	}
	for deadline := time.Now().Add(30 * time.Second); count("shipments") == 0 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	fmt.Printf("orders: %d, shipments: %d\n", count("orders"), count("shipments"))
	// Output:
	// checked consumer shipping: inbox keys 72h0m0s > stream MaxAge 24h0m0s
	// POST /orders: 202, replayed=""
	// POST /orders: 202, replayed="true"
	// orders: 1, shipments: 1
}
