package consumer

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/internal/otelmsg"
	"github.com/idemkit/idem/wire"
)

// The life of one delivery, as River's job executor keeps a job's: process decodes
// what the fetcher hands over (poison is dead-lettered at once), the
// in-transaction batch (batch.go) or the external effect (external.go) runs it,
// and the one settle path both share acks, retries or dead-letters it and
// reports the outcome.

// process takes fetched messages from delivery to settlement: decode (poison is
// dead-lettered at once), then the in-transaction batch or the external effect.
func (c *Consumer) process(ctx context.Context, msgs []jetstream.Msg) {
	var ds []*Delivery
	for _, m := range msgs {
		d, reason := decode(m)
		c.startSpan(ctx, d)
		defer d.span.End()
		if reason != "" {
			c.deadLetter(ctx, d, reason)
			continue
		}
		if !wire.IsReplayFor(d.Headers[idem.HeaderReplayFor], c.cfg.Name) {
			c.ack(ctx, d)
			c.observe(idem.OutcomeSkipped, 1, 0)
			continue
		}
		ds = append(ds, d)
	}
	if len(ds) == 0 {
		return
	}
	if c.cfg.External != nil {
		for _, d := range ds {
			c.perform(ctx, d)
		}
		return
	}
	c.runBatches(ctx, ds)
}

// Dead-letter reasons (the prefix of idem_dead_letters.reason).
const (
	reasonNoKey      = "missing Idempotency-Key header"
	reasonBadKey     = "malformed Idempotency-Key"
	reasonMismatch   = "fingerprint mismatch: this key was first seen with a different payload"
	reasonPermanent  = "permanent handler error"
	reasonMaxDeliver = "max deliveries exceeded"
	reasonBadName    = "malformed " + idem.HeaderMessage
)

// decode turns a JetStream message into a Delivery, or says why it is poison.
func decode(m jetstream.Msg) (*Delivery, string) {
	d := &Delivery{raw: m, Deliveries: 1}
	d.Subject = m.Subject()
	d.Payload = m.Data()
	if d.Payload == nil {
		d.Payload = []byte{}
	}
	d.Headers = map[string]string{}
	for k, v := range m.Headers() {
		if len(v) > 0 {
			d.Headers[k] = v[0]
		}
	}
	if md, err := m.Metadata(); err == nil {
		d.Deliveries = int(md.NumDelivered)
		d.StreamSeq = md.Sequence.Stream
	}
	if at, err := time.Parse(time.RFC3339Nano, d.Headers[idem.HeaderEnqueuedAt]); err == nil {
		d.EnqueuedAt = at
	}
	d.Key = m.Headers().Get(idem.HeaderKey)
	if d.Key == "" {
		return d, reasonNoKey
	}
	if _, _, err := idem.ParseScopedKey(d.Key); err != nil {
		return d, fmt.Sprintf("%s: %v", reasonBadKey, err)
	}
	d.Name = d.Headers[idem.HeaderMessage]
	if err := idem.ValidateMessageName(d.Name); err != nil {
		return d, fmt.Sprintf("%s: %v", reasonBadName, err)
	}
	return d, ""
}

