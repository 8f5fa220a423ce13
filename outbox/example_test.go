package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/worker"
)

// A producer writes its business row and the message announcing it in one
// transaction, so the message exists if and only if the row does. The relay then
// publishes committed messages to JetStream with the intent's key and a Msg-Id
// derived from subject and key.
func ExampleOutbox_Enqueue() {
	ctx := context.Background()
	// A throwaway Postgres database with idem's tables and the application's own,
	// and an embedded JetStream.
	env, err := testenv.Open(ctx, func(ctx context.Context, pool *pgxpool.Pool) error {
		_, err := pool.Exec(ctx, `CREATE TABLE orders (id bigint PRIMARY KEY, total_cents bigint NOT NULL)`)
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	defer env.Close()

	// The installation: the database of idem's tables and the application's
	// stream, whose subjects bound what the outbox accepts, so that a message no
	// stream would store is refused at once. Its observer counts what the relay
	// publishes.
	var published atomic.Int64
	inst, err := install.New(env.Pool, env.NC, install.Config{
		Stream: install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}},
		Observer: func(e idem.Event) {
			if e.Component == idem.ComponentRelay && e.Outcome == idem.OutcomePublished {
				published.Add(int64(e.Count))
			}
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	ob := outbox.New(inst)
	placeOrder := func(id int64, key idem.Key, subject string, fail error) error {
		return pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO orders (id, total_cents) VALUES ($1, 4200)`, id); err != nil {
				return err
			}
			msg := idem.Message{Key: idem.ScopedKey("", key), Subject: subject, Payload: fmt.Appendf(nil, `{"order":%d}`, id)}
			if err := ob.Enqueue(ctx, tx, msg); err != nil {
				return err
			}
			return fail // a later step of the transaction failing takes the message with it
		})
	}

	if err := placeOrder(7, "order-7", "orders.created", nil); err != nil {
		log.Fatal(err)
	}
	err = placeOrder(8, "order-8", "orders.created", errors.New("card declined"))
	fmt.Println("order 8:", err)
	err = placeOrder(9, "order-9", "invoices.created", nil)
	fmt.Println("order 9 refused, bad subject:", errors.Is(err, idem.ErrBadSubject))

	// A worker's relay publishes the committed messages, woken at every commit.
	w, err := worker.New(inst, worker.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		log.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); published.Load() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			log.Fatal("nothing was published")
		}
	}
	if err := w.Stop(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("published:", published.Load())

	stream, err := env.JS.Stream(ctx, "ORDERS")
	if err != nil {
		log.Fatal(err)
	}
	m, err := stream.GetMsg(ctx, 1)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(m.Subject, string(m.Data))
	fmt.Println(idem.HeaderKey+":", m.Header.Get(idem.HeaderKey))
	fmt.Println(idem.HeaderMsgID+":", m.Header.Get(idem.HeaderMsgID))
	// Output:
	// order 8: card declined
	// order 9 refused, bad subject: true
	// published: 1
	// orders.created {"order":7}
	// Idempotency-Key: order-7
	// Nats-Msg-Id: orders.created order-7
}
