// Command orders is the smallest complete idem service: a user's order API on their
// own stream and tables. The README's "Use idem in your service" shows this file.
package main

import (
	"cmp"
	"context"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/producer"
	"github.com/idemkit/idem/worker"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The effect: one shipment per order, written inside the inbox transaction.
	ship := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		_, err := tx.Exec(ctx, `INSERT INTO shipments VALUES ($1, $2)`, d.Key, d.Payload)
		return nil, err
	}
	cfg := worker.Config{
		Consumers: []consumer.Config{{Name: "shipping", Subject: "orders.created", Handler: consumer.HandlerFunc(ship)}},
		Ingress:   &producer.Config{},
	}
	pool, err := worker.NewPool(ctx, mustEnv("DATABASE_URL"), cfg) // sized for cfg's parts and its requests
	check(err)
	// Reconnect for as long as the broker is away: meanwhile the ingress takes
	// orders into the outbox, and the relay publishes them once it is back. A
	// connection that closes anyway ends the worker (w.Done below).
	nc, err := nats.Connect(mustEnv("NATS_URL"), nats.MaxReconnects(-1))
	check(err)
	_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (key text, body bytea);
		CREATE TABLE IF NOT EXISTS shipments (key text, body bytea)`)
	check(err)
	inst, err := install.New(pool, nc, install.Config{Stream: install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}}})
	check(err)
	w, err := worker.New(inst, cfg)
	check(err)
	check(w.Start(ctx)) // migrates idem's tables; refuses to start if a key could be forgotten too early

	// The intent: the order row and its message commit together, once per Idempotency-Key.
	createOrder := func(rw http.ResponseWriter, r *http.Request) {
		in, ok := producer.IntentFrom(r.Context()) // the request's transaction, behind w.Ingress()
		if !ok {
			http.Error(rw, "POST /orders is mounted without w.Ingress().Wrap", http.StatusInternalServerError)
			return
		}
		body, _ := io.ReadAll(r.Body)
		// The scoped key, as the consumer's d.Key is; in.Key is the client's raw key.
		if _, err := in.Tx.Exec(r.Context(), `INSERT INTO orders VALUES ($1, $2)`, in.ScopedKey(), body); err != nil {
			http.Error(rw, err.Error(), http.StatusInternalServerError) // a 5xx rolls back; the retry runs again
			return
		}
		if err := in.Enqueue(r.Context(), "orders.created", body, nil); err != nil {
			http.Error(rw, err.Error(), http.StatusInternalServerError)
			return
		}
		rw.WriteHeader(http.StatusAccepted)
	}
	http.Handle("POST /orders", w.Ingress().Wrap(http.HandlerFunc(createOrder)))
	http.Handle("GET /readyz", w.ReadyHandler())
	ln, err := net.Listen("tcp", cmp.Or(os.Getenv("ADDR"), "127.0.0.1:8080"))
	check(err)
	// GuardListener refuses a request smuggled in another's body, which net/http would run.
	go func() { log.Fatal(http.Serve(producer.GuardListener(ln, nil), nil)) }()
	select {
	case <-ctx.Done(): // SIGINT or SIGTERM
	case <-w.Done(): // a part failed, or the NATS connection closed: Stop returns why, check exits non-zero
	}
	stopCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	check(w.Stop(stopCtx)) // in-flight work commits and acks; past 30s it is cancelled, to be redelivered
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}

// mustEnv refuses an unset variable rather than fall back on a default server:
// whatever listens on localhost's default port may be someone else's.
func mustEnv(name string) string {
	v := os.Getenv(name)
	if v == "" {
		log.Fatalf("%s is not set; this program has no default server", name)
	}
	return v
}
