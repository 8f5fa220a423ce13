package partition

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgschema"
)

// Table is one of the tables this package partitions.
type Table string

const (
	// Inbox is idem_inbox, ranged by expires_at: a partition whose upper bound has
	// passed holds only expired keys, so dropping it is exactly what the collector's
	// row deletes would have done.
	Inbox Table = "idem_inbox"
	// Outbox is idem_outbox, ranged by created_at: a partition is dropped once
	// none of its rows is pending, unproven or within its retention.
	Outbox Table = "idem_outbox"
)

// Tables are the partitioned tables, in the order they are converted and maintained.
func Tables() []Table { return []Table{Inbox, Outbox} }

// Day is the width of every partition.
const Day = 24 * time.Hour

// Defaults applied to zero fields of Config.
const (
	// DefaultAhead is how far past the furthest bound a new row can need the
	// partitions are ready: two days of slack if maintenance stops running.
	DefaultAhead = 2 * Day
	// DefaultLockTimeout bounds each wait for a table lock: a create or a drop that
	// cannot have its lock within it gives up until the next round rather than let
	// the hot path queue behind it.
	DefaultLockTimeout = 500 * time.Millisecond
	// DefaultKeyLifetime is the inbox key lifetime provisioned for when no
	// registered consumer asks for longer (dedupe.DefaultLifetime).
	DefaultKeyLifetime = 72 * time.Hour
)

// Config says where the tables are and how far ahead to keep partitions. The zero
// value means the defaults.
type Config struct {
	// Schema holds the idem_* tables (default "public").
	Schema string
	// Ahead is the slack of partitions made ready beyond the furthest bound a row
	// can need right now (default DefaultAhead). Rows beyond the last partition go
	// to the default partition, so a stalled maintenance loses nothing; it only
	// leaves those rows to row-by-row deletion.
	Ahead time.Duration
	// KeyLifetime is the longest inbox key lifetime to provision for, besides what
	// the consumers registered in idem_consumers asked for (default
	// DefaultKeyLifetime). The inbox needs partitions out to now plus it.
	KeyLifetime time.Duration
	// LockTimeout bounds each wait for a table lock (default DefaultLockTimeout).
	LockTimeout time.Duration
}

// Validate reports a configuration Convert and Maintain would refuse, so that a
// component that runs Maintain later (the worker's collector) can refuse it at once.
func (c Config) Validate() error {
	if err := pgschema.Validate(c.Schema); err != nil {
		return fmt.Errorf("partition: %w", err)
	}
	if c.Ahead < 0 || c.KeyLifetime < 0 || c.LockTimeout < 0 {
		return errors.New("partition: Ahead, KeyLifetime and LockTimeout must not be negative")
	}
	return nil
}

func (c Config) withDefaults() Config {
	c.Schema = pgschema.Name(c.Schema)
	if c.Ahead == 0 {
		c.Ahead = DefaultAhead
	}
	if c.KeyLifetime == 0 {
		c.KeyLifetime = DefaultKeyLifetime
	}
	if c.LockTimeout == 0 {
		c.LockTimeout = DefaultLockTimeout
	}
	return c
}

// spec is what differs between the two tables.
type spec struct {
	key        string // the partition key
	primaryKey string // the partitioned table's primary key: the old one plus key (read at conversion)
	defaultMax string // the newest partition key in the default partition
	live       string // whether a partition holds a row that has not expired
}

func (t Table) spec() spec {
	if t == Inbox {
		return spec{key: "expires_at", defaultMax: sqlDefaultMaxInbox, live: sqlLiveInbox}
	}
	return spec{key: "created_at", defaultMax: sqlDefaultMaxOutbox, live: sqlLiveOutbox}
}

// Partition is one partition of a table.
type Partition struct {
	Table Table  `json:"table"`
	Name  string `json:"name"`
	// From and To bound the partition key, From included, To excluded (UTC). Both
	// are zero for the default partition.
	From time.Time `json:"from,omitzero"`
	To   time.Time `json:"to,omitzero"`
	// Default is the partition that takes rows no ranged partition covers: the
	// table's rows from before the conversion, and rows beyond the last partition.
	Default bool `json:"default,omitempty"`
	// Rows is the planner's estimate (pg_class.reltuples); -1 before the first
	// ANALYZE.
	Rows int64 `json:"rows_estimate"`
}

