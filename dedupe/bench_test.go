package dedupe_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

// BenchmarkClaim is the inbox's hot path: one transaction that claims a batch of
// new deliveries, settles them and commits, as an in-transaction consumer does per
// batch around its effect. ns/op is per
// batch; keys/s is the rate. Real Postgres at its shipped durability.
func BenchmarkClaim(b *testing.B) {
	for _, batch := range []int{1, 250} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			db := pgtest.New(b)
			inst, err := install.New(db.Pool, nil, install.Config{Stream: install.Stream{Name: "BENCH", Subjects: []string{"bench.>"}}})
			if err != nil {
				b.Fatal(err)
			}
			in := dedupe.New(inst)
			ctx := context.Background()
			payload := []byte(`{"amount_cents":100}`)
			claims := make([]dedupe.Claim, batch)
			done := make([]dedupe.Settlement, batch)
			b.ResetTimer()
			for i := range b.N {
				for j := range claims {
					claims[j] = dedupe.Claim{Key: fmt.Sprintf("k-%d-%d", i, j), Message: "bench.claim", Payload: payload}
					done[j] = dedupe.Settlement{Claim: claims[j]}
				}
				err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					if _, err := in.Claim(ctx, tx, "bench", claims); err != nil {
						return err
					}
					return in.Settle(ctx, tx, "bench", done, time.Hour)
				})
				if err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "keys/s")
		})
	}
}
