package relay_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// BenchmarkRelayBatch is the relay's hot path: claim a batch of pending rows,
// publish them to JetStream (file storage) and mark them published, in one
// transaction. ns/op is per batch of 500 rows; msgs/s is the rate.
func BenchmarkRelayBatch(b *testing.B) {
	const batch = 500
	env := testenv.New(b)
	ob := outbox.New(env.Inst)
	r, err := relay.New(parts.Of(env.Inst), relay.Config{BatchSize: batch})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	payload := []byte(`{"amount_cents":100}`)
	msgs := make([]idem.Message, batch)
	b.ResetTimer()
	for i := range b.N {
		b.StopTimer()
		for j := range msgs {
			msgs[j] = idem.Message{Key: idem.ScopedKey("", idem.Key(fmt.Sprintf("k-%d-%d", i, j))), Subject: testenv.Subject, Payload: payload}
		}
		if err := pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, msgs...) }); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		n, err := r.Drain(ctx)
		if err != nil || n != batch {
			b.Fatalf("drained %d rows (%v), want %d", n, err, batch)
		}
	}
	b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "msgs/s")
}
