// Package relay moves committed outbox rows to JetStream: the one reader of
// idem_outbox's pending rows. The worker runs it; an embedder never does.
package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/natssubject"
	"github.com/idemkit/idem/internal/otelmsg"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/internal/wake"
)

// Config tunes a Relay. The zero value of every field means its default.
type Config struct {
	// BatchSize is the most rows claimed and published per transaction (default 500).
	BatchSize int
	// PollInterval is the fallback wake-up when no NOTIFY arrives (default 1s): a
	// NOTIFY is lost if the relay's listening connection was down at commit time.
	PollInterval time.Duration
	// PublishTimeout bounds the wait for every PubAck of a batch, each counted from
	// the batch's first publish (default 10s). A PubAck that does not come is a
	// failed publish, so a relay never waits longer than this for the broker, nor
	// does its shutdown.
	PublishTimeout time.Duration
	// MaxAttempts is how many failed publishes a row gets, while the broker is
	// otherwise up, before it is dead-lettered (default 10). Failures while the
	// broker is down do not count. A row the broker can never take (larger than
	// max_payload, headers it cannot encode) is dead-lettered at once.
	MaxAttempts int
	// Backoff is how long a row whose publish failed steps aside before its next
	// attempt (default: 1s doubling to 1m). The rows behind it are not held up,
	// except on OrderedSubjects, where its subject's later rows wait for it.
	Backoff func(attempt int) time.Duration
	// MaxBatchBytes bounds the payload and header bytes one batch holds in memory
	// (default 8 MiB; a single bigger row is still taken alone).
	MaxBatchBytes int64
	// Retention is how long a published row is kept (its expires_at) before the
	// collector may delete it (default 72h), unless AwaitProof.
	Retention time.Duration
	// AwaitProof keeps published rows without an expiry: the reconciler sets one
	// once it has proven the intent reached every consumer, so a row is never
	// deleted by age alone. The worker sets it when it runs a reconciler.
	AwaitProof bool
	// OrderedSubjects are subject filters (e.g. "orders.events.*") whose subjects
	// are each relayed in order (default none: every row is relayed as soon as it
	// can be, and a failed row steps aside). A row of an ordered subject is
	// published only after every earlier row of the same subject was published or
	// dead-lettered, and after the previous one's PubAck; no two relays publish
	// one subject at once. A row whose publish fails therefore blocks its subject
	// (only its subject) through its backoff, until it is published or, after
	// MaxAttempts, dead-lettered. Pair with outbox.Partition on the producer side
	// and an ordered consumer per subject (consumer.Partitioned); see
	// docs/ORDERING.md. Every relay of one outbox must be given the same
	// OrderedSubjects: a relay without them publishes those rows out of order.
	OrderedSubjects []string
	// AtomicPublish publishes each batch as one JetStream atomic batch: one PubAck,
	// and with fsync on every write one fsync, per batch instead of per message.
	// It needs nats-server 2.12 or later and a stream that allows atomic publish
	// (install.Stream.AllowAtomicPublish). A batch the broker refuses whole (one
	// re-published after a crash holds Msg-Ids the stream already has) is
	// published message by message; a stream that does not allow it turns it off,
	// with a warning. BatchSize may not exceed MaxAtomicBatch. Default: off.
	AtomicPublish bool
	// BehindLog runs the polling relay beside a LogRelay, for the rows that are its
	// own then (handed over, re-driven, or written before the log relay took
	// over): the installation's Outboxes wake it until the log relay owns new
	// rows, then no longer; LogRelay's hand-overs do (Wake), and NOTIFYs and the
	// poll.
	BehindLog bool
}

func (c Config) withDefaults() Config {
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
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 10
	}
	if c.Backoff == nil {
		c.Backoff = defaultBackoff
	}
	if c.MaxBatchBytes == 0 {
		c.MaxBatchBytes = 8 << 20
	}
	return c
}

