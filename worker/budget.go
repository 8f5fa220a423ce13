package worker

import (
	"context"
	"fmt"
	"runtime"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// budget splits the pool's connections between the parts of the worker, so that
// none of them can starve the others: the consumers and the relay each need their
// connections to make progress, and the ingress, whose requests can pile up (a
// flood of same-key duplicates each waiting for the first), gets what is left and
// no more — beyond it, requests are refused with 503 before they take one.
type budget struct {
	reserved int    // consumers, relay, collector, health
	ingress  int    // what the ingress may hold at once (at least 1)
	short    string // why the pool is smaller than the parts need; "" if it is not
}

// reserved is what the worker's parts other than the ingress can hold at once, and
// who holds it.
func reserved(cfg Config) (n int, parts []string) {
	for _, cc := range cfg.Consumers {
		c := cc.WithDefaults().Concurrency // one transaction (or lease statement) per worker goroutine
		n += c
		parts = append(parts, fmt.Sprintf("consumer %s %d", cc.Name, c))
	}
	if !cfg.DisableRelay {
		n += 2 // a batch, and the LISTEN connection while it is being set up
		parts = append(parts, "relay 2")
	}
	if !cfg.DisableRetention {
		n++
		parts = append(parts, "collector 1")
	}
	n++ // readiness and scrape-time metrics
	parts = append(parts, "health 1")
	return n, parts
}

// poolSize is the pool NewPool opens for cfg: the parts' connections on top of
// what pgxpool would give a whole service (defaultConns), which is then the
// ingress's and the service's own queries'.
func poolSize(cfg Config, defaultConns int32) int32 {
	n, _ := reserved(cfg)
	share := defaultConns
	if cfg.Ingress != nil {
		share = max(share, int32(cfg.Ingress.MaxInFlight))
	}
	return int32(n) + share
}

func connectionBudget(pool *pgxpool.Pool, cfg Config) budget {
	var b budget
	var parts []string
	b.reserved, parts = reserved(cfg)
	maxConns := int(pool.Config().MaxConns)
	need := b.reserved
	if cfg.Ingress != nil {
		need++ // at least one request at a time
		parts = append(parts, "ingress 1")
	}
	if maxConns < need {
		// Not fatal: the parts then wait for each other's connections now and then.
		// The ingress is still bounded.
		effect := "they will wait for each other"
		if cfg.Ingress != nil {
			effect += ", and the ingress runs one request at a time"
		}
		b.short = fmt.Sprintf("the pool's MaxConns %d is smaller than the %d connections the worker's parts can use at once (%s); "+
			"%s: open the pool with worker.NewPool, which sizes it from the worker's Config (%d connections here), "+
			"or raise pool_max_conns in the URL (pgxpool.Config.MaxConns)",
			maxConns, need, strings.Join(parts, ", "), effect, poolSize(cfg, max(4, int32(runtime.NumCPU()))))
	}
	b.ingress = max(1, maxConns-b.reserved)
	return b
}

// NewPool opens a pgx pool sized for a worker built from cfg: the connections its
// consumers, relay, collector and health checks can hold at once, plus pgxpool's
// own default (the greater of 4 and the number of CPUs, or cfg.Ingress.MaxInFlight
// if that is larger) for the ingress's requests and the service's own queries.
// pgxpool's default alone is less than the parts use on a small machine, and New
// warns about such a pool. A pool_max_conns in databaseURL is the operator's choice
// and is kept.
//
// The pool is the caller's, as with any pool given to New: close it after Stop.
func NewPool(ctx context.Context, databaseURL string, cfg Config) (*pgxpool.Pool, error) {
	cc, err := pgx.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("worker: pool: %w", err)
	}
	_, explicit := cc.RuntimeParams["pool_max_conns"]
	pcfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("worker: pool: %w", err)
	}
	if !explicit {
		pcfg.MaxConns = poolSize(cfg, pcfg.MaxConns)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("worker: pool: %w", err)
	}
	return pool, nil
}
