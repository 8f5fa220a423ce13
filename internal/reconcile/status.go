package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/idemkit/idem/internal/registry"

	"github.com/idemkit/idem/internal/store"
)

// Status is the reconciler's view of the outbox at one moment: what stats and
// metrics report.
type Status struct {
	// Unproven counts published rows not yet proven settled by every consumer
	// that should see them (nor given up on): intents published but not consumed.
	Unproven int64 `json:"unproven"`
	// OldestUnprovenAge is how long ago the oldest of them was written (zero when
	// none).
	OldestUnprovenAge time.Duration `json:"oldest_unproven_age"`
	// Lagging and Unrouted count the unproven rows whose last verdict was lag
	// (still in the stream) or unrouted (no consumer reads them).
	Lagging  int64 `json:"lagging"`
	Unrouted int64 `json:"unrouted"`
	// Redriven counts rows the outbox still keeps that were re-driven at least once.
	Redriven int64 `json:"redriven"`
	// Alerted counts rows given up on (and dead-lettered) that the outbox still keeps.
	Alerted int64 `json:"alerted"`
}

// ReadStatus reads the Status of schema's outbox.
func ReadStatus(ctx context.Context, db registry.Querier, schema string) (Status, error) {
	var s Status
	var age float64
	err := db.QueryRow(ctx, store.New(schema).Outbox.Status).Scan(&s.Unproven, &age, &s.Lagging, &s.Unrouted, &s.Redriven, &s.Alerted)
	if err != nil {
		return Status{}, fmt.Errorf("reconcile: status: %w", err)
	}
	s.OldestUnprovenAge = time.Duration(age * float64(time.Second))
	return s, nil
}
