package scenario

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// handwrittenInbox is the inbox a team would write for itself: one transaction
// per message, the claim and then the effect.
type handwrittenInbox struct{}

func (handwrittenInbox) Name() string { return "handwritten-inbox" }

func (handwrittenInbox) Summary() string {
	return "one transaction per message: inbox INSERT ... ON CONFLICT DO NOTHING, ledger row, commit, ack"
}

func (s handwrittenInbox) Rows(Options) []string { return []string{s.Name()} }

const (
	// The hand-written inbox table: the consumer and key, nothing else.
	sqlCreateHandInbox = `CREATE TABLE IF NOT EXISTS handwritten_inbox (
		consumer    text        NOT NULL,
		key         text        NOT NULL,
		received_at timestamptz NOT NULL DEFAULT now(),
		PRIMARY KEY (consumer, key))`
	sqlClaimHandInbox = `INSERT INTO handwritten_inbox (consumer, key) VALUES ($1, $2) ON CONFLICT DO NOTHING`
)

func (s handwrittenInbox) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	b := baseline{name: s.Name(), handle: inboxHandle}
	return withEnv(ctx, h, s.Name(), func(env *benchenv.Env) ([]report.Result, error) {
		if _, err := env.Pool.Exec(ctx, sqlCreateHandInbox); err != nil {
			return nil, fmt.Errorf("%s: create inbox table: %w", s.Name(), err)
		}
		return b.run(ctx, env, h)
	})
}

// inboxHandle: one transaction per message, claim then effect.
func inboxHandle(ctx context.Context, pool *pgxpool.Pool, key string, c refapp.Charge) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	tag, err := tx.Exec(ctx, sqlClaimHandInbox, "handwritten", key)
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 1 { // a new key: run the effect
		if _, err := tx.Exec(ctx, sqlLedgerOne, key, c.Account, c.AmountCents); err != nil {
			return err
		}
	}
	return tx.Commit(ctx)
}