// Validate reports a configuration that cannot work.
func (c Config) Validate() error {
	switch {
	case c.BatchSize < 0, c.MaxAttempts < 0, c.MaxBatchBytes < 0:
		return errors.New("relay: BatchSize, MaxAttempts and MaxBatchBytes must not be negative")
	case c.PollInterval < 0, c.PublishTimeout < 0, c.Retention < 0:
		return errors.New("relay: durations must not be negative")
	case c.AtomicPublish && c.BatchSize > MaxAtomicBatch:
		return fmt.Errorf("relay: BatchSize %d is more than an atomic batch takes (MaxAtomicBatch, %d)", c.BatchSize, MaxAtomicBatch)
	}
	for _, f := range c.OrderedSubjects {
		if err := natssubject.ValidateFilter(f); err != nil {
			return fmt.Errorf("relay: OrderedSubjects: %w", err)
		}
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
	cfg     Config
	stream  string // the installation's: every publish must land in it
	log     *slog.Logger
	observe idem.Observer
	st      *store.Store
	waker   *wake.Waker
	channel string
	pubOpts []jetstream.PublishOpt
	tracer  trace.Tracer
	// orderedRe are OrderedSubjects as Postgres regular expressions; lockSalt
	// prefixes a subject in its advisory lock key, so that two schemas in one
	// database do not share locks.
	orderedRe []string
	lockSalt  string
	// atomicOff is set once the stream refused atomic batches as disabled.
	atomicOff atomic.Bool
	// wake is Run's wake-up: the installation's Outboxes (behind a log relay,
	// until it owns new rows), its NOTIFYs, and Wake.
	wake chan struct{}
}

// New returns a relay of an installation's outbox (its parts, parts.Of), publishing
// to its stream: every publish must land in it (jetstream.WithExpectStream), so a
// subject stored by another stream, or by none, fails instead of being
// acknowledged by the wrong one. The installation's Outboxes (outbox.New) wake it
// directly while it runs; rows committed elsewhere wake it by NOTIFY, or its poll.
func New(inst parts.Installation, cfg Config) (*Relay, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if inst.JS == nil {
		return nil, errors.New("relay: the installation has no NATS connection")
	}
	cfg = cfg.withDefaults()
	r := &Relay{pool: inst.Pool, js: inst.JS, cfg: cfg, stream: inst.Stream, log: inst.Logger.With("component", "relay"),
		observe: inst.Observer, st: inst.Store, waker: inst.Waker, channel: inst.Store.Outbox.Channel,
		tracer: otelmsg.Tracer(inst.Tracer), pubOpts: []jetstream.PublishOpt{jetstream.WithExpectStream(inst.Stream)},
		wake: make(chan struct{}, 1)}
	r.cfg.OrderedSubjects = append([]string(nil), cfg.OrderedSubjects...)
	r.orderedRe, r.lockSalt = filterRegexps(r.cfg.OrderedSubjects), inst.Schema+"."
	return r, nil
}

// Run relays until ctx is cancelled. A batch under way when ctx is cancelled is
// finished (published and marked, bounded by PublishTimeout) before Run returns
// nil, and so is the goroutine that listens for NOTIFYs.
func (r *Relay) Run(ctx context.Context) error { return r.RunWork(ctx, context.WithoutCancel(ctx)) }

// RunWork is Run with the work context work: a batch under way when ctx ends is
// finished on work, and abandoned (republished later) when work ends.
func (r *Relay) RunWork(ctx, work context.Context) error {
	r.log.InfoContext(ctx, "relay started", "batch_size", r.cfg.BatchSize, "stream", r.stream)
	wake := r.wake
	// Behind a log relay the Outboxes wake it too until the log relay owns new
	// rows (Waker.ByLog): rows written while the log relay starts are this
	// relay's, and are published at once, not at the next poll.
	defer r.waker.Attach(wake)()
	listenCtx, stopListen := context.WithCancel(ctx)
	listening := make(chan struct{})
	go func() {
		defer close(listening)
		r.listen(listenCtx, wake)
	}()
	defer func() { stopListen(); <-listening }()

	ticker := time.NewTicker(r.cfg.PollInterval)
	defer ticker.Stop()
	for {
		// Batches run on a context that outlives ctx so a shutdown never abandons a
		// published-but-unmarked batch (that would only cost a re-publish, but
		// finishing is cheap and keeps the broker quiet).
		if _, err := r.Drain(work); err != nil {
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

// Wake makes a running relay look for rows now.
func (r *Relay) Wake() {
	select {
	case r.wake <- struct{}{}:
	default: // a wake-up is already pending
	}
}

// defaultBackoff waits 1s after a row's first failed publish, doubling to 1m.
func defaultBackoff(attempt int) time.Duration {
	d := time.Second
	for i := 1; i < attempt && d < time.Minute; i++ {
		d *= 2
	}
	return min(d, time.Minute)
}

// ErrBrokerDown is returned (wrapped) by Drain when a batch could not be published
// because the broker (or the stream) does not answer. Nothing is counted against
// the rows: they are retried as they are once the broker is back.
var ErrBrokerDown = errors.New("relay: the broker does not answer")

// Drain relays batches until the outbox has no claimable rows left, and returns how
// many rows it published.
func (r *Relay) Drain(ctx context.Context) (int, error) {
	if len(r.cfg.OrderedSubjects) > 0 {
		return r.drainBoth(ctx)
	}
	total := 0
	for {
		n, full, err := r.relayBatch(ctx, r.claim, r.publish, false)
		total += n
		if err != nil || !full {
			return total, err
		}
	}
}

// drainBoth is Drain for a relay with OrderedSubjects: ordered and unordered
// batches take turns until neither has more, so neither kind waits for the other
// to be drained.
func (r *Relay) drainBoth(ctx context.Context) (int, error) {
	total := 0
	for orderedMore, unorderedMore := true, true; orderedMore || unorderedMore; {
		if orderedMore {
			n, full, err := r.relayBatch(ctx, r.claimOrdered, r.publishOrdered, true)
			total += n
			if err != nil {
				return total, err
			}
			orderedMore = full
		}
		if unorderedMore {
			n, full, err := r.relayBatch(ctx, r.claimUnordered, r.publish, false)
			total += n
			if err != nil {
				return total, err
			}
			unorderedMore = full
		}
	}
	return total, nil
}

// claimFunc claims a batch in tx; publishFunc publishes one. The two kinds of
// batch (unordered and ordered) differ only in these.
type (
	claimFunc   func(ctx context.Context, tx pgx.Tx) (batch []outboxRow, full bool, err error)
	publishFunc func(ctx context.Context, batch []outboxRow) (ok acked, failed map[int64]error)
)

type outboxRow struct {
	id       int64
	key      string
	subject  string
	msgID    string
	headers  []byte
	payload  []byte
	attempts int
	created  time.Time
	name     string // idem.Message.Name, or empty
}

// relayBatch claims, publishes and settles one batch. full reports whether the claim
// was full, so there may be more. Rows that fail step aside (next_attempt_at), so a
// full batch of failures still lets the next batch reach the rows behind them.
func (r *Relay) relayBatch(ctx context.Context, claim claimFunc, publish publishFunc, ordered bool) (published int, full bool, err error) {
	start := time.Now()
	tx, err := r.pool.BeginTx(ctx, pgx.TxOptions{BeginQuery: sqlBeginRelay})
	if err != nil {
		return 0, false, fmt.Errorf("relay: begin: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit

	batch, full, err := claim(ctx, tx)
	if err != nil || len(batch) == 0 {
		return 0, false, err
	}

	epoch := r.connEpoch()
	ok, failed := publish(ctx, batch)
	r.traceBatch(ctx, start, batch, failed)
	// A connection that was down, or dropped and came back, while the batch was
	// out explains every failure of the batch: none is charged.
	dropped := !epoch.connected || r.connEpoch() != epoch
	if err := faults.From(ctx).Hit(ctx, faults.RelayAfterPublish, keysOf(batch)); err != nil {
		return 0, false, fmt.Errorf("relay: after publish: %w", err)
	}
	retry, dead, down := r.judge(ctx, batch, len(ok.ids), failed, dropped)
	if down && len(dead.ids) == 0 {
		// The broker is down: count nothing, leave the rows as they are (the
		// rollback releases them) and tell the caller to wait.
		r.observe.Observe(idem.Event{Component: idem.ComponentRelay, Outcome: idem.OutcomeFailed, Count: len(failed), Duration: time.Since(start)})
		return 0, false, fmt.Errorf("%w: %d rows wait: %v", ErrBrokerDown, len(failed), firstErr(failed))
	}
	if len(ok.ids) > 0 {
		retention := r.cfg.Retention
		if r.cfg.AwaitProof {
			retention = 0 // kept until the reconciler proves the intent complete
		}
		if _, err := tx.Exec(ctx, r.st.Outbox.MarkPublished, ok.ids, ok.streams, ok.seqs, retention); err != nil {
			return 0, false, fmt.Errorf("relay: mark published: %w", err)
		}
	}
	if len(retry.ids) > 0 {
		if _, err := tx.Exec(ctx, r.st.Outbox.MarkFailed, retry.ids, retry.reasons, retry.waits); err != nil {
			return 0, false, fmt.Errorf("relay: record failures: %w", err)
		}
	}
	if len(dead.ids) > 0 {
		horizons, err := r.replayHorizons(ctx, tx, batch, dead)
		if err != nil {
			return 0, false, fmt.Errorf("relay: dead-letter: %w", err)
		}
		if _, err := tx.Exec(ctx, r.st.DeadLetters.InsertRelay, dead.ids, dead.reasons, r.cfg.Retention, store.RelayConsumer, horizons); err != nil {
			return 0, false, fmt.Errorf("relay: dead-letter: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, false, fmt.Errorf("relay: commit: %w", err)
	}
	// An ordered subject whose row was just dead-lettered has rows behind it that
	// this batch left alone: there may be more right away.
	full = full || (ordered && len(dead.ids) > 0)
	elapsed := time.Since(start)
	for outcome, n := range map[idem.Outcome]int{idem.OutcomePublished: len(ok.ids), idem.OutcomeFailed: len(retry.ids), idem.OutcomeDeadLettered: len(dead.ids)} {
		if n > 0 {
			r.observe.Observe(idem.Event{Component: idem.ComponentRelay, Outcome: outcome, Count: n, Duration: elapsed})
		}
	}
	if len(retry.ids) > 0 {
		r.log.WarnContext(ctx, "relay: some publishes failed; they are retried after a backoff", "failed", len(retry.ids), "published", len(ok.ids), "err", retry.reasons[0])
	}
	if len(dead.ids) > 0 {
		r.log.ErrorContext(ctx, "relay: rows that cannot be published were dead-lettered", "rows", len(dead.ids), "reason", dead.reasons[0])
	}
	return len(ok.ids), full, nil
}

// traceBatch records the batch's send span, from start to now (traceSend).
func (r *Relay) traceBatch(ctx context.Context, start time.Time, batch []outboxRow, failed map[int64]error) {
	traceSend(ctx, r.tracer, r.stream, start, batch, failed)
}

// traceSend records a batch's send span, from start to now: one span per batch
// (a span per message would cost more than the publish), linked to each message's
// producer span, failed if any publish failed.
func traceSend(ctx context.Context, tracer trace.Tracer, stream string, start time.Time, batch []outboxRow, failed map[int64]error) {
	dest := batch[0].subject
	for _, o := range batch {
		if o.subject != dest {
			dest = stream // mixed subjects: name the stream
			break
		}
	}
	_, span := tracer.Start(ctx, otelmsg.SpanName(otelmsg.OpPublish, dest), trace.WithTimestamp(start),
		trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(otelmsg.Send(dest, len(batch))...))
	defer span.End()
	if !span.IsRecording() {
		return // no tracing: skip decoding every row's headers
	}
	for _, o := range batch {
		var h map[string]string
		if json.Unmarshal(o.headers, &h) == nil {
			if sc := trace.SpanContextFromContext(otelmsg.Extract(context.Background(), h)); sc.IsValid() {
				span.AddLink(trace.Link{SpanContext: sc})
			}
		}
	}
	if len(failed) > 0 {
		otelmsg.Fail(span, fmt.Errorf("%d of %d publishes failed: %w", len(failed), len(batch), firstErr(failed)))
	}
}

// acked are the rows the stream acknowledged, with where each landed.
type acked struct {
	ids     []int64
	streams []string
	seqs    []int64
}

// claim locks up to BatchSize claimable rows, then keeps those that fit in
// MaxBatchBytes (at least one) and loads them. The rows it locked but did not keep
// are simply left for the next batch.
func (r *Relay) claim(ctx context.Context, tx pgx.Tx) (batch []outboxRow, full bool, err error) {
	return r.claimWith(ctx, tx, r.st.Outbox.Claim, r.cfg.BatchSize)
}

// claimUnordered is claim for a relay with OrderedSubjects: it leaves their rows
// to claimOrdered.
func (r *Relay) claimUnordered(ctx context.Context, tx pgx.Tx) (batch []outboxRow, full bool, err error) {
	return r.claimWith(ctx, tx, r.st.Outbox.ClaimUnordered, r.cfg.BatchSize, r.orderedRe)
}

// claimWith runs a claim statement that returns (id, size) rows in id order, at
// most BatchSize, then keeps and loads those that fit in MaxBatchBytes: a prefix
// in id order, so an ordered subject's claimed rows stay its oldest.
func (r *Relay) claimWith(ctx context.Context, tx pgx.Tx, sql string, args ...any) (batch []outboxRow, full bool, err error) {
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, false, fmt.Errorf("relay: claim: %w", err)
	}
	type sized struct {
		id   int64
		size int64
	}
	claimed, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (sized, error) {
		var c sized
		err := row.Scan(&c.id, &c.size)
		return c, err
	})
	if err != nil {
		return nil, false, fmt.Errorf("relay: claim: %w", err)
	}
	var ids []int64
	var bytes int64
	for _, c := range claimed {
		if len(ids) > 0 && bytes+c.size > r.cfg.MaxBatchBytes {
			break
		}
		ids, bytes = append(ids, c.id), bytes+c.size
	}
	if len(ids) == 0 {
		return nil, false, nil
	}
	rows, err = tx.Query(ctx, r.st.Outbox.Load, ids)
	if err != nil {
		return nil, false, fmt.Errorf("relay: load: %w", err)
	}
	batch, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (outboxRow, error) {
		var o outboxRow
		err := row.Scan(&o.id, &o.key, &o.subject, &o.msgID, &o.headers, &o.payload, &o.attempts, &o.created, &o.name)
		return o, err
	})
	if err != nil {
		return nil, false, fmt.Errorf("relay: load: %w", err)
	}
	return batch, len(claimed) == r.cfg.BatchSize || len(ids) < len(claimed), nil
}

// settlement is a set of rows to update, with a reason (and a wait) each.
type settlement struct {
	ids     []int64
	reasons []string
	waits   []time.Duration
	// stored, for a dead row, says whether the broker may have stored it after
	// all: its last publish went unanswered rather than refused.
	stored []bool
}

func (s *settlement) add(id int64, reason string, wait time.Duration) {
	s.ids, s.reasons, s.waits = append(s.ids, id), append(s.reasons, reason), append(s.waits, wait)
	s.stored = append(s.stored, false)
}

// replayHorizons are, for the dead rows, how long after each row was written a
// replay of its dead letter is still folded by every consumer that could have read
// it: nil for a row the broker refused (nobody read it), else the shortest key
// lifetime of the registered consumers whose filter matches its subject (zero when
// none is registered: a consumer outside the registry may have read it and
// forgotten it, so the replay needs an operator's --force).
func (r *Relay) replayHorizons(ctx context.Context, tx pgx.Tx, batch []outboxRow, dead settlement) ([]*time.Duration, error) {
	horizons := make([]*time.Duration, len(dead.ids))
	if !slices.Contains(dead.stored, true) {
		return horizons, nil
	}
	rows, err := tx.Query(ctx, r.st.Consumers.Readers, r.stream)
	if err != nil {
		return nil, fmt.Errorf("registered consumers: %w", err)
	}
	type reader struct {
		filter   string
		lifetime float64
	}
	readers, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (reader, error) {
		var rd reader
		return rd, row.Scan(&rd.filter, &rd.lifetime)
	})
	if err != nil {
		return nil, fmt.Errorf("registered consumers: %w", err)
	}
	subjects := make(map[int64]string, len(batch))
	for _, o := range batch {
		subjects[o.id] = o.subject
	}
	for i, id := range dead.ids {
		if !dead.stored[i] {
			continue
		}
		h, found := time.Duration(0), false
		for _, rd := range readers {
			if l := time.Duration(rd.lifetime * float64(time.Second)); natssubject.Matches(rd.filter, subjects[id]) && (!found || l < h) {
				h, found = l, true
			}
		}
		horizons[i] = &h
	}
	return horizons, nil
}

// judge sorts failed publishes: a row the broker can never take is dead-lettered at
// once; a row that failed while the broker answers is charged an attempt and steps
// aside (dead-lettered once it used up MaxAttempts); failures while the broker does
// not answer are nobody's fault and charge nothing (down is then true).
func (r *Relay) judge(ctx context.Context, batch []outboxRow, published int, failed map[int64]error, dropped bool) (retry, dead settlement, down bool) {
	if len(failed) == 0 {
		return retry, dead, false
	}
	// A publish that produced no PubAck may be the broker's fault or the row's
	// (a subject nothing stores): ask the broker whether it is up.
	up := published > 0 || r.brokerUp(ctx)
	for _, o := range batch {
		err, ok := failed[o.id]
		if !ok {
			continue
		}
		reason := fmt.Sprintf("publish to %s failed: %v", o.subject, err)
		switch {
		case permanent(err):
			dead.add(o.id, reason+" (the broker can never take this message)", 0)
		case !up, dropped, connectionLost(err):
			// Leave it: not its fault. A publish that failed because the connection
			// dropped is the broker's fault even if the client has reconnected by
			// the time the broker is asked.
		case o.attempts+1 >= r.cfg.MaxAttempts:
			dead.add(o.id, fmt.Sprintf("%s (failed %d publishes, MaxAttempts is %d)", reason, o.attempts+1, r.cfg.MaxAttempts), 0)
			dead.stored[len(dead.stored)-1] = maybeStored(err)
		default:
			retry.add(o.id, reason, r.cfg.Backoff(o.attempts+1))
		}
	}
	return retry, dead, !up
}

// permanent reports publish errors that no retry can fix: the message itself is
// what the broker refuses.
func permanent(err error) bool {
	var bad errBadRow
	return errors.Is(err, nats.ErrMaxPayload) || errors.Is(err, nats.ErrBadHeaderMsg) || errors.As(err, &bad)
}

// maybeStored reports whether a failed publish may have been stored after all: it
// went unanswered (no PubAck in time; a cluster can commit a proposal after its
// client gave up on it), rather than refused by the broker.
func maybeStored(err error) bool {
	var api jetstream.JetStreamError
	return !errors.As(err, &api) || api.APIError() == nil
}

// epoch is the state of the relay's NATS connection: a reconnect changes it.
type epoch struct {
	connected  bool
	reconnects uint64
}

func (r *Relay) connEpoch() epoch { return connEpochOf(r.js.Conn()) }

// connectionLost reports publish errors that say the connection, not the row,
// failed.
func connectionLost(err error) bool {
	return errors.Is(err, nats.ErrDisconnected) || errors.Is(err, nats.ErrConnectionClosed) ||
		errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, nats.ErrConnectionDraining)
}

// errBadRow is a row the relay cannot even turn into a message.
type errBadRow struct{ err error }

func (e errBadRow) Error() string { return e.err.Error() }
func (e errBadRow) Unwrap() error { return e.err }

// brokerUp asks JetStream whether it is up (see the function brokerUp).
func (r *Relay) brokerUp(ctx context.Context) bool { return brokerUp(ctx, r.js, r.cfg.PublishTimeout) }

func firstErr(failed map[int64]error) error {
	for _, err := range failed {
		return err
	}
	return nil
}

// publish publishes a batch and waits for its PubAcks, up to PublishTimeout after
// the batch's first publish: as one atomic batch with AtomicPublish (atomic.go),
// else every message async. It returns the ids acknowledged by the stream
// (including those the broker reported as duplicates: they are in the stream
// already) and the failures.
func (r *Relay) publish(ctx context.Context, batch []outboxRow) (ok acked, failed map[int64]error) {
	failed = map[int64]error{}
	rows := make([]outboxRow, 0, len(batch))
	msgs := make([]*nats.Msg, 0, len(batch))
	for _, o := range batch {
		msg, err := messageOf(o)
		if err != nil {
			failed[o.id] = err
			continue
		}
		rows, msgs = append(rows, o), append(msgs, msg)
	}
	if r.cfg.AtomicPublish && !r.atomicOff.Load() && len(msgs) > 1 {
		aok, afailed, refused := r.publishAtomic(ctx, rows, msgs)
		if refused == nil {
			for id, err := range afailed {
				failed[id] = err
			}
			return aok, failed
		}
		if turnsOff(refused) {
			if !r.atomicOff.Swap(true) {
				r.log.WarnContext(ctx, "relay: the broker refuses atomic batches here; publishing message by message from now on "+
					"(allow atomic publish on the stream, nats-server 2.12 or later, max_batch_size at least BatchSize)", "err", refused)
			}
		} else {
			r.log.InfoContext(ctx, "relay: atomic batch refused, publishing it message by message", "rows", len(rows), "err", refused)
		}
		withoutBatchHeaders(msgs)
	}
	aok, afailed := r.publishAsync(ctx, rows, msgs)
	for id, err := range afailed {
		failed[id] = err
	}
	return aok, failed
}

// messageOf is row o as the stream gets it: its stored headers, then the key, the
// Msg-Id, the enqueue time and the message's name, which no stored header may
// override. Both relays send a row alike.
func messageOf(o outboxRow) (*nats.Msg, error) {
	msg := nats.NewMsg(o.subject)
	var extra map[string]string
	if len(o.headers) > 0 {
		if err := json.Unmarshal(o.headers, &extra); err != nil {
			return nil, errBadRow{fmt.Errorf("decode headers: %w", err)}
		}
	}
	for k, v := range extra {
		msg.Header.Set(k, v)
	}
	msg.Header.Set(idem.HeaderKey, o.key)
	msg.Header.Set(jetstream.MsgIDHeader, o.msgID)
	msg.Header.Set(idem.HeaderEnqueuedAt, o.created.UTC().Format(store.EnqueuedAtLayout))
	if o.name != "" {
		msg.Header.Set(idem.HeaderMessage, o.name)
	}
	msg.Data = o.payload
	return msg, nil
}

// publishAsync publishes every message async (rows[i]'s is msgs[i]), then waits
// for every PubAck.
func (r *Relay) publishAsync(ctx context.Context, rows []outboxRow, msgs []*nats.Msg) (ok acked, failed map[int64]error) {
	failed = map[int64]error{}
	deadline, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	futures := make([]jetstream.PubAckFuture, len(msgs))
	for i, msg := range msgs {
		f, err := r.js.PublishMsgAsync(msg, r.pubOpts...)
		if err != nil {
			failed[rows[i].id] = err
			continue
		}
		futures[i] = f
	}
	for i, f := range futures {
		if f == nil {
			continue
		}
		// The deadline's Done stays closed once it fires, so every future still
		// waiting fails at once instead of one per timer tick; one answered by
		// then keeps its answer (a refusal is not a timeout: a timed-out publish
		// may have been stored after all, a refused one was not).
		var ack *jetstream.PubAck
		var err error
		select {
		case ack = <-f.Ok():
		case err = <-f.Err():
		case <-deadline.Done():
			select {
			case ack = <-f.Ok():
			case err = <-f.Err():
			default:
				err = fmt.Errorf("no PubAck within PublishTimeout %s", r.cfg.PublishTimeout)
			}
		}
		if err != nil {
			failed[rows[i].id] = err
			continue
		}
		// A duplicate's PubAck names the sequence of the message it was folded
		// into: where this intent's message is.
		ok.ids = append(ok.ids, rows[i].id)
		ok.streams = append(ok.streams, ack.Stream)
		ok.seqs = append(ok.seqs, int64(ack.Sequence))
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

// sqlBeginRelay opens a relay batch's transaction. The relay reads and updates
// only rows it has locked, by primary key, a few hundred at a time; a sequential
// scan or a hash join over the outbox is never the right plan for that. The
// planner picks one anyway: a generic plan made while the table was small (pgx
// prepares every statement, and Postgres keeps a connection's generic plan until
// the table is next analyzed) goes on scanning it as it grows, and the cost model,
// which prices each index probe as a random read, prefers a hash join to a few
// hundred probes once the table is large enough (BENCHMARKS.md has the case).
// Turning those plans off for the relay's own transaction keeps every statement
// on an index, whatever the statistics say; and since that plan is right for any
// batch, the generic plan is forced too, so a small batch is not planned afresh
// each time. All in the same round trip as BEGIN.
const sqlBeginRelay = `BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_hashjoin = off; ` +
	`SET LOCAL enable_mergejoin = off; SET LOCAL plan_cache_mode = force_generic_plan`