// startSpan opens the delivery's process span ("process <subject>", OpenTelemetry
// messaging conventions) as a child of the trace the producer put in the headers,
// read with the global propagator.
func (c *Consumer) startSpan(ctx context.Context, d *Delivery) {
	parent := otelmsg.Extract(ctx, d.Headers)
	attrs := append(otelmsg.Process(d.Subject, d.Headers[idem.HeaderMsgID], c.cfg.Name),
		attribute.String("idem.key", d.Key),
		attribute.Int("idem.deliveries", d.Deliveries))
	d.ctx, d.span = c.tracer.Start(parent, otelmsg.SpanName(otelmsg.OpProcess, d.Subject),
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
}

// idOf names d in the inbox: its key and its message (wire.MessageOf).
func (c *Consumer) idOf(d *Delivery) dedupe.ID {
	if c.keyOnly {
		return dedupe.ID{Key: d.Key, Message: "(any)"}
	}
	return dedupe.ID{Key: d.Key, Message: wire.MessageOf(d.Subject, d.Name)}
}

// ack acks d on the broker. A lost ack costs nothing but a redelivery, which the
// inbox folds.
func (c *Consumer) ack(ctx context.Context, d *Delivery) {
	if err := d.raw.Ack(); err != nil {
		// Harmless for correctness: the redelivery will be folded by the inbox.
		c.log.WarnContext(ctx, "ack failed; the redelivery will be a duplicate", "key", d.Key, "err", err)
	}
}

// fail handles a handler's error for one delivery, charged as its attempt-th
// attempt: dead-letter it when the error is permanent or the attempts are used up,
// retry it later otherwise.
func (c *Consumer) fail(ctx context.Context, d *Delivery, attempt int, err error) {
	otelmsg.Fail(d.span, err)
	switch {
	case IsPermanent(err):
		c.deadLetter(ctx, d, fmt.Sprintf("%s: %v", reasonPermanent, err))
	case dataError(err):
		c.deadLetter(ctx, d, fmt.Sprintf("%s: the database refuses the message's data, which no retry can change: %v", reasonPermanent, err))
	case attempt >= c.cfg.MaxDeliver:
		c.deadLetter(ctx, d, fmt.Sprintf("%s: failed %d attempts (%d deliveries), last error: %v",
			reasonMaxDeliver, attempt, d.Deliveries, err))
	default:
		delay := c.cfg.Backoff(attempt)
		c.log.WarnContext(ctx, "handler failed; will retry", "key", d.Key, "attempt", attempt, "retry_in", delay, "err", err)
		c.retryLater(d, delay)
	}
}

// dataError reports a Postgres data exception (SQLSTATE class 22: a NUL in a text
// value, invalid UTF-8, a number out of range, a malformed date): the message's data
// is wrong for the handler's statements, and running it again cannot succeed.
func dataError(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && strings.HasPrefix(pe.Code, "22")
}

// retryLater hands d back to the broker for redelivery after delay.
func (c *Consumer) retryLater(d *Delivery, delay time.Duration) {
	_ = d.raw.NakWithDelay(delay)
	c.observe(idem.OutcomeFailed, 1, 0)
}

// observeProcessed reports deliveries whose effect committed at committed: the
// batch's duration, the part of it in handlers, and each message's end-to-end
// latency from its outbox row (idem.HeaderEnqueuedAt), when it has one.
func (c *Consumer) observeProcessed(ds []*Delivery, took, handlers time.Duration, committed time.Time) {
	if len(ds) == 0 || c.observer == nil {
		return // no latencies to compute for nobody
	}
	e := idem.Event{Component: idem.ComponentConsumer, Name: c.cfg.Name, Outcome: idem.OutcomeProcessed,
		Count: len(ds), Duration: took, HandlerDuration: handlers}
	for _, d := range ds {
		if !d.EnqueuedAt.IsZero() {
			e.EndToEnd = append(e.EndToEnd, committed.Sub(d.EnqueuedAt))
		}
	}
	c.observer.Observe(e)
}

func (c *Consumer) observe(outcome idem.Outcome, n int, took time.Duration) {
	if n > 0 {
		c.observer.Observe(idem.Event{Component: idem.ComponentConsumer, Name: c.cfg.Name, Outcome: outcome, Count: n, Duration: took})
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// heartbeat tells JetStream the deliveries (a batch, or one external effect) are
// still being worked on, every third of AckWait, so a long transaction does not
// trigger a redelivery to another worker.
func (c *Consumer) heartbeat(ctx context.Context, ds []*Delivery) (stop func()) {
	return every(ctx, c.cfg.AckWait/3, func() bool {
		for _, d := range ds {
			_ = d.raw.InProgress()
		}
		return true
	})
}

// every runs tick every interval in its own goroutine until tick returns false,
// ctx ends or stop is called. stop waits for the goroutine, so no tick runs after
// it returns (no heartbeat after the ack, no lease extension after completion).
func every(ctx context.Context, interval time.Duration, tick func() (again bool)) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if !tick() {
				return
			}
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
}

// deadLetter files d in idem_dead_letters with reason, then terminates it on the
// broker. If the row cannot be written the message is not terminated but naked, so
// it is never dropped without a trace.
//
// The row records the replay horizon (inbox_expires_at): until then this consumer's
// inbox still remembers whatever it did with the key, so a replay is folded if the
// effect already happened; after it, deadletter.Queue.Replay refuses unless forced.
func (c *Consumer) deadLetter(ctx context.Context, d *Delivery, reason string) {
	headers, _ := json.Marshal(d.Headers)
	var seq *int64
	if d.StreamSeq > 0 {
		s := int64(d.StreamSeq)
		seq = &s
	}
	fp := sha256.Sum256(d.Payload)
	message := wire.MessageOf(d.Subject, d.Name)
	tag, err := c.pool.Exec(ctx, c.st.DeadLetters.Insert, c.cfg.Name, d.Key, message, d.Subject, headers, d.Payload, reason, d.Deliveries, seq, fp[:], c.cfg.KeyLifetime)
	if err != nil {
		c.log.ErrorContext(ctx, "dead letter could not be written; message left for redelivery", "key", d.Key, "reason", reason, "err", err)
		c.retryLater(d, c.cfg.Backoff(d.Deliveries))
		return
	}
	if tag.RowsAffected() == 0 {
		// The same message (consumer, stream sequence, key, payload) was filed
		// before and its terminate was lost: the first row stands.
		c.log.WarnContext(ctx, "message dead-lettered again; already filed", "key", d.Key, "reason", reason, "deliveries", d.Deliveries, "stream_seq", d.StreamSeq)
	} else {
		c.log.WarnContext(ctx, "message dead-lettered", "key", d.Key, "reason", reason, "deliveries", d.Deliveries, "stream_seq", d.StreamSeq)
	}
	if err := d.raw.TermWithReason(truncate(reason, 200)); err != nil {
		c.log.WarnContext(ctx, "terminate failed; the redelivery will be dead-lettered again (once)", "key", d.Key, "err", err)
	}
	otelmsg.Failf(d.span, "dead-lettered: %s", truncate(reason, 200))
	c.observe(idem.OutcomeDeadLettered, 1, 0)
}
