package ops

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/store"
)

// DB is what ops needs of a database handle: *pgxpool.Pool and *pgx.Conn both
// qualify.
type DB interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// Config configures a Reader. The zero value reads idem's tables in public and
// shows no application rows.
type Config struct {
	// Schema is the Postgres schema of the idem_* tables (default "public").
	Schema string
	// Effects reads the application's own rows for a key (Inspect's
	// KeyReport.Effects). Nil shows none.
	Effects EffectsFunc
	// Counts reads the application's totals (Stats.Counts). Nil shows none.
	Counts CountsFunc
}

// Reader reads idem's tables of one schema, and the application's through its
// hooks. It holds no connection of its own and is safe for concurrent use.
type Reader struct {
	db  DB
	cfg Config
	st  *store.Store
}

// New returns a Reader of db.
func New(db DB, cfg Config) (*Reader, error) {
	if db == nil {
		return nil, fmt.Errorf("ops: nil DB")
	}
	if err := pgschema.Validate(cfg.Schema); err != nil {
		return nil, fmt.Errorf("ops: %w", err)
	}
	return &Reader{db: db, cfg: cfg, st: store.New(cfg.Schema)}, nil
}

// snapshot runs f in a read-only, repeatable-read transaction, with the database's
// clock at the snapshot.
func (r *Reader) snapshot(ctx context.Context, f func(tx pgx.Tx, asOf time.Time) error) error {
	return pgx.BeginTxFunc(ctx, r.db, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		// now() is the transaction's start, the same instant every query below
		// (and the outbox's backlog) measures ages from.
		var asOf time.Time
		if err := tx.QueryRow(ctx, sqlNow).Scan(&asOf); err != nil {
			return fmt.Errorf("ops: snapshot: %w", err)
		}
		return f(tx, asOf)
	})
}

// queryAll runs sql and collects every row with scan.
func queryAll[T any](ctx context.Context, tx pgx.Tx, what, sql string, scan func(pgx.CollectableRow) (T, error), args ...any) ([]T, error) {
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("ops: %s: %w", what, err)
	}
	out, err := pgx.CollectRows(rows, scan)
	if err != nil {
		return nil, fmt.Errorf("ops: %s: %w", what, err)
	}
	if out == nil {
		out = []T{} // JSON shows an empty list, not null
	}
	return out, nil
}

// age is how long before asOf t was, never negative (clocks of different hosts).
func age(asOf, t time.Time) time.Duration {
	return max(asOf.Sub(t), 0)
}

// OpenDeadLetters counts the dead letters not yet replayed, per consumer (the
// relay's under outbox.RelayConsumer). Consumers with none are absent.
func (r *Reader) OpenDeadLetters(ctx context.Context) (map[string]int64, error) {
	var out map[string]int64
	err := r.snapshot(ctx, func(tx pgx.Tx, _ time.Time) error {
		var err error
		out, err = r.openDeadLetters(ctx, tx)
		return err
	})
	return out, err
}

func (r *Reader) openDeadLetters(ctx context.Context, tx pgx.Tx) (map[string]int64, error) {
	out := map[string]int64{}
	rows, err := tx.Query(ctx, r.st.DeadLetters.Open)
	if err != nil {
		return nil, fmt.Errorf("ops: open dead letters: %w", err)
	}
	var name string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&name, &n}, func() error { out[name] = n; return nil })
	if err != nil {
		return nil, fmt.Errorf("ops: open dead letters: %w", err)
	}
	return out, nil
}

// sqlNow is the database's clock, the snapshot's "as of".
const sqlNow = `SELECT now()`
