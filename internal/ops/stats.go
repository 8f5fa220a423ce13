package ops

import (
	"context"
	"fmt"
	"time"

	"github.com/idemkit/idem/internal/registry"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/internal/relay"
)

// CountsFunc reads an application's totals (payments, orders, ledger entries),
// inside Stats' read-only snapshot, on tx.
type CountsFunc func(ctx context.Context, tx pgx.Tx) ([]Count, error)

// Count is one application total.
type Count struct {
	Name string `json:"name"`
	N    int64  `json:"n"`
}

// Stats are counts and lags across idem's tables, the application's totals, and
// optionally the stream.
type Stats struct {
	// AsOf is the database's clock when the snapshot was taken.
	AsOf     time.Time    `json:"as_of"`
	Requests RequestStats `json:"requests"`
	Outbox   OutboxStats  `json:"outbox"`
	// Delivery is the reconciler's view: intents published but not yet settled
	// by every consumer that reads them, re-driven, given up on.
	Delivery reconcile.Status `json:"delivery"`
	// Consumers are the consumers registered in idem_consumers: those whose
	// settlement proves an intent delivered.
	Consumers   []registry.Consumer `json:"consumers"`
	Inbox       []InboxCount        `json:"inbox"`
	DeadLetters DeadLetterStats     `json:"dead_letters"`
	// Counts are the application's totals, read by Config.Counts (empty without it).
	Counts []Count `json:"counts"`
	// Relay is which relay publishes the outbox and, for the log relay, its slot.
	Relay relay.State `json:"relay"`
	// JetStream is left nil by Stats; set it from ReadJetStream to report both.
	JetStream *JetStreamStats `json:"jetstream,omitempty"`
}

// RequestStats counts idem_requests.
type RequestStats struct {
	Total int64 `json:"total"`
	// Running requests have claimed their key and not committed yet (or their
	// worker died mid-request; the key is retried after the lock wait).
	Running int64 `json:"running"`
}

// OutboxStats counts idem_outbox. Pending and the oldest pending row are the
// outbox's backlog (ReadBacklog), the definition the metrics use too.
type OutboxStats struct {
	Pending int64 `json:"pending"`
	// Failing are pending rows whose publish was tried and failed at least once.
	Failing   int64 `json:"failing"`
	Published int64 `json:"published"`
	// OldestPendingAt is when the longest-waiting unpublished row was written (nil
	// when nothing is pending); OldestPendingAgeSeconds is its age at AsOf. A growing
	// age means the relay is down or cannot publish.
	OldestPendingAt         *time.Time `json:"oldest_pending_at"`
	OldestPendingAgeSeconds float64    `json:"oldest_pending_age_seconds"`
}

// InboxCount is the number of idem_inbox rows of one consumer in one status.
type InboxCount struct {
	Consumer string `json:"consumer"`
	Status   string `json:"status"`
	Rows     int64  `json:"rows"`
	// Expired rows have outlived the key lifetime and await the collector.
	Expired int64 `json:"expired"`
	// LeaseExpired are leased rows whose lease ran out: a worker died mid-effect and
	// the next delivery will take the lease over.
	LeaseExpired int64 `json:"lease_expired"`
}

// DeadLetterStats counts idem_dead_letters.
type DeadLetterStats struct {
	Total       int64 `json:"total"`
	NotReplayed int64 `json:"not_replayed"`
}

// Stats reads the database side of Stats in one snapshot (JetStream is nil).
func (r *Reader) Stats(ctx context.Context) (*Stats, error) {
	s := &Stats{Counts: []Count{}}
	err := r.snapshot(ctx, func(tx pgx.Tx, asOf time.Time) error {
		s.AsOf = asOf
		for _, c := range []struct {
			sql  string
			dest []any
		}{
			{r.st.Requests.Counts, []any{&s.Requests.Total, &s.Requests.Running}},
			{r.st.Outbox.Counts, []any{&s.Outbox.Failing, &s.Outbox.Published}},
			{r.st.DeadLetters.Counts, []any{&s.DeadLetters.Total, &s.DeadLetters.NotReplayed}},
		} {
			if err := tx.QueryRow(ctx, c.sql).Scan(c.dest...); err != nil {
				return fmt.Errorf("ops: stats: %w", err)
			}
		}
		b, err := ReadBacklog(ctx, tx, r.st)
		if err != nil {
			return fmt.Errorf("ops: stats: %w", err)
		}
		s.Outbox.Pending, s.Outbox.OldestPendingAt = b.Pending, b.OldestCreatedAt
		if b.OldestCreatedAt != nil {
			// Backlog measures from now(), the snapshot's AsOf; never negative.
			s.Outbox.OldestPendingAgeSeconds = max(b.OldestAge, 0).Seconds()
		}
		if s.Delivery, err = reconcile.ReadStatus(ctx, tx, r.cfg.Schema); err != nil {
			return fmt.Errorf("ops: stats: %w", err)
		}
		if s.Relay, err = relay.ReadState(ctx, tx, r.st, r.cfg.Schema); err != nil {
			return fmt.Errorf("ops: stats: %w", err)
		}
		if s.Consumers, err = registry.Registered(ctx, tx, r.cfg.Schema); err != nil {
			return fmt.Errorf("ops: stats: %w", err)
		}
		if s.Inbox, err = queryAll(ctx, tx, "inbox stats", r.st.Inbox.Stats, pgx.RowToStructByPos[InboxCount]); err != nil {
			return err
		}
		if r.cfg.Counts != nil {
			counts, err := r.cfg.Counts(ctx, tx)
			if err != nil {
				return fmt.Errorf("ops: application counts: %w", err)
			}
			s.Counts = append(s.Counts, counts...)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Summary is the part of Stats cheap enough to read every few seconds, the same
// reads the worker's metrics make at every scrape: the outbox backlog, the
// reconciler's view, and the dead letters not yet replayed. Stats' other counts
// read whole tables.
type Summary struct {
	// AsOf is the database's clock when the snapshot was taken.
	AsOf time.Time `json:"as_of"`
	// Outbox has Pending and the oldest pending row; Failing and Published are
	// left zero (Stats counts them).
	Outbox   OutboxStats      `json:"outbox"`
	Delivery reconcile.Status `json:"delivery"`
	// OpenDeadLetters counts the dead letters not yet replayed, per consumer.
	OpenDeadLetters map[string]int64 `json:"open_dead_letters"`
}

// Summary reads the Summary in one snapshot.
func (r *Reader) Summary(ctx context.Context) (*Summary, error) {
	s := &Summary{}
	err := r.snapshot(ctx, func(tx pgx.Tx, asOf time.Time) error {
		s.AsOf = asOf
		b, err := ReadBacklog(ctx, tx, r.st)
		if err != nil {
			return fmt.Errorf("ops: summary: %w", err)
		}
		s.Outbox.Pending, s.Outbox.OldestPendingAt = b.Pending, b.OldestCreatedAt
		if b.OldestCreatedAt != nil {
			s.Outbox.OldestPendingAgeSeconds = max(b.OldestAge, 0).Seconds()
		}
		if s.Delivery, err = reconcile.ReadStatus(ctx, tx, r.cfg.Schema); err != nil {
			return fmt.Errorf("ops: summary: %w", err)
		}
		s.OpenDeadLetters, err = r.openDeadLetters(ctx, tx)
		return err
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}
