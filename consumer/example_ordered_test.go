package consumer_test

import (
	"context"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// One ordered consumer per partition subject: give them all to the worker
// (worker.Config.Consumers), on every replica. Each partition's durable consumer
// hands out one message at a time, so a key's messages are applied in stream
// order whichever replica pulls them, and a message that keeps failing holds up
// only its own partition until it is dead-lettered.
func ExamplePartitioned() {
	ctx := context.Background()
	// A throwaway Postgres database with idem's tables and an embedded JetStream.
	env, err := testenv.Open(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer env.Close()
	inst, err := install.New(env.Pool, env.NC, install.Config{Stream: install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}}})
	if err != nil {
		log.Fatal(err)
	}

	apply := consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		_, err := tx.Exec(ctx, `INSERT INTO order_events (key, body) VALUES ($1, $2)`, d.Key, d.Payload)
		return nil, err
	})
	cfgs, err := consumer.Partitioned(consumer.Config{
		Name:       "order-history",
		Subject:    "orders.events", // the subject given to outbox.Partition
		Handler:    apply,
		MaxDeliver: 5, // how long a poison message may block its partition
	}, 4)
	if err != nil {
		log.Fatal(err)
	}
	for _, cfg := range cfgs {
		c, err := consumer.New(inst, cfg) // as the worker does with each of its Consumers
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(cfg.Name, cfg.Subject, "ordered:", cfg.Ordered, "max ack pending:", c.JetStreamConfig().MaxAckPending)
	}
	// Output:
	// order-history-0 orders.events.0 ordered: true max ack pending: 1
	// order-history-1 orders.events.1 ordered: true max ack pending: 1
	// order-history-2 orders.events.2 ordered: true max ack pending: 1
	// order-history-3 orders.events.3 ordered: true max ack pending: 1
}
