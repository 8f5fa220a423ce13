package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/pgschema"
)

// defaultDeadLetterRetention is how long a dead letter is kept after it was filed,
// replayed or not. A dead letter is also kept, however old, until its replay
// horizon (when its consumer's inbox may forget the key) has passed: the record of
// a message must not vanish while replaying it is still allowed.
const defaultDeadLetterRetention = 30 * 24 * time.Hour

// collector deletes expired rows from idem_inbox, idem_requests, idem_outbox
// (published rows only) and idem_dead_letters in bounded batches. Retention keeps
// storage in check; the key lifetimes themselves are never shortened to do so.
type collector struct {
	pool   *pgxpool.Pool
	schema string
	cfg    RetentionConfig
	// keyLifetime is the longest of the worker's consumers' inbox key lifetimes:
	// the partitions are made ready out to it.
	keyLifetime time.Duration
	log         *slog.Logger
	observe     idem.Observer
	tables      []collectedTable
	clock       *clockGuard

	mu      sync.Mutex
	waiting map[partition.Table]time.Time // the partitions_from last warned about, per table
}

// clockJumpTolerance is how far the database's clock may run ahead of the
// collector's own between two of its rounds before the collector holds. Every
// expiry is measured by the database's clock (now()): a forward step of it, say a
// wrong time source moving it three days on, would otherwise delete every key at
// the next round while its intents can still arrive. Slow drift and the small
// steps of time synchronisation stay far below it.
const clockJumpTolerance = 5 * time.Minute

// clockGuard compares the database's clock with this process's monotonic clock,
// round to round. While the database's has run ahead by more than
// clockJumpTolerance since the last round that agreed, the collector holds:
// nothing is deleted and no partition is dropped. It resumes when the database's
// clock comes back; a new process takes the database's clock as it finds it (the
// way to accept a jump that was a correction).
type clockGuard struct {
	mono      func() time.Duration // this process's monotonic clock
	tolerance time.Duration

	mu       sync.Mutex
	anchored bool
	db       time.Time     // the database's clock at the last round that agreed
	at       time.Duration // mono at that round
	skew     time.Duration // how far the database's clock ran ahead at the last round
	held     bool
}

func newClockGuard() *clockGuard {
	start := time.Now()
	return &clockGuard{mono: func() time.Duration { return time.Since(start) }, tolerance: clockJumpTolerance}
}

// check records the database's clock at a round and reports how far it ran ahead
// of this process's since the last round that agreed, and whether to hold.
func (g *clockGuard) check(dbNow time.Time) (skew time.Duration, hold bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	mono := g.mono()
	if !g.anchored {
		g.anchored, g.db, g.at = true, dbNow, mono
		return 0, false
	}
	g.skew = dbNow.Sub(g.db) - (mono - g.at)
	if g.skew > g.tolerance {
		// Not re-anchored: the hold lasts while the jump does.
		g.held = true
		return g.skew, true
	}
	g.held = false
	g.db, g.at = dbNow, mono
	return g.skew, false
}

// state is what the metrics show: the last skew measured, and whether the
// collector holds.
func (g *clockGuard) state() (skew time.Duration, held bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.skew, g.held
}

type collectedTable struct {
	name, sql string
	// args, when set, are the statement's parameters after the batch size.
	args func(RetentionConfig) []any
	// defaultSQL, for a table package partition may have partitioned, is sql run
	// against the table's default partition alone. A partitioned table's ranged
	// partitions are dropped whole; its default partition (the rows from before
	// the conversion, and any beyond the last partition) is collected row by row.
	// The plain statement would be wrong there, not just slow: a ctid is unique
	// within one partition only.
	defaultSQL string
}

func newCollector(inst *install.Installation, cfg RetentionConfig, keyLifetime time.Duration) *collector {
	schema := inst.Schema()
	c := &collector{pool: inst.Pool(), schema: schema, cfg: cfg, keyLifetime: keyLifetime,
		log: inst.Logger().With("component", "collector"), observe: inst.Observer(), clock: newClockGuard()}
	st := parts.Of(inst).Store
	c.tables = []collectedTable{
		{name: string(partition.Inbox), sql: st.Inbox.Collect, defaultSQL: st.Inbox.CollectIn(partition.DefaultPartition(schema, partition.Inbox))},
		{name: "idem_requests", sql: st.Requests.Collect},
		{name: string(partition.Outbox), sql: st.Outbox.Collect, defaultSQL: st.Outbox.CollectIn(partition.DefaultPartition(schema, partition.Outbox))},
		{name: "idem_outbox_published", sql: st.Published.Collect,
			args: func(c RetentionConfig) []any { return []any{c.Published} }},
		{name: "idem_attempts", sql: st.Attempts.Collect},
		{name: "idem_dead_letters", sql: st.DeadLetters.Collect,
			args: func(c RetentionConfig) []any { return []any{c.deadLetterRetention()} }},
	}
	return c
}

// partitionConfig is the partitioner's configuration of this collector.
func (c *collector) partitionConfig() partition.Config {
	return c.cfg.partitions(c.schema, c.keyLifetime)
}