func (p Partition) String() string {
	if p.Default {
		return p.Name + " (default)"
	}
	return fmt.Sprintf("%s [%s, %s)", p.Name, p.From.Format(time.DateOnly), p.To.Format(time.DateOnly))
}

// Querier is what List needs from a pool, connection or transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// IsPartitioned reports whether table t is partitioned in schema.
func IsPartitioned(ctx context.Context, q Querier, schema string, t Table) (bool, error) {
	ok, err := pgschema.Partitioned(ctx, q, schema, string(t))
	if err != nil {
		return false, fmt.Errorf("partition: %w", err)
	}
	return ok, nil
}

// List returns t's partitions, the default one first, then by range.
func List(ctx context.Context, q Querier, cfg Config, t Table) ([]Partition, error) {
	cfg = cfg.withDefaults()
	return list(ctx, q, cfg.Schema, t)
}

func list(ctx context.Context, q Querier, schema string, t Table) ([]Partition, error) {
	rows, err := q.Query(ctx, sqlPartitions, schema, string(t))
	if err != nil {
		return nil, fmt.Errorf("partition: list %s: %w", t, err)
	}
	defer rows.Close()
	var out []Partition
	for rows.Next() {
		p := Partition{Table: t}
		var from, to *time.Time
		if err := rows.Scan(&p.Name, &p.Default, &from, &to, &p.Rows); err != nil {
			return nil, fmt.Errorf("partition: list %s: %w", t, err)
		}
		if !p.Default {
			if from == nil || to == nil {
				return nil, fmt.Errorf("partition: list %s: partition %s is not a range of timestamps", t, p.Name)
			}
			p.From, p.To = from.UTC(), to.UTC()
		}
		out = append(out, p)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("partition: list %s: %w", t, err)
	}
	slices.SortFunc(out, func(a, b Partition) int {
		if a.Default != b.Default {
			if a.Default {
				return -1
			}
			return 1
		}
		return a.From.Compare(b.From)
	})
	return out, nil
}

// ident quotes schema.name.
func ident(schema, name string) string { return pgx.Identifier{schema, name}.Sanitize() }

// defaultName is the default partition of t: the table as it was before the
// conversion, under a new name.
func defaultName(t Table) string { return string(t) + "_default" }

// partitionName is the ranged partition of t starting on day.
func partitionName(t Table, day time.Time) string { return string(t) + "_p" + day.Format("20060102") }

// DefaultPartition is the qualified name of t's default partition in schema: where
// the collector still deletes expired rows one by one.
func DefaultPartition(schema string, t Table) string {
	return ident(pgschema.Name(schema), defaultName(t))
}

// isLockTimeout reports a lock_timeout (SQLSTATE 55P03): try again next round.
func isLockTimeout(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "55P03"
}

// isCheckViolation reports an ATTACH refused because the default partition holds
// rows of the new partition's range (SQLSTATE 23514).
func isCheckViolation(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23514"
}

// inTx runs fn in a transaction that holds the partitioner's advisory lock, with the configured lock_timeout for every lock it takes after that one.
func inTx(ctx context.Context, pool *pgxpool.Pool, lockTimeout time.Duration, fn func(pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlLock); err != nil {
			return fmt.Errorf("advisory lock: %w", err)
		}
		if lockTimeout > 0 {
			if _, err := tx.Exec(ctx, sqlSetLockTimeout, fmt.Sprintf("%dms", max(lockTimeout.Milliseconds(), 1))); err != nil {
				return err
			}
		}
		return fn(tx)
	})
}

func sqlf(format string, args ...string) string {
	a := make([]any, len(args))
	for i, s := range args {
		a[i] = s
	}
	return fmt.Sprintf(format, a...)
}

// floorDay is the start of t's UTC day.
func floorDay(t time.Time) time.Time { return t.UTC().Truncate(Day) }

// covered reports whether a ranged partition covers the instant at.
func covered(parts []Partition, at time.Time) bool {
	for _, p := range parts {
		if !p.Default && !at.Before(p.From) && at.Before(p.To) {
			return true
		}
	}
	return false
}
