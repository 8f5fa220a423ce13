package refapp

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/ops"
)

// The application's SQL for the operator's read model (package ops). payments and
// emails are written by the ingress under the scope and the bare key; ledger_entries
// by the charge consumer under the scoped key. payments and emails have no index on
// the key (their writes are guarded by idem_requests), so their look-ups scan: fine
// for a command an operator runs by hand.
const (
	sqlInspectPayments = `
SELECT id, account, amount_cents, created_at FROM payments
WHERE scope = $1 AND idempotency_key = $2
ORDER BY id`

	sqlInspectEmails = `
SELECT id, recipient, subject, created_at FROM emails
WHERE scope = $1 AND idempotency_key = $2
ORDER BY id`

	sqlInspectLedger = `
SELECT id, account, amount_cents, created_at FROM ledger_entries
WHERE idempotency_key = $1
ORDER BY id`

	sqlCounts = `
SELECT (SELECT count(*) FROM payments),
       (SELECT count(*) FROM emails),
       (SELECT count(*) FROM ledger_entries)`
)

// InspectEffects is the application's ops.EffectsFunc: its payments, emails and
// ledger_entries rows for one key, and what about them is wrong. It is what `worker
// inspect` shows under "application rows".
func InspectEffects(ctx context.Context, tx pgx.Tx, scope string, key idem.Key) (ops.Effects, error) {
	payments, err := ops.QueryTable(ctx, tx, "payments", sqlInspectPayments, scope, string(key))
	if err != nil {
		return ops.Effects{}, fmt.Errorf("refapp: %w", err)
	}
	emails, err := ops.QueryTable(ctx, tx, "emails", sqlInspectEmails, scope, string(key))
	if err != nil {
		return ops.Effects{}, fmt.Errorf("refapp: %w", err)
	}
	ledger, err := ops.QueryTable(ctx, tx, "ledger_entries", sqlInspectLedger, idem.ScopedKey(scope, key))
	if err != nil {
		return ops.Effects{}, fmt.Errorf("refapp: %w", err)
	}
	return ops.Effects{
		Tables:    []ops.EffectTable{payments, emails, ledger},
		Attention: attention(len(payments.Rows), len(emails.Rows), len(ledger.Rows)),
	}, nil
}

// attention names what is wrong with one key's rows. ledger_entries has no unique
// key on purpose, so a second row is a double effect of the charge consumer; a
// second payments or emails row means the ingress ran a handler twice instead of
// replaying the first response.
func attention(payments, emails, ledger int) []string {
	var notes []string
	if ledger > 1 {
		notes = append(notes, fmt.Sprintf("DOUBLE EFFECT: %d ledger entries for one key", ledger))
	}
	if payments > 1 {
		notes = append(notes, fmt.Sprintf("%d payments rows for one key (the ingress should have replayed)", payments))
	}
	if emails > 1 {
		notes = append(notes, fmt.Sprintf("%d emails rows for one key (the ingress should have replayed)", emails))
	}
	return notes
}

// Counts is the application's ops.CountsFunc: the totals of payments, emails and
// ledger_entries, which `worker stats` shows under "application rows".
func Counts(ctx context.Context, tx pgx.Tx) ([]ops.Count, error) {
	var p, e, l int64
	if err := tx.QueryRow(ctx, sqlCounts).Scan(&p, &e, &l); err != nil {
		return nil, fmt.Errorf("refapp: counts: %w", err)
	}
	return []ops.Count{{Name: "payments", N: p}, {Name: "emails", N: e}, {Name: "ledger_entries", N: l}}, nil
}

var (
	_ ops.EffectsFunc = InspectEffects
	_ ops.CountsFunc  = Counts
)
