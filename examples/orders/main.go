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
	pool, err := worker.NewPool(ctx, os.Getenv("DATABASE_URL"), cfg) // sized for cfg's parts and its requests
	check(err)
	nc, err := nats.Connect(os.Getenv("NATS_URL"))
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
		in, _ := producer.IntentFrom(r.Context()) // the request's transaction, behind w.Ingress()
		body, _ := io.ReadAll(r.Body)
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
	case <-w.Done(): // a part of the worker failed: Stop returns why, and check exits non-zero
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
