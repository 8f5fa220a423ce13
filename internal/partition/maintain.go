package partition

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/store"
)

// Report says what one Maintain round did.
type Report struct {
	// Created are the partitions made ready ahead.
	Created []Partition `json:"created"`
	// Dropped are the partitions whose every row had expired.
	Dropped []Partition `json:"dropped"`
	// Kept are partitions past their range that still hold a live row (an outbox
	// row not yet published or proven): they wait for it.
	Kept []Partition `json:"kept,omitempty"`
	// Deferred says what waited for the next round and why: a lock not had within
	// LockTimeout, or a row of a new partition's day found in the default partition.
	Deferred []string `json:"deferred,omitempty"`
	// Waiting are the tables whose default partition holds rows of the days ahead,
	// as after converting a table in use: those days get no partition.
	Waiting []Waiting `json:"waiting,omitempty"`
	// NotPartitioned are the tables that are plain (Convert was not run).
	NotPartitioned []Table `json:"not_partitioned,omitempty"`
}

// Waiting says that a table's default partition holds rows of the days ahead, so
// those days cannot have partitions of their own: a partition cannot be attached
// over rows the default partition already holds. This is the state after Convert
// of a table in use, for about one key lifetime (the inbox) or the rest of the day
// (the outbox). The rows of those days, and new rows that fall in them, stay in the
// default partition and are deleted row by row by the collector; from From on,
// every day has its partition.
type Waiting struct {
	Table Table `json:"table"`
	// Until is the newest partition key in the default partition (the inbox's
	// expires_at, the outbox's created_at): once it has passed and the collector
	// has deleted those rows, the default partition holds no live row.
	Until time.Time `json:"until"`
	// From is the first day that has (or can have) a partition of its own.
	From time.Time `json:"partitions_from"`
	// Days are the partitions not created for it.
	Days []string `json:"days"`
}

func (w Waiting) String() string {
	return fmt.Sprintf("%s: the default partition holds rows up to %s (the table was converted while in use): "+
		"%d day(s) get no partition of their own (%s), their rows stay in the default partition and are deleted row by row; "+
		"day partitions can be attached from %s on",
		w.Table, w.Until.UTC().Format(time.RFC3339), len(w.Days), strings.Join(w.Days, ", "), w.From.UTC().Format(time.DateOnly))
}

// Maintain makes partitions ready ahead and drops the ones whose rows have all
// expired, for every partitioned table; a plain table is left alone. Run it
// regularly (the worker's collector does, every Retention.Interval). Several
// workers may run it at once: rounds are serialised by an advisory lock.
//
// What "expired" means is the collector's definition, so the two never disagree:
//   - idem_inbox is ranged by expires_at. A partition whose upper bound is at or
//     before now() holds only rows with expires_at < now(), which the collector
//     would delete; it is dropped whole.
//   - idem_outbox is ranged by created_at. A partition past its range is dropped
//     once none of its rows has a NULL expiry (pending, or published and not yet
//     proven by the reconciler) or an expiry still ahead. Until then it is kept.
//
// Both checks are repeated under the drop's lock, so a row written into the
// partition by a transaction still running when the round began is seen.
func Maintain(ctx context.Context, pool *pgxpool.Pool, cfg Config) (Report, error) {
	if err := cfg.Validate(); err != nil {
		return Report{}, err
	}
	cfg = cfg.withDefaults()
	var r Report
	for _, t := range Tables() {
		ok, err := pgschema.Partitioned(ctx, pool, cfg.Schema, string(t))
		if err != nil {
			return r, fmt.Errorf("partition: %w", err)
		}
		if !ok {
			r.NotPartitioned = append(r.NotPartitioned, t)
			continue
		}
		if err := maintainTable(ctx, pool, cfg, t, &r); err != nil {
			return r, err
		}
	}
	return r, nil
}

// plan is a table's state at the start of a round.
type plan struct {
	parts      []Partition
	now        time.Time
	horizon    time.Time  // the furthest partition key a new row can have, plus Ahead
	defaultMax *time.Time // the newest partition key in the default partition
}

