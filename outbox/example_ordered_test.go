package outbox_test

import (
	"context"
	"fmt"
	"log"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/worker"
)

// Ordering by key: a producer maps each message's ordering key (an order id) to
// one of a few partition subjects with Partition, and the relay, told those
// subjects are ordered, publishes each partition's rows strictly in the order they
// were enqueued. An ordered consumer per partition (consumer.Partitioned) then
// applies them in that order.
func ExamplePartition() {
	ctx := context.Background()
	env, err := testenv.Open(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer env.Close()
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
	const partitions = 4
	// Three events of order 42, each in its own transaction, as a service would
	// write them one after another.
	for _, event := range []string{"created", "paid", "shipped"} {
		msg := idem.Message{
			Key:     idem.ScopedKey("", idem.Key("order-42-"+event)),
			Subject: outbox.Partition("orders.events", "42", partitions),
			Payload: []byte(event),
		}
		if err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, msg) }); err != nil {
			log.Fatal(err)
		}
	}
	w, err := worker.New(inst, worker.Config{
		Relay: worker.RelayConfig{OrderedSubjects: []string{"orders.events.*"}}, // every worker of this installation says the same
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		log.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); published.Load() < 3; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			log.Fatal("the events were not published")
		}
	}
	if err := w.Stop(ctx); err != nil {
		log.Fatal(err)
	}
	stream, err := env.JS.Stream(ctx, "ORDERS")
	if err != nil {
		log.Fatal(err)
	}
	for seq := uint64(1); seq <= 3; seq++ {
		m, err := stream.GetMsg(ctx, seq)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(m.Subject, string(m.Data))
	}
	fmt.Println(outbox.PartitionSubjects("orders.events", partitions))
	// Output:
	// orders.events.3 created
	// orders.events.3 paid
	// orders.events.3 shipped
	// [orders.events.0 orders.events.1 orders.events.2 orders.events.3]
}
