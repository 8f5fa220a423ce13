package idemwatermill_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"net/url"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/outbox"
	idemwatermill "github.com/idemkit/idem/watermill"
)

// A Watermill router whose "orders.created" handler bills each order exactly once
// and emits a confirmation through idem's outbox, both in the transaction that
// claims the order's Idempotency-Key. The order is delivered twice, as a broker
// may; it is billed once.
func Example() {
	ctx := context.Background()
	pool, drop := exampleDB() // a fresh database migrated with migrations.Apply
	defer drop()

	// The service's own table, its installation (idem's tables and its stream
	// "orders.>"; no NATS connection here, where nothing relays) and its outbox.
	if _, err := pool.Exec(ctx, `CREATE TABLE billed (idempotency_key text NOT NULL, account text NOT NULL, amount_cents bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	inst, err := install.New(pool, nil, install.Config{Stream: install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}}})
	if err != nil {
		log.Fatal(err)
	}
	ob := outbox.New(inst)

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
	poison, err := middleware.PoisonQueueWithFilter(pubSub, "orders.poison", idemwatermill.IsPermanent)
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
		idemwatermill.Middleware(inst, idemwatermill.Config{Consumer: "billing"}),
	)

	router.AddConsumerHandler("bill", "orders.created", pubSub, func(msg *message.Message) error {
		ctx := msg.Context()
		tx, ok := idemwatermill.TxFromContext(ctx)
		if !ok {
			return errors.New("not running under idemwatermill.Middleware")
		}
		var o struct {
			Account     string `json:"account"`
			AmountCents int64  `json:"amount_cents"`
		}
		if err := json.Unmarshal(msg.Payload, &o); err != nil {
			return idemwatermill.Permanent(fmt.Errorf("decode order: %w", err))
		}
		key := msg.Metadata.Get(idem.HeaderKey)
		if _, err := tx.Exec(ctx,
			`INSERT INTO billed (idempotency_key, account, amount_cents) VALUES ($1, $2, $3)`,
			key, o.Account, o.AmountCents); err != nil {
			return err
		}
		// The confirmation commits with the billing row and the claim; idem's relay
		// publishes it to JetStream on orders.confirmed.
		confirmation := message.NewMessageWithContext(ctx, watermill.NewUUID(), []byte(`{"to":"a@example.com","subject":"order confirmed"}`))
		confirmation.Metadata.Set(idem.HeaderKey, key) // the same intent
		return idemwatermill.NewOutboxPublisher(ob, tx).Publish("orders.confirmed", confirmation)
	})

	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := router.Run(ctx); err != nil {
			log.Print(err)
		}
	}()
	<-router.Running()

	// The producer mints the key once, when the user acts, and re-sends with it.
	placed := message.NewMessage(watermill.NewUUID(), []byte(`{"account":"acct_1","amount_cents":1250}`))
	placed.Metadata.Set(idem.HeaderKey, idem.NewKey().String())
	for range 2 { // the broker delivers it twice
		if err := pubSub.Publish("orders.created", placed.Copy()); err != nil { // returns once acked
			log.Fatal(err)
		}
	}
	if err := router.Close(); err != nil {
		log.Fatal(err)
	}
	<-done

	var billed, confirmations int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM billed`).Scan(&billed); err != nil {
		log.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_outbox WHERE subject = 'orders.confirmed'`).Scan(&confirmations); err != nil {
		log.Fatal(err)
	}
	fmt.Println("billed:", billed)
	fmt.Println("confirmations in the outbox:", confirmations)
	// Output:
	// billed: 1
	// confirmations in the outbox: 1
}

// A producer service writes its business row and the message that announces it in
// one transaction: both exist, or neither does. The relay later publishes the row
// to the stream with a Nats-Msg-Id derived from subject and scoped key.
func ExampleNewOutboxPublisher() {
	ctx := context.Background()
	pool, drop := exampleDB() // a fresh database migrated with migrations.Apply
	defer drop()
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (idempotency_key text PRIMARY KEY, account text NOT NULL, amount_cents bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	// The service's installation (no NATS connection here, where nothing relays)
	// and its outbox, for its stream "orders.>".
	inst, err := install.New(pool, nil, install.Config{Stream: install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}}})
	if err != nil {
		log.Fatal(err)
	}
	ob := outbox.New(inst)

	// Minted with idem.NewKey when the user pressed "order", journaled before the
	// first send; fixed here so that the output is stable.
	key := idem.Key("0190b2f4-7c1e-7a2b-9d3e-5f6a7b8c9d0e")
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx,
			`INSERT INTO orders (idempotency_key, account, amount_cents) VALUES ($1, 'acct_1', 1250)`, key.String()); err != nil {
			return err
		}
		msg := message.NewMessageWithContext(ctx, watermill.NewUUID(), []byte(`{"account":"acct_1","amount_cents":1250}`))
		msg.Metadata.Set(idem.HeaderKey, key.String())
		msg.Metadata.Set(idem.HeaderScope, "tenant_a") // optional: joined into the key
		return idemwatermill.NewOutboxPublisher(ob, tx).Publish("orders.created", msg)
	}) // commits, or rolls back both on error
	if err != nil {
		log.Fatal(err)
	}

	var subject, scopedKey, msgID string
	if err := pool.QueryRow(ctx, `SELECT subject, key, msg_id FROM idem_outbox`).Scan(&subject, &scopedKey, &msgID); err != nil {
		log.Fatal(err)
	}
	scope, k, err := idem.ParseScopedKey(scopedKey)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("subject:", subject)
	fmt.Println("scope:", scope, "key:", k)
	fmt.Println("msg id derived:", msgID == idem.MsgID(subject, scopedKey))
	// Output:
	// subject: orders.created
	// scope: tenant_a key: 0190b2f4-7c1e-7a2b-9d3e-5f6a7b8c9d0e
	// msg id derived: true
}

// exampleDB creates a fresh database on the server named by DATABASE_URL (default
// the local trust-auth server), applies idem's migrations to it and returns a pool
// on it with a function that drops it. Examples have no *testing.T, so this is
// internal/pgtest without one.
func exampleDB() (*pgxpool.Pool, func()) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	adminURL := os.Getenv("DATABASE_URL")
	if adminURL == "" {
		adminURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		log.Fatal(err)
	}
	name := "idem_ex_" + hex.EncodeToString(b[:])
	admin, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		log.Fatalf("example: connect to %s: %v", adminURL, err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		log.Fatalf("example: create database: %v", err)
	}
	u, err := url.Parse(adminURL)
	if err != nil {
		log.Fatal(err)
	}
	u.Path = "/" + name
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		log.Fatal(err)
	}
	drop := func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, adminURL)
		if err != nil {
			log.Printf("example: drop %s: %v", name, err)
			return
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			log.Printf("example: drop %s: %v", name, err)
		}
	}
	if _, err := migrations.Apply(ctx, pool, migrations.Config{}); err != nil {
		drop()
		log.Fatalf("example: migrate: %v", err)
	}
	return pool, drop
}