// maintainPartitions makes partitions ready ahead and drops the expired ones, when
// the tables are partitioned (partition.Convert, `worker partition`).
func (c *collector) maintainPartitions(ctx context.Context) error {
	r, err := partition.Maintain(ctx, c.pool, c.partitionConfig())
	if err != nil {
		return fmt.Errorf("collect: %w", err)
	}
	for _, p := range r.Created {
		c.log.InfoContext(ctx, "collector: partition created", "table", p.Table, "partition", p.Name, "from", p.From, "to", p.To)
	}
	for _, p := range r.Dropped {
		c.log.InfoContext(ctx, "collector: expired partition dropped", "table", p.Table, "partition", p.Name, "rows_estimate", p.Rows)
		c.observe.Observe(idem.Event{Component: idem.ComponentCollector, Name: string(p.Table), Outcome: idem.OutcomeDropped, Count: 1})
	}
	for _, d := range r.Deferred {
		c.log.WarnContext(ctx, "collector: partition maintenance deferred", "why", d)
	}
	// A table converted while in use waits about one key lifetime for its day
	// partitions: said once, and again when the day it waits for changes.
	c.mu.Lock()
	defer c.mu.Unlock()
	seen := map[partition.Table]time.Time{}
	for _, wt := range r.Waiting {
		seen[wt.Table] = wt.From
		if prev, ok := c.waiting[wt.Table]; ok && prev.Equal(wt.From) {
			continue
		}
		c.log.WarnContext(ctx, "collector: day partitions wait for the default partition: "+wt.String(),
			"table", wt.Table, "default_holds_until", wt.Until, "partitions_from", wt.From, "days", len(wt.Days))
	}
	c.waiting = seen
	return nil
}

// deadLetterRetention is how long dead letters are kept after they were filed.
// Retention is the collector's alone (the rows' expires_at stays NULL), so that
// it is one setting for every consumer and a change applies to the rows already
// filed.
func (c RetentionConfig) deadLetterRetention() time.Duration {
	if c.DeadLetters > 0 {
		return c.DeadLetters
	}
	return defaultDeadLetterRetention
}

// run collects every Interval until ctx is cancelled.
func (c *collector) run(ctx context.Context) error {
	t := time.NewTicker(c.cfg.Interval)
	defer t.Stop()
	for {
		if n, err := c.collectOnce(ctx); err != nil && ctx.Err() == nil {
			c.log.ErrorContext(ctx, "collector: round failed", "err", err)
		} else if n > 0 {
			c.log.InfoContext(ctx, "collector: expired rows deleted", "rows", n)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// collectOnce maintains the partitions, then deletes every expired row, batch by
// batch, and returns how many rows it deleted. It does neither while the
// database's clock has jumped ahead of this process's (clockGuard).
func (c *collector) collectOnce(ctx context.Context) (total int64, err error) {
	var dbNow time.Time
	if err := c.pool.QueryRow(ctx, sqlCollectorNow).Scan(&dbNow); err != nil {
		return 0, fmt.Errorf("collect: read the database's clock: %w", err)
	}
	if skew, hold := c.clock.check(dbNow); hold {
		return 0, fmt.Errorf("collect: held: the database's clock ran %s ahead of this worker's since the collector's last round (more than %s), "+
			"so every expiry came that much early; nothing is deleted and no partition is dropped until it comes back. "+
			"If the database's new time is the right one, restart the worker", skew.Round(time.Second), clockJumpTolerance)
	} else if skew < -clockJumpTolerance {
		c.log.WarnContext(ctx, "collector: the database's clock went back since the last round; keys are kept that much longer",
			"by", (-skew).Round(time.Second))
	}
	// A failed maintenance does not hold up the row deletes; the round reports it.
	if merr := c.maintainPartitions(ctx); merr != nil {
		defer func() { err = errors.Join(err, merr) }()
	}
	for _, table := range c.tables {
		args := []any{c.cfg.BatchSize}
		if table.args != nil {
			args = append(args, table.args(c.cfg)...)
		}
		sql := table.sql
		if table.defaultSQL != "" {
			partitioned, err := pgschema.Partitioned(ctx, c.pool, c.schema, table.name)
			if err != nil {
				return total, fmt.Errorf("collect %s: %w", table.name, err)
			}
			if partitioned {
				sql = table.defaultSQL
			}
		}
		for {
			tag, err := c.pool.Exec(ctx, sql, args...)
			if err != nil {
				return total, fmt.Errorf("collect %s: %w", table.name, err)
			}
			n := tag.RowsAffected()
			total += n
			if n > 0 {
				c.observe.Observe(idem.Event{Component: idem.ComponentCollector, Name: table.name, Outcome: idem.OutcomeDeleted, Count: int(n)})
			}
			if n < int64(c.cfg.BatchSize) {
				break
			}
		}
	}
	return total, nil
}

// Collect runs one collection round of inst without a Worker: the partition
// maintenance, then the deletion of every expired row, batch by batch.
// It returns how many rows it deleted. It is what the collector of a worker does
// every Retention.Interval, for operators' jobs and benchmarks; having no earlier
// round to compare with, it cannot tell that the database's clock jumped.
func Collect(ctx context.Context, inst *install.Installation, cfg RetentionConfig) (int64, error) {
	n, err := newCollector(inst, cfg.withDefaults(), 0).collectOnce(ctx)
	if err != nil {
		return n, fmt.Errorf("worker: %w", err)
	}
	return n, nil
}

// CollectOnce deletes every expired row now, batch by batch, and returns how many:
// what the collector does every Retention.Interval, for tests and operators.
func (w *Worker) CollectOnce(ctx context.Context) (int64, error) {
	c := w.collector
	if c == nil {
		c = newCollector(w.inst, w.cfg.Retention, 0)
	}
	n, err := c.collectOnce(ctx)
	if err != nil {
		return n, fmt.Errorf("worker: %w", err)
	}
	return n, nil
}

// sqlCollectorNow is the database's clock, by which every expiry is measured.
const sqlCollectorNow = `SELECT now()`
