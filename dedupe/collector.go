package dedupe

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// CollectorConfig configures a Collector. The zero value means the defaults.
type CollectorConfig struct {
	// BatchSize is the most rows one DELETE removes (default 1000): small batches
	// hold row locks briefly and keep WAL bursts small.
	BatchSize int
	// Interval between collection rounds (default 1m).
	Interval time.Duration
	// Pause between batches of one round (default 0), to yield to the hot path.
	Pause time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// OnDeleted, when set, is told each table's deletions (for metrics).
	OnDeleted func(table string, n int64)
}

// Collector deletes expired rows from idem_inbox, idem_requests and idem_outbox
// (published rows only) in bounded batches. Retention keeps storage in check; the
// key lifetime itself is never shortened to do so.
type Collector struct {
	pool *pgxpool.Pool
	cfg  CollectorConfig
}

// NewCollector returns a collector over pool.
func NewCollector(pool *pgxpool.Pool, cfg CollectorConfig) *Collector {
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 1000
	}
	if cfg.Interval <= 0 {
		cfg.Interval = time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Collector{pool: pool, cfg: cfg}
}

// Run collects every Interval until ctx is cancelled.
func (c *Collector) Run(ctx context.Context) error {
	t := time.NewTicker(c.cfg.Interval)
	defer t.Stop()
	for {
		if n, err := c.CollectOnce(ctx); err != nil && ctx.Err() == nil {
			c.cfg.Logger.Error("collector: round failed", "err", err)
		} else if n > 0 {
			c.cfg.Logger.Info("collector: expired rows deleted", "rows", n)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// CollectOnce deletes every expired row, batch by batch, and returns how many.
func (c *Collector) CollectOnce(ctx context.Context) (int64, error) {
	var total int64
	for _, table := range collectedTables {
		for {
			tag, err := c.pool.Exec(ctx, table.sql, c.cfg.BatchSize)
			if err != nil {
				return total, fmt.Errorf("dedupe: collect %s: %w", table.name, err)
			}
			n := tag.RowsAffected()
			total += n
			if c.cfg.OnDeleted != nil && n > 0 {
				c.cfg.OnDeleted(table.name, n)
			}
			if n < int64(c.cfg.BatchSize) {
				break
			}
			if c.cfg.Pause > 0 {
				select {
				case <-ctx.Done():
					return total, ctx.Err()
				case <-time.After(c.cfg.Pause):
				}
			}
		}
	}
	return total, nil
}
