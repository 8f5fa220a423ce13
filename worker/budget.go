package worker

import (
	"fmt"
	"strings"

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

func connectionBudget(pool *pgxpool.Pool, cfg Config) budget {
	var b budget
	var parts []string
	for _, cc := range cfg.Consumers {
		n := cc.WithDefaults().Concurrency // one transaction (or lease statement) per worker goroutine
		b.reserved += n
		parts = append(parts, fmt.Sprintf("consumer %s %d", cc.Name, n))
	}
	if !cfg.DisableRelay {
		b.reserved += 2 // a batch, and the LISTEN connection while it is being set up
		parts = append(parts, "relay 2")
	}
	if !cfg.DisableRetention {
		b.reserved++
		parts = append(parts, "collector 1")
	}
	b.reserved++ // readiness and scrape-time metrics
	parts = append(parts, "health 1")
	maxConns := int(pool.Config().MaxConns)
	need := b.reserved
	if cfg.Ingress != nil {
		need++ // at least one request at a time
	}
	if maxConns < need {
		// Not fatal: the parts then wait for each other's connections now and then
		// (pgxpool's default is only max(4, CPUs)). The ingress is still bounded.
		b.short = fmt.Sprintf("the pool's MaxConns %d is smaller than the %d connections the worker's parts can use at once (%s); they will wait for each other: raise it (pool_max_conns in the URL, or pgxpool.Config.MaxConns)",
			maxConns, need, strings.Join(parts, ", "))
	}
	b.ingress = max(1, maxConns-b.reserved)
	return b
}
