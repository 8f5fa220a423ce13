package dedupe

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DefaultLifetime is how long an inbox key is remembered by default. It must outlast
// every window in which the intent can be delivered again; see CheckLifetimes.
const DefaultLifetime = 72 * time.Hour

// Fingerprint is the SHA-256 of a payload: what a key was first seen with.
func Fingerprint(payload []byte) []byte {
	sum := sha256.Sum256(payload)
	return sum[:]
}

// Querier is what the inbox needs from a connection, pool or transaction.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Claim is one key to claim, with the fingerprint of the payload it arrived with.
type Claim struct {
	Key         string
	Fingerprint []byte
}

// ClaimBatch claims keys for consumer inside tx and reports which were new. Claims
// must not repeat a key (the consumer folds repeats inside a batch itself). The
// claims are sorted by key in place, so that concurrent batches lock in one order.
// New rows are stored as done with a nil result; SetResults fills results in.
func ClaimBatch(ctx context.Context, tx pgx.Tx, consumer string, claims []Claim, lifetime time.Duration) (map[string]bool, error) {
	if len(claims) == 0 {
		return map[string]bool{}, nil
	}
	if lifetime <= 0 {
		lifetime = DefaultLifetime
	}
	slices.SortFunc(claims, func(a, b Claim) int {
		switch {
		case a.Key < b.Key:
			return -1
		case a.Key > b.Key:
			return 1
		}
		return 0
	})
	keys := make([]string, len(claims))
	fps := make([][]byte, len(claims))
	for i, c := range claims {
		keys[i], fps[i] = c.Key, c.Fingerprint
	}
	rows, err := tx.Query(ctx, sqlClaimBatch, consumer, keys, fps, lifetime)
	if err != nil {
		return nil, fmt.Errorf("dedupe: claim: %w", err)
	}
	claimed, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("dedupe: claim: %w", err)
	}
	out := make(map[string]bool, len(claimed))
	for _, k := range claimed {
		out[k] = true
	}
	return out, nil
}

// SetResults stores the handlers' results for keys claimed in tx. Nil results are
// skipped: the row already says done.
func SetResults(ctx context.Context, tx pgx.Tx, consumer string, results map[string][]byte) error {
	b := &pgx.Batch{}
	for k, v := range results {
		if v == nil {
			continue
		}
		b.Queue(sqlSetResult, consumer, k, v)
	}
	if b.Len() == 0 {
		return nil
	}
	br := tx.SendBatch(ctx, b)
	for range b.Len() {
		tag, err := br.Exec()
		if err != nil {
			br.Close()
			return fmt.Errorf("dedupe: store results: %w", err)
		}
		if tag.RowsAffected() != 1 {
			br.Close()
			return fmt.Errorf("dedupe: store results: a key was not claimed in this transaction")
		}
	}
	if err := br.Close(); err != nil {
		return fmt.Errorf("dedupe: store results: %w", err)
	}
	return nil
}

// Record is what the inbox remembers of a key.
type Record struct {
	Key         string
	Fingerprint []byte
	Status      Status
	Result      []byte
	LeaseUntil  time.Time
	Step        string
	CreatedAt   time.Time
	CompletedAt time.Time
	ExpiresAt   time.Time
}

// Status of an inbox row.
type Status string

const (
	// StatusDone: the effect happened and Result is the first result.
	StatusDone Status = "done"
	// StatusLeased: an external effect is under way (or its worker died) until
	// LeaseUntil; see Lease.
	StatusLeased Status = "leased"
)

// Matches reports whether payload is what the key was first claimed with.
func (r Record) Matches(fingerprint []byte) bool { return bytes.Equal(r.Fingerprint, fingerprint) }

// Lookup returns the records of keys for consumer; keys absent from the inbox are
// absent from the map.
func Lookup(ctx context.Context, q Querier, consumer string, keys []string) (map[string]Record, error) {
	rows, err := q.Query(ctx, sqlLookup, consumer, keys)
	if err != nil {
		return nil, fmt.Errorf("dedupe: lookup: %w", err)
	}
	defer rows.Close()
	out := make(map[string]Record, len(keys))
	for rows.Next() {
		r, err := scanRecord(rows)
		if err != nil {
			return nil, fmt.Errorf("dedupe: lookup: %w", err)
		}
		out[r.Key] = r
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("dedupe: lookup: %w", err)
	}
	return out, nil
}

func scanRecord(row pgx.Row) (Record, error) {
	var (
		r                Record
		status           string
		step             *string
		lease, completed *time.Time
	)
	if err := row.Scan(&r.Key, &r.Fingerprint, &status, &r.Result, &lease, &step, &r.CreatedAt, &completed, &r.ExpiresAt); err != nil {
		return Record{}, err
	}
	r.Status = Status(status)
	if lease != nil {
		r.LeaseUntil = *lease
	}
	if completed != nil {
		r.CompletedAt = *completed
	}
	if step != nil {
		r.Step = *step
	}
	return r, nil
}

// Unclaim deletes claims made earlier in the same transaction tx, for deliveries
// that will not run after all. Never call it for keys claimed by another
// transaction: that would forget a committed effect.
func Unclaim(ctx context.Context, tx pgx.Tx, consumer string, keys []string) error {
	if _, err := tx.Exec(ctx, sqlUnclaim, consumer, keys); err != nil {
		return fmt.Errorf("dedupe: unclaim: %w", err)
	}
	return nil
}