func maintainTable(ctx context.Context, pool *pgxpool.Pool, cfg Config, t Table, r *Report) error {
	p, err := readPlan(ctx, pool, cfg, t)
	if err != nil {
		return fmt.Errorf("partition: maintain %s: %w", t, err)
	}
	// Create: every day from today to the horizon that no partition covers.
	var waiting *Waiting
	for day := floorDay(p.now); !day.After(p.horizon); day = day.Add(Day) {
		if covered(p.parts, day) {
			continue
		}
		if p.defaultMax != nil && !p.defaultMax.Before(day) {
			if waiting == nil {
				waiting = &Waiting{Table: t, Until: p.defaultMax.UTC(), From: floorDay(*p.defaultMax).Add(Day)}
			}
			waiting.Days = append(waiting.Days, partitionName(t, day))
			continue
		}
		created, err := create(ctx, pool, cfg, t, day)
		switch {
		case isLockTimeout(err):
			r.Deferred = append(r.Deferred, fmt.Sprintf("%s: create %s: lock not had within %s", t, partitionName(t, day), cfg.LockTimeout))
		case isCheckViolation(err):
			// The default partition holds a row of that day after all (an outbox
			// row of a long transaction, newer than the newest ids suggested).
			r.Deferred = append(r.Deferred, fmt.Sprintf("%s: create %s: the default partition holds rows of that day", t, partitionName(t, day)))
		case err != nil:
			return fmt.Errorf("partition: maintain %s: %w", t, err)
		default:
			r.Created = append(r.Created, created)
		}
	}
	if waiting != nil {
		r.Waiting = append(r.Waiting, *waiting)
	}
	// Drop: every ranged partition whose range has passed and that holds no live row.
	for _, part := range p.parts {
		if part.Default || part.To.After(p.now) {
			continue
		}
		dropped, err := drop(ctx, pool, cfg, t, part)
		switch {
		case isLockTimeout(err):
			r.Deferred = append(r.Deferred, fmt.Sprintf("%s: drop %s: lock not had within %s", t, part.Name, cfg.LockTimeout))
		case err != nil:
			return fmt.Errorf("partition: maintain %s: %w", t, err)
		case dropped:
			r.Dropped = append(r.Dropped, part)
		default:
			r.Kept = append(r.Kept, part)
		}
	}
	return nil
}

func readPlan(ctx context.Context, pool *pgxpool.Pool, cfg Config, t Table) (plan, error) {
	var p plan
	err := inTx(ctx, pool, cfg.LockTimeout, func(tx pgx.Tx) error {
		var err error
		if p.parts, err = list(ctx, tx, cfg.Schema, t); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, sqlNow).Scan(&p.now); err != nil {
			return err
		}
		p.now = p.now.UTC()
		reach := time.Duration(0)
		if t == Inbox {
			var secs float64
			if err := tx.QueryRow(ctx, store.New(cfg.Schema).Consumers.MaxLifetime).Scan(&secs); err != nil {
				return fmt.Errorf("registered lifetimes: %w", err)
			}
			reach = max(cfg.KeyLifetime, time.Duration(secs*float64(time.Second)))
		}
		p.horizon = p.now.Add(reach + cfg.Ahead)
		for _, part := range p.parts {
			if !part.Default {
				continue
			}
			var newest *time.Time
			if err := tx.QueryRow(ctx, sqlf(t.spec().defaultMax, ident(cfg.Schema, string(t)), ident(cfg.Schema, part.Name))).Scan(&newest); err != nil {
				return fmt.Errorf("default partition: %w", err)
			}
			p.defaultMax = newest
		}
		return nil
	})
	return p, err
}

// create makes the partition of t for [day, day+1).
func create(ctx context.Context, pool *pgxpool.Pool, cfg Config, t Table, day time.Time) (Partition, error) {
	part := Partition{Table: t, Name: partitionName(t, day), From: day, To: day.Add(Day), Rows: -1}
	err := inTx(ctx, pool, cfg.LockTimeout, func(tx pgx.Tx) error {
		table, name := ident(cfg.Schema, string(t)), ident(cfg.Schema, part.Name)
		for _, sql := range []string{
			sqlf(sqlCreateTable, table, name),
			sqlf(sqlAttach, table, name, part.From.Format(time.RFC3339), part.To.Format(time.RFC3339)),
		} {
			if _, err := tx.Exec(ctx, sql); err != nil {
				return fmt.Errorf("%s: %w", sql, err)
			}
		}
		return nil
	})
	if err != nil {
		return part, fmt.Errorf("create %s: %w", part.Name, err)
	}
	return part, nil
}

// errKeep rolls back a drop that found a live row under its lock.
var errKeep = errors.New("partition holds a live row")

// drop drops part unless it still holds a live row, which it checks under the
// lock that keeps every writer out.
func drop(ctx context.Context, pool *pgxpool.Pool, cfg Config, t Table, part Partition) (bool, error) {
	table, name := ident(cfg.Schema, string(t)), ident(cfg.Schema, part.Name)
	live := sqlf(t.spec().live, table, name)
	// First without the lock: a partition still in use (an outbox day with
	// unproven rows) is kept without queueing anyone behind an exclusive lock.
	var busy bool
	if err := pool.QueryRow(ctx, live).Scan(&busy); err != nil {
		return false, fmt.Errorf("check %s: %w", part.Name, err)
	}
	if busy {
		return false, nil
	}
	err := inTx(ctx, pool, cfg.LockTimeout, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlf(sqlLockParent, table, name)); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, live).Scan(&busy); err != nil {
			return err
		}
		if busy {
			return errKeep
		}
		_, err := tx.Exec(ctx, sqlf(sqlDrop, table, name))
		return err
	})
	if errors.Is(err, errKeep) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("drop %s: %w", part.Name, err)
	}
	return true, nil
}
