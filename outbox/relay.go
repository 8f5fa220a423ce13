package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/pgschema"
)

// Outcomes of the relay's Events (Component idem.ComponentRelay): one event per
// batch and outcome, with the batch's duration.
const (
	// OutcomePublished: rows the stream acknowledged and the relay marked published.
	OutcomePublished = "published"
	// OutcomeFailed: rows whose publish failed; they stay pending and are retried.
	OutcomeFailed = "failed"
)

// RelayConfig configures a Relay. The zero value of every field means its default.
type RelayConfig struct {
	// Schema is the Postgres schema holding idem_outbox (default "public").
	Schema string
	// Stream, when set, is the stream every publish must land in
	// (jetstream.WithExpectStream): a subject stored by another stream, or by none,
	// fails the publish instead of being acknowledged by the wrong stream.
	Stream string
	// BatchSize is the most rows claimed and published per transaction (default 500).
	BatchSize int
	// PollInterval is the fallback wake-up when no NOTIFY arrives (default 1s): a
	// NOTIFY is lost if the relay's listening connection was down at commit time.
	PollInterval time.Duration
	// PublishTimeout bounds the wait for a batch's PubAcks (default 10s).
	PublishTimeout time.Duration
	// Retention is how long a published row is kept (its expires_at) before the
	// collector may delete it (default 72h).
	Retention time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Observer, when set, is told each batch's outcome (for metrics): events with
	// Component idem.ComponentRelay and Outcome OutcomePublished or OutcomeFailed.
	Observer idem.Observer
}

