package idemwatermill_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	idemwatermill "github.com/idemkit/idem/watermill"
)

// A Watermill router whose "payments" handler charges each payment exactly once
// and emits a receipt through idem's outbox, both in the transaction that claims
// the payment's Idempotency-Key. It needs Postgres with idem's schema (DATABASE_URL),
// so it has no Output block and is compiled but not run by go test.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	// Any Watermill pub/sub works (Kafka, AMQP, NATS...); gochannel keeps the example
	// self-contained. Persistent keeps poison messages although nobody subscribes
	// to the poison topic here; a real broker keeps them durably.
	pubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}

	// Permanent errors (no key, a key reused with another payload) go to a poison
	// topic with their reason; transient ones are retried, each attempt in a fresh
	// transaction, and then nacked for redelivery. The idem middleware is innermost.
	poison, err := middleware.PoisonQueueWithFilter(pubSub, "payments.poison", idemwatermill.IsPermanent)
	if err != nil {
		log.Fatal(err)
	}
	router.AddMiddleware(
		poison,
		middleware.Retry{
			MaxRetries:      3,
			InitialInterval: 100 * time.Millisecond,
			Multiplier:      2,
			ShouldRetry:     func(p middleware.RetryParams) bool { return !idemwatermill.IsPermanent(p.Err) },
		}.Middleware,
		idemwatermill.Middleware(pool, idemwatermill.Config{Consumer: "ledger"}),
	)

	router.AddConsumerHandler("charge", "payments", pubSub, func(msg *message.Message) error {
		ctx := msg.Context()
		tx, ok := idemwatermill.TxFromContext(ctx)
		if !ok {
			return errors.New("not running under idemwatermill.Middleware")
		}
		var p struct {
			Account     string `json:"account"`
			AmountCents int64  `json:"amount_cents"`
		}
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return idemwatermill.Permanent(fmt.Errorf("decode payment: %w", err))
		}
		key := msg.Metadata.Get(idem.HeaderKey)
		if _, err := tx.Exec(ctx,
			`INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ($1, $2, $3)`,
			key, p.Account, p.AmountCents); err != nil {
			return err
		}
		// The receipt commits with the ledger row and the claim; idem's relay
		// publishes it to JetStream on idem.emails.send.
		receipt := message.NewMessageWithContext(ctx, watermill.NewUUID(), []byte(`{"to":"a@example.com","subject":"receipt"}`))
		receipt.Metadata.Set(idem.HeaderKey, key) // the same intent
		return idemwatermill.NewOutboxPublisher(tx).Publish(idem.SubjectEmail, receipt)
	})

	go func() {
		if err := router.Run(ctx); err != nil {
			log.Print(err)
		}
	}()
	<-router.Running()

	// The producer mints the key once, when the user acts, and re-sends with it.
	pay := message.NewMessage(watermill.NewUUID(), []byte(`{"account":"acct_1","amount_cents":1250}`))
	pay.Metadata.Set(idem.HeaderKey, idem.NewKey().String())
	if err := pubSub.Publish("payments", pay); err != nil { // returns once acked
		log.Fatal(err)
	}
	_ = router.Close()
}

// A producer service writes its business row and the message that announces it in
// one transaction: both exist, or neither does.
func ExampleNewOutboxPublisher() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	key := idem.NewKey() // minted when the user pressed "pay", journaled before the first send
	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit

	if _, err := tx.Exec(ctx,
		`INSERT INTO payments (idempotency_key, account, amount_cents) VALUES ($1, 'acct_1', 1250)`, key.String()); err != nil {
		log.Fatal(err)
	}
	msg := message.NewMessageWithContext(ctx, watermill.NewUUID(), []byte(`{"account":"acct_1","amount_cents":1250}`))
	msg.Metadata.Set(idem.HeaderKey, key.String())
	msg.Metadata.Set(idem.HeaderScope, "tenant_a") // optional: joined into the key
	if err := idemwatermill.NewOutboxPublisher(tx).Publish(idem.SubjectCharge, msg); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		log.Fatal(err)
	}
}
