package ops

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/store"
)

// Row is what ReadBacklog needs of a pool, connection or transaction.
type Row interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Backlog is the relay's queue at one moment.
type Backlog struct {
	// Pending counts rows not yet published.
	Pending int64
	// OldestCreatedAt is when the oldest unpublished row was written (nil when
	// none is pending); OldestAge is how long ago, by the database's clock.
	OldestCreatedAt *time.Time
	OldestAge       time.Duration
}

// ReadBacklog reads the outbox's queue: the one definition of "pending" and
// "oldest unpublished" that the metrics, stats and the console share.
func ReadBacklog(ctx context.Context, db Row, st *store.Store) (Backlog, error) {
	var b Backlog
	var age float64
	if err := db.QueryRow(ctx, st.Outbox.Backlog).Scan(&b.Pending, &b.OldestCreatedAt, &age); err != nil {
		return Backlog{}, fmt.Errorf("ops: backlog: %w", err)
	}
	b.OldestAge = time.Duration(age * float64(time.Second))
	return b, nil
}
