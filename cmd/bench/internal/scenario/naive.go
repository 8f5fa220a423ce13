package scenario

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// naive is the floor of a consumer: one autocommit INSERT per message, no dedupe,
// so a redelivery is a second charge.
type naive struct{}

func (naive) Name() string { return "naive" }

func (naive) Summary() string {
	return "JetStream pull consumer, one autocommit INSERT per message, ack (no dedupe)"
}

func (s naive) Rows(Options) []string { return []string{s.Name()} }

func (s naive) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	b := baseline{name: s.Name(), handle: naiveHandle, atLeastOnce: true}
	return withEnv(ctx, h, s.Name(), func(env *benchenv.Env) ([]report.Result, error) { return b.run(ctx, env, h) })
}

func naiveHandle(ctx context.Context, pool *pgxpool.Pool, key string, c refapp.Charge) error {
	_, err := pool.Exec(ctx, sqlLedgerOne, key, c.Account, c.AmountCents)
	return err
}
