package install_test

import (
	"context"
	"log"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/install"
)

// An installation of a database and a stream, shared by every component the
// process runs. The connections stay the caller's: close them after the worker
// stopped.
func ExampleNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/orders")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	nc, err := nats.Connect("nats://localhost:4222", nats.MaxReconnects(-1))
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()

	inst, err := install.New(pool, nc, install.Config{
		Schema: "orders", // the idem_* tables live in the schema "orders"
		Stream: install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}, MaxAge: 24 * time.Hour},
	})
	if err != nil {
		log.Fatal(err)
	}
	_ = inst // give it to worker.New, consumer.New, outbox.New …
}

// The stream, created when it is absent. A stream that exists is left as it is:
// its operator may have tuned it.
func ExampleInstallation_EnsureStream() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/orders")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	nc, err := nats.Connect("nats://localhost:4222")
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	inst, err := install.New(pool, nc, install.Config{Stream: install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}}})
	if err != nil {
		log.Fatal(err)
	}
	s, err := inst.EnsureStream(ctx)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("stream %s keeps messages for %s", s.CachedInfo().Config.Name, s.CachedInfo().Config.MaxAge)
}

// A process that only reads idem's tables (an operator's tool, a producer that
// writes the outbox and leaves publishing to the worker) needs no broker.
func ExampleNew_withoutNATS() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/orders")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	inst, err := install.New(pool, nil, install.Config{Stream: install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}}})
	if err != nil {
		log.Fatal(err)
	}
	_ = inst // outbox.New(inst), deadletter.New(inst) …
}
