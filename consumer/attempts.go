package consumer

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/internal/store"
)

// attemptCounter counts, in Postgres (idem_attempts), the attempts at each delivery of an
// in-transaction consumer: what MaxDeliver is compared with. JetStream's delivery
// count is not: it also counts deliveries that never reached the handler (a
// database outage, a batch-mate that crashed the worker). A first delivery costs no
// write; only redeliveries and failures do, and those are rare.
type attemptCounter struct {
	pool     *pgxpool.Pool
	consumer string
	lifetime time.Duration
	q        store.Attempts
}

// start charges the start of a redelivered attempt at id and returns the count,
// this attempt included. A delivery with no record yet has had at least one attempt that
// left no trace (its worker died, or it never started): this one is counted as the
// second.
func (a *attemptCounter) start(ctx context.Context, id dedupe.ID) (int, error) {
	var n int
	if err := a.pool.QueryRow(ctx, a.q.Start, a.consumer, id.Key, id.Message, a.lifetime).Scan(&n); err != nil {
		return 0, fmt.Errorf("consumer: count attempt: %w", err)
	}
	return n, nil
}

// fail records a handler's failure of the current attempt at id and returns the
// count of attempts so far (at least 1).
func (a *attemptCounter) fail(ctx context.Context, id dedupe.ID, cause error) (int, error) {
	var n int
	if err := a.pool.QueryRow(ctx, a.q.Fail, a.consumer, id.Key, id.Message, truncate(cause.Error(), 1000), a.lifetime).Scan(&n); err != nil {
		return 0, fmt.Errorf("consumer: record failure: %w", err)
	}
	return n, nil
}
