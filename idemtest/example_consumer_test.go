package idemtest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/idemtest"
	"github.com/idemkit/idem/install"
)

// A consumer.Handler runs its effect inside the Postgres transaction that claims
// the message's key, so the effect and the claim commit together. Here the same
// intent arrives twice (a producer retry the broker could not fold: another
// Msg-Id, the same Idempotency-Key); the second copy finds the key claimed and runs
// nothing. The consumer is run by hand (consumer.New, Run), as the worker runs
// each of its Consumers; Start gives it a database and a broker.
func Example_inTransactionConsumer() {
	ctx := context.Background()
	// A throwaway Postgres database with idem's tables and the application's own,
	// and an embedded JetStream.
	env, err := idemtest.Start(ctx, idemtest.Config{
		NATSURL: newServer(),
		Migrate: func(ctx context.Context, pool *pgxpool.Pool) error {
			_, err := pool.Exec(ctx, `CREATE TABLE ledger (key text NOT NULL, account text NOT NULL, amount_cents bigint NOT NULL)`)
			return err
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer env.Close()

	// The installation: idem's tables in env's database, the PAYMENTS stream, and
	// an observer told what every component does, here counting settled copies.
	var mu sync.Mutex
	settled := map[idem.Outcome]int{}
	var once sync.Once
	bothSettled := make(chan struct{})
	inst, err := install.New(env.Pool, env.NC, install.Config{
		Stream: install.Stream{Name: "PAYMENTS", Subjects: []string{"payments.>"}},
		Observer: func(e idem.Event) {
			if e.Component != idem.ComponentConsumer {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			settled[e.Outcome] += e.Count
			if settled[idem.OutcomeProcessed]+settled[idem.OutcomeDuplicate] >= 2 {
				once.Do(func() { close(bothSettled) })
			}
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := inst.EnsureStream(ctx); err != nil {
		log.Fatal(err)
	}

	var runs atomic.Int32
	book := consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		var c struct {
			Account     string `json:"account"`
			AmountCents int64  `json:"amount_cents"`
		}
		if err := json.Unmarshal(d.Payload, &c); err != nil {
			return nil, consumer.Permanent(err) // dead-lettered: no retry fixes it
		}
		runs.Add(1)
		// Written through tx: it commits with the claim of d.Key, or not at all.
		_, err := tx.Exec(ctx, `INSERT INTO ledger (key, account, amount_cents) VALUES ($1, $2, $3)`, d.Key, c.Account, c.AmountCents)
		return []byte(`{"booked":true}`), err // stored as the key's first result
	})

	c, err := consumer.New(inst, consumer.Config{
		Name:    "ledger",
		Subject: "payments.charge",
		Handler: book,
	})
	if err != nil {
		log.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- c.Run(runCtx) }()

	key := idem.NewKey().String()
	for _, msgID := range []string{"attempt-1", "attempt-2"} {
		msg := nats.NewMsg("payments.charge")
		msg.Header.Set(idem.HeaderKey, key)
		msg.Header.Set(idem.HeaderMsgID, msgID)
		msg.Data = []byte(`{"account":"acct_1","amount_cents":1250}`)
		if _, err := env.JS.PublishMsg(ctx, msg); err != nil {
			log.Fatal(err)
		}
	}
	select {
	case <-bothSettled:
	case <-time.After(30 * time.Second):
		log.Fatal("the copies were not settled")
	}
	stop()
	if err := <-stopped; err != nil {
		log.Fatal(err)
	}

	var rows int
	if err := env.Pool.QueryRow(ctx, `SELECT count(*) FROM ledger WHERE key = $1`, key).Scan(&rows); err != nil {
		log.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	fmt.Println("processed:", settled[idem.OutcomeProcessed], "duplicates:", settled[idem.OutcomeDuplicate])
	fmt.Println("handler runs:", runs.Load())
	fmt.Println("ledger rows:", rows)
	// Output:
	// processed: 1 duplicates: 1
	// handler runs: 1
	// ledger rows: 1
}
