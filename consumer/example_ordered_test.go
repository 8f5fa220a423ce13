package consumer_test

import (
	"context"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/consumer"
)

// One ordered consumer per partition subject: give them all to the worker
// (worker.Config.Consumers), on every replica. Each partition's durable consumer
// hands out one message at a time (MaxAckPending 1), so a key's messages are
// applied in stream order whichever replica pulls them, and a message that keeps
// failing holds up only its own partition until it is dead-lettered.
func ExamplePartitioned() {
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
		cfg = cfg.WithDefaults() // as consumer.New and the worker fill them in
		fmt.Println(cfg.Name, cfg.Subject, "ordered:", cfg.Ordered, "batch size:", cfg.BatchSize, "concurrency:", cfg.Concurrency)
	}
	// Output:
	// order-history-0 orders.events.0 ordered: true batch size: 1 concurrency: 1
	// order-history-1 orders.events.1 ordered: true batch size: 1 concurrency: 1
	// order-history-2 orders.events.2 ordered: true batch size: 1 concurrency: 1
	// order-history-3 orders.events.3 ordered: true batch size: 1 concurrency: 1
}
