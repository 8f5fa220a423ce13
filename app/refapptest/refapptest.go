// Package refapptest starts the reference application (package refapp) for a
// test and shuts it down when the test ends.
package refapptest

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/app/refapp"
)

// shutdownTimeout bounds the graceful shutdown at cleanup.
const shutdownTimeout = 30 * time.Second

// Start runs refapp.Start with cfg on pool and nc, fails t if it cannot, and
// shuts the service down gracefully when t ends.
func Start(t testing.TB, pool *pgxpool.Pool, nc *nats.Conn, cfg refapp.Config) *refapp.Service {
	t.Helper()
	return StartContext(t, context.Background(), pool, nc, cfg)
}

// StartContext is Start with the context refapp.Start gets, whose values (fault
// points, say) the service's requests and components see.
func StartContext(t testing.TB, ctx context.Context, pool *pgxpool.Pool, nc *nats.Conn, cfg refapp.Config) *refapp.Service {
	t.Helper()
	svc, err := refapp.Start(ctx, pool, nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
		defer cancel()
		_ = svc.Shutdown(ctx)
	})
	return svc
}