func (c RelayConfig) withDefaults() RelayConfig {
	if c.BatchSize == 0 {
		c.BatchSize = 500
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = 10 * time.Second
	}
	if c.Retention == 0 {
		c.Retention = 72 * time.Hour
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c RelayConfig) validate() error {
	if err := pgschema.Validate(c.Schema); err != nil {
		return fmt.Errorf("outbox: relay: %w", err)
	}
	switch {
	case c.BatchSize < 0:
		return errors.New("outbox: relay: BatchSize must not be negative")
	case c.PollInterval < 0, c.PublishTimeout < 0, c.Retention < 0:
		return errors.New("outbox: relay: durations must not be negative")
	}
	return nil
}

// Relay moves committed outbox rows to JetStream. It claims unpublished rows in
// batches (FOR UPDATE SKIP LOCKED, so several relays can run), publishes them
// asynchronously with Idempotency-Key and Nats-Msg-Id set, and marks them published
// only after their PubAcks arrive. A crash between publish and mark publishes the rows
// again: the broker folds the repeat by Msg-Id inside its window, the consumer's
// inbox folds it after.
type Relay struct {
	pool    *pgxpool.Pool
	js      jetstream.JetStream
	cfg     RelayConfig
	log     *slog.Logger
	q       queries
	channel string
	pubOpts []jetstream.PublishOpt
}

// NewRelay returns a relay over pool's outbox publishing to js.
func NewRelay(pool *pgxpool.Pool, js jetstream.JetStream, cfg RelayConfig) (*Relay, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	r := &Relay{pool: pool, js: js, cfg: cfg, log: cfg.Logger.With("component", "relay"),
		q: newQueries(cfg.Schema), channel: notifyChannel(cfg.Schema)}
	if cfg.Stream != "" {
		r.pubOpts = append(r.pubOpts, jetstream.WithExpectStream(cfg.Stream))
	}
	return r, nil
}

// Run relays until ctx is cancelled. A batch under way when ctx is cancelled is
// finished (published and marked) before Run returns nil.
func (r *Relay) Run(ctx context.Context) error {
	r.log.InfoContext(ctx, "relay started", "batch_size", r.cfg.BatchSize, "stream", r.cfg.Stream)
	wake := make(chan struct{}, 1)
	listenCtx, stopListen := context.WithCancel(ctx)
	defer stopListen()
	go r.listen(listenCtx, wake)

	ticker := time.NewTicker(r.cfg.PollInterval)
	defer ticker.Stop()
	for {
		// Batches run on a context that outlives ctx so a shutdown never abandons a
		// published-but-unmarked batch (that would only cost a re-publish, but
		// finishing is cheap and keeps the broker quiet).
		if _, err := r.Drain(context.WithoutCancel(ctx)); err != nil {
			r.log.ErrorContext(ctx, "relay batch failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-ticker.C:
		}
	}
}

// Drain relays batches until the outbox has no unclaimed rows left, and returns how
// many rows it published.
func (r *Relay) Drain(ctx context.Context) (int, error) {
	total := 0
	for {
		n, full, err := r.relayBatch(ctx)
		total += n
		if err != nil || !full {
			return total, err
		}
	}
}

type outboxRow struct {
	id      int64
	key     string
	subject string
	msgID   string
	headers []byte
	payload []byte
}

// relayBatch claims, publishes and marks one batch. full reports whether the batch
// was full, so there may be more.
func (r *Relay) relayBatch(ctx context.Context) (published int, full bool, err error) {
	start := time.Now()
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("outbox: relay: begin: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit

	rows, err := tx.Query(ctx, r.q.claim, r.cfg.BatchSize)
	if err != nil {
		return 0, false, fmt.Errorf("outbox: relay: claim: %w", err)
	}
	batch, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (outboxRow, error) {
		var o outboxRow
		err := row.Scan(&o.id, &o.key, &o.subject, &o.msgID, &o.headers, &o.payload)
		return o, err
	})
	if err != nil {
		return 0, false, fmt.Errorf("outbox: relay: claim: %w", err)
	}
	if len(batch) == 0 {
		return 0, false, nil
	}

	ok, failed := r.publish(ctx, batch)
	if err := faults.From(ctx).Hit(ctx, faults.RelayAfterPublish, keysOf(batch)); err != nil {
		return 0, false, fmt.Errorf("outbox: relay: after publish: %w", err)
	}
	if len(ok) > 0 {
		if _, err := tx.Exec(ctx, r.q.markPublished, ok, r.cfg.Retention); err != nil {
			return 0, false, fmt.Errorf("outbox: relay: mark published: %w", err)
		}
	}
	if len(failed) > 0 {
		ids := make([]int64, 0, len(failed))
		reasons := make([]string, 0, len(failed))
		for id, e := range failed {
			ids = append(ids, id)
			reasons = append(reasons, e.Error())
		}
		if _, err := tx.Exec(ctx, r.q.markFailed, ids, reasons); err != nil {
			return 0, false, fmt.Errorf("outbox: relay: record failures: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, false, fmt.Errorf("outbox: relay: commit: %w", err)
	}
	elapsed := time.Since(start)
	if len(ok) > 0 {
		r.cfg.Observer.Observe(idem.Event{Component: idem.ComponentRelay, Outcome: OutcomePublished, Count: len(ok), Duration: elapsed})
	}
	if len(failed) > 0 {
		r.cfg.Observer.Observe(idem.Event{Component: idem.ComponentRelay, Outcome: OutcomeFailed, Count: len(failed), Duration: elapsed})
		r.log.WarnContext(ctx, "relay: some publishes failed; they stay pending", "failed", len(failed), "published", len(ok))
		// Do not spin on a broker that is down: report the batch as not full.
		return len(ok), false, nil
	}
	return len(ok), len(batch) == r.cfg.BatchSize, nil
}

// publish sends every row asynchronously and waits for their PubAcks. It returns the
// ids acknowledged by the stream (including those the broker reported as duplicates:
// they are in the stream already) and the failures.
func (r *Relay) publish(ctx context.Context, batch []outboxRow) (ok []int64, failed map[int64]error) {
	failed = map[int64]error{}
	futures := make([]jetstream.PubAckFuture, len(batch))
	for i, o := range batch {
		msg := nats.NewMsg(o.subject)
		var extra map[string]string
		if len(o.headers) > 0 {
			if err := json.Unmarshal(o.headers, &extra); err != nil {
				failed[o.id] = fmt.Errorf("decode headers: %w", err)
				continue
			}
		}
		for k, v := range extra {
			msg.Header.Set(k, v)
		}
		msg.Header.Set(idem.HeaderKey, o.key)
		msg.Header.Set(jetstream.MsgIDHeader, o.msgID)
		msg.Data = o.payload
		f, err := r.js.PublishMsgAsync(msg, r.pubOpts...)
		if err != nil {
			failed[o.id] = err
			continue
		}
		futures[i] = f
	}
	timeout := time.NewTimer(r.cfg.PublishTimeout)
	defer timeout.Stop()
	for i, f := range futures {
		if f == nil {
			continue
		}
		select {
		case <-f.Ok():
			ok = append(ok, batch[i].id)
		case err := <-f.Err():
			failed[batch[i].id] = err
		case <-timeout.C:
			failed[batch[i].id] = errors.New("no PubAck before PublishTimeout")
		case <-ctx.Done():
			failed[batch[i].id] = ctx.Err()
		}
	}
	return ok, failed
}

func keysOf(batch []outboxRow) []string {
	keys := make([]string, len(batch))
	for i, o := range batch {
		keys[i] = o.key
	}
	return keys
}

// listen holds a connection LISTENing on the outbox channel and signals wake on
// every notification. It reconnects with a pause when the connection drops; the
// poll ticker covers the gap.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) {
	for ctx.Err() == nil {
		err := r.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		r.log.WarnContext(ctx, "relay: LISTEN connection lost; polling until it is back", "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(r.cfg.PollInterval):
		}
	}
}

func (r *Relay) listenOnce(ctx context.Context, wake chan<- struct{}) error {
	conn, err := r.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	// The connection is LISTENing: it must not go back to the pool.
	pc := conn.Hijack()
	defer pc.Close(context.Background())
	if _, err := pc.Exec(ctx, "LISTEN "+pgx.Identifier{r.channel}.Sanitize()); err != nil {
		return err
	}
	for {
		if _, err := pc.WaitForNotification(ctx); err != nil {
			return err
		}
		select {
		case wake <- struct{}{}:
		default: // a wake-up is already pending
		}
	}
}
