package opsquery

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
)

// The SQL of ReadStats. Exact counts: count(*) reads the whole table (or index),
// which is what an operator who asks "how many" wants, and what a one-off command
// can afford; a dashboard polling every few seconds should use /metrics instead.
const (
	sqlStatsTotals = `
SELECT
    (SELECT count(*) FROM idem_requests),
    (SELECT count(*) FROM idem_requests WHERE status <> 'done'),
    (SELECT count(*) FROM idem_outbox WHERE published_at IS NULL),
    (SELECT count(*) FROM idem_outbox WHERE published_at IS NULL AND attempts > 0),
    (SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL),
    -- The relay drains in id order, so the lowest unpublished id is the row that has
    -- waited longest; the partial index idem_outbox_unpublished finds it at once.
    (SELECT created_at FROM idem_outbox WHERE published_at IS NULL ORDER BY id LIMIT 1),
    (SELECT count(*) FROM idem_dead_letters),
    (SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NULL),
    (SELECT count(*) FROM payments),
    (SELECT count(*) FROM emails),
    (SELECT count(*) FROM ledger_entries),
    now()`

	sqlStatsInbox = `
SELECT consumer, status, count(*),
       count(*) FILTER (WHERE expires_at < now()),
       count(*) FILTER (WHERE status = 'leased' AND lease_until < now())
FROM idem_inbox
GROUP BY consumer, status
ORDER BY consumer, status`
)

// Stats are counts and lags across idem's tables, and optionally the stream.
type Stats struct {
	// AsOf is the database's clock when the snapshot was taken.
	AsOf        time.Time       `json:"as_of"`
	Requests    RequestStats    `json:"requests"`
	Outbox      OutboxStats     `json:"outbox"`
	Inbox       []InboxCount    `json:"inbox"`
	DeadLetters DeadLetterStats `json:"dead_letters"`
	Business    BusinessStats   `json:"business"`
	JetStream   *JetStreamStats `json:"jetstream,omitempty"`
}

// RequestStats counts idem_requests.
type RequestStats struct {
	Total int64 `json:"total"`
	// Running requests have claimed their key and not committed yet (or their
	// worker died mid-request; the key is retried after the lock wait).
	Running int64 `json:"running"`
}

// OutboxStats counts idem_outbox.
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

// BusinessStats counts the demo's tables.
type BusinessStats struct {
	Payments      int64 `json:"payments"`
	Emails        int64 `json:"emails"`
	LedgerEntries int64 `json:"ledger_entries"`
}

// ReadStats reads the database side of Stats (JetStream is nil).
func ReadStats(ctx context.Context, db DB) (*Stats, error) {
	s := &Stats{}
	err := snapshot(ctx, db, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, sqlStatsTotals).Scan(
			&s.Requests.Total, &s.Requests.Running,
			&s.Outbox.Pending, &s.Outbox.Failing, &s.Outbox.Published, &s.Outbox.OldestPendingAt,
			&s.DeadLetters.Total, &s.DeadLetters.NotReplayed,
			&s.Business.Payments, &s.Business.Emails, &s.Business.LedgerEntries,
			&s.AsOf)
		if err != nil {
			return fmt.Errorf("opsquery: stats: %w", err)
		}
		if s.Outbox.OldestPendingAt != nil {
			s.Outbox.OldestPendingAgeSeconds = age(s.AsOf, *s.Outbox.OldestPendingAt).Seconds()
		}
		s.Inbox, err = queryAll(ctx, tx, "inbox stats", sqlStatsInbox, pgx.RowToStructByPos[InboxCount])
		return err
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// JetStreamStats is the stream's size and each durable consumer's lag.
type JetStreamStats struct {
	URL       string        `json:"url"`
	Stream    string        `json:"stream"`
	Messages  uint64        `json:"messages"`
	Bytes     uint64        `json:"bytes"`
	FirstSeq  uint64        `json:"first_seq"`
	LastSeq   uint64        `json:"last_seq"`
	Consumers []ConsumerLag `json:"consumers"`
}

// ConsumerLag is one durable consumer's position.
type ConsumerLag struct {
	Name           string   `json:"name"`
	FilterSubjects []string `json:"filter_subjects"`
	// NumPending: messages in the stream not yet delivered to this consumer.
	NumPending uint64 `json:"num_pending"`
	// NumAckPending: delivered, not yet acknowledged (in flight, or its worker died
	// and the ack wait has not run out).
	NumAckPending int `json:"num_ack_pending"`
	// NumRedelivered: messages delivered more than once and still unacknowledged.
	NumRedelivered int `json:"num_redelivered"`
	// AckFloor is the stream sequence below which everything is acknowledged.
	AckFloor uint64 `json:"ack_floor"`
}

// ReadJetStream reads the stream's state and its consumers' lag.
func ReadJetStream(ctx context.Context, js jetstream.JetStream, stream string) (*JetStreamStats, error) {
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("opsquery: stream %s: %w", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("opsquery: stream %s: %w", stream, err)
	}
	out := &JetStreamStats{
		Stream:    stream,
		Messages:  info.State.Msgs,
		Bytes:     info.State.Bytes,
		FirstSeq:  info.State.FirstSeq,
		LastSeq:   info.State.LastSeq,
		Consumers: []ConsumerLag{},
	}
	list := st.ListConsumers(ctx)
	for ci := range list.Info() {
		filters := ci.Config.FilterSubjects
		if ci.Config.FilterSubject != "" {
			filters = append([]string{ci.Config.FilterSubject}, filters...)
		}
		out.Consumers = append(out.Consumers, ConsumerLag{
			Name:           ci.Name,
			FilterSubjects: filters,
			NumPending:     ci.NumPending,
			NumAckPending:  ci.NumAckPending,
			NumRedelivered: ci.NumRedelivered,
			AckFloor:       ci.AckFloor.Stream,
		})
	}
	if err := list.Err(); err != nil {
		return nil, fmt.Errorf("opsquery: consumers of %s: %w", stream, err)
	}
	return out, nil
}
