package outbox_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/outbox"
)

// BenchmarkEnqueue is the producer's share of an intent: one transaction that
// enqueues one message (the commonest case, one intent per request) and commits,
// without the NOTIFY (Wake is the relay's, after the commit).
func BenchmarkEnqueue(b *testing.B) {
	db := pgtest.New(b)
	inst, err := install.New(db.Pool, nil, install.Config{Stream: install.Stream{Name: "BENCH", Subjects: []string{"bench.>"}}})
	if err != nil {
		b.Fatal(err)
	}
	ob := outbox.New(inst)
	ctx := context.Background()
	payload := []byte(`{"amount_cents":100}`)
	b.ResetTimer()
	for i := range b.N {
		m := idem.Message{Key: idem.ScopedKey("", idem.Key(fmt.Sprintf("k-%d", i))), Subject: "bench.created", Payload: payload}
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			batch := &pgx.Batch{}
			if err := ob.AddToBatch(ctx, batch, m); err != nil {
				return err
			}
			return tx.SendBatch(ctx, batch).Close()
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "intents/s")
}
