package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
)

// process takes one fetched batch from delivery to ack.
func (c *Consumer) process(ctx context.Context, msgs []jetstream.Msg) {
	stopBeat := c.heartbeat(ctx, msgs)
	defer stopBeat()

	var ds []*Delivery
	for _, m := range msgs {
		d, reason := decode(m)
		c.startSpan(ctx, d)
		defer d.span.End()
		if reason != "" {
			c.deadLetter(ctx, d, reason)
			continue
		}
		ds = append(ds, d)
	}
	if len(ds) == 0 {
		return
	}

	// Run the batch; a delivery whose handler fails is taken out and the rest run
	// again in a fresh transaction, so one bad message never takes its batch down.
	for len(ds) > 0 {
		res, err := c.runBatch(ctx, ds)
		var fa failedAt
		switch {
		case err == nil:
			c.settle(ctx, res)
			return
		case errors.As(err, &fa):
			c.fail(ctx, ds[fa.index], fa.err)
			ds = append(ds[:fa.index:fa.index], ds[fa.index+1:]...)
		case errors.Is(err, errAbandoned):
			c.log.Warn("batch abandoned after commit, before ack (fault point)", "messages", len(ds))
			return
		case len(ds) > 1 && errors.Is(err, errHandler):
			// A batch handler failed without saying where: run each delivery alone.
			for _, d := range ds {
				c.process1(ctx, d)
			}
			return
		case errors.Is(err, errHandler):
			c.fail(ctx, ds[0], err)
			return
		default:
			// The database or the transaction failed, not a handler: the deliveries
			// are redelivered after a short pause.
			c.log.Error("batch failed; will be redelivered", "err", err, "messages", len(ds))
			for _, d := range ds {
				_ = d.raw.NakWithDelay(c.cfg.Backoff(1))
			}
			c.count(OutcomeFailed, len(ds))
			return
		}
	}
}

func (c *Consumer) process1(ctx context.Context, d *Delivery) {
	res, err := c.runBatch(ctx, []*Delivery{d})
	switch {
	case err == nil:
		c.settle(ctx, res)
	case errors.Is(err, errAbandoned):
	case errors.Is(err, errHandler):
		c.fail(ctx, d, err)
	default:
		c.log.Error("message failed; will be redelivered", "err", err, "key", d.Key)
		_ = d.raw.NakWithDelay(c.cfg.Backoff(1))
		c.count(OutcomeFailed, 1)
	}
}

var (
	errHandler   = errors.New("handler failed")
	errAbandoned = errors.New("batch abandoned by AfterCommit")
)

// batchResult is what a committed batch leaves to acknowledge.
type batchResult struct {
	processed  []*Delivery
	duplicates []*Delivery
	poison     map[*Delivery]string
}

// runBatch is the transaction: claim, run the new, store results, commit.
func (c *Consumer) runBatch(ctx context.Context, ds []*Delivery) (batchResult, error) {
	res := batchResult{poison: map[*Delivery]string{}}

	// One claim per key: later deliveries of a key in the same batch are
	// duplicates of the first (or, with another payload, poison).
	first := make(map[string]*Delivery, len(ds))
	claims := make([]dedupe.Claim, 0, len(ds))
	var repeats []*Delivery
	for _, d := range ds {
		if f, ok := first[d.Key]; ok {
			if string(f.fingerprint) != string(d.fingerprint) {
				res.poison[d] = reasonMismatch
			} else {
				repeats = append(repeats, d)
			}
			continue
		}
		first[d.Key] = d
		claims = append(claims, dedupe.Claim{Key: d.Key, Fingerprint: d.fingerprint})
	}

	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("consumer: begin: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit

	var fresh map[string]bool
	if c.cfg.UnsafeSkipInboxClaim {
		fresh = make(map[string]bool, len(claims))
		for _, cl := range claims {
			fresh[cl.Key] = true
		}
	} else {
		fresh, err = dedupe.ClaimBatch(ctx, tx, c.cfg.Name, claims, c.cfg.KeyLifetime)
		if err != nil {
			return res, err
		}
	}

	var newOnes []*Delivery
	var seenKeys []string
	for _, cl := range claims { // sorted by key: handlers run in a stable order
		d := first[cl.Key]
		if fresh[cl.Key] {
			newOnes = append(newOnes, d)
		} else {
			seenKeys = append(seenKeys, cl.Key)
		}
	}
	if len(seenKeys) > 0 {
		recs, err := dedupe.Lookup(ctx, tx, c.cfg.Name, seenKeys)
		if err != nil {
			return res, err
		}
		for _, k := range seenKeys {
			d := first[k]
			rec, ok := recs[k]
			switch {
			case !ok:
				// Claimed concurrently and then rolled back between our claim and our
				// look-up: leave it for redelivery.
				return res, fmt.Errorf("consumer: key %q vanished between claim and look-up", k)
			case !rec.Matches(d.fingerprint):
				res.poison[d] = reasonMismatch
			default:
				res.duplicates = append(res.duplicates, d)
			}
		}
	}

	// Deliveries past MaxDeliver whose key is new never reached a commit (the worker
	// kept dying, or the handler kept failing): dead-letter instead of running again.
	runnable := newOnes[:0:0]
	var exhausted []string
	for _, d := range newOnes {
		if d.Deliveries > c.cfg.MaxDeliver {
			res.poison[d] = fmt.Sprintf("%s: delivered %d times, MaxDeliver is %d", reasonMaxDeliver, d.Deliveries, c.cfg.MaxDeliver)
			exhausted = append(exhausted, d.Key)
			continue
		}
		runnable = append(runnable, d)
	}
	if len(exhausted) > 0 && !c.cfg.UnsafeSkipInboxClaim {
		// Their claims are in this transaction; take them back so a replay of the
		// dead letter can still run the effect.
		if err := dedupe.Unclaim(ctx, tx, c.cfg.Name, exhausted); err != nil {
			return res, err
		}
	}

	if len(runnable) > 0 {
		results, err := c.cfg.BatchHandler.HandleBatch(ctx, tx, runnable)
		if err != nil {
			var fa failedAt
			if errors.As(err, &fa) {
				return res, failedAt{index: indexOf(ds, runnable[fa.index]), err: fa.err}
			}
			return res, fmt.Errorf("%w: %w", errHandler, err)
		}
		if len(results) != len(runnable) {
			return res, fmt.Errorf("%w: returned %d results for %d deliveries", errHandler, len(results), len(runnable))
		}
		if !c.cfg.UnsafeSkipInboxClaim {
			byKey := make(map[string][]byte, len(runnable))
			for i, d := range runnable {
				byKey[d.Key] = results[i]
			}
			if err := dedupe.SetResults(ctx, tx, c.cfg.Name, byKey); err != nil {
				return res, err
			}
		}
	}
	if c.cfg.BeforeCommit != nil {
		if err := c.cfg.BeforeCommit(ctx, ds); err != nil {
			return res, fmt.Errorf("consumer: before commit: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("consumer: commit: %w", err)
	}
	res.processed = runnable
	// Repeats inside the batch are duplicates of a first that just committed.
	res.duplicates = append(res.duplicates, repeats...)

	if c.cfg.AfterCommit != nil {
		if err := c.cfg.AfterCommit(ctx, ds); err != nil {
			return res, fmt.Errorf("%w: %w", errAbandoned, err)
		}
	}
	return res, nil
}

// settle acks a committed batch and dead-letters its poison.
func (c *Consumer) settle(ctx context.Context, res batchResult) {
	for _, d := range res.processed {
		c.ack(ctx, d)
	}
	for _, d := range res.duplicates {
		c.log.Debug("duplicate folded", "key", d.Key, "deliveries", d.Deliveries)
		c.ack(ctx, d)
	}
	for d, reason := range res.poison {
		c.deadLetter(ctx, d, reason)
	}
	c.count(OutcomeProcessed, len(res.processed))
	c.count(OutcomeDuplicate, len(res.duplicates))
}

func (c *Consumer) ack(ctx context.Context, d *Delivery) {
	var err error
	if c.cfg.DoubleAck {
		err = d.raw.DoubleAck(ctx)
	} else {
		err = d.raw.Ack()
	}
	if err != nil {
		// Harmless for correctness: the redelivery will be folded by the inbox.
		c.log.Warn("ack failed; the redelivery will be a duplicate", "key", d.Key, "err", err)
	}
}

// fail handles a handler error for one delivery: retry later, or dead-letter when
// it is permanent or out of deliveries.
func (c *Consumer) fail(ctx context.Context, d *Delivery, err error) {
	switch {
	case IsPermanent(err):
		c.deadLetter(ctx, d, fmt.Sprintf("%s: %v", reasonPermanent, err))
	case d.Deliveries >= c.cfg.MaxDeliver:
		c.deadLetter(ctx, d, fmt.Sprintf("%s: failed %d deliveries, last error: %v", reasonMaxDeliver, d.Deliveries, err))
	default:
		delay := c.cfg.Backoff(d.Deliveries)
		c.log.Warn("handler failed; will retry", "key", d.Key, "deliveries", d.Deliveries, "retry_in", delay, "err", err)
		_ = d.raw.NakWithDelay(delay)
		c.count(OutcomeFailed, 1)
	}
}

func (c *Consumer) count(outcome string, n int) {
	if c.cfg.OnOutcome != nil && n > 0 {
		c.cfg.OnOutcome(c.cfg.Name, outcome, n)
	}
}

// heartbeat tells JetStream the batch is still being worked on, every third of
// AckWait, so a long transaction does not trigger a redelivery to another worker.
func (c *Consumer) heartbeat(ctx context.Context, msgs []jetstream.Msg) (stop func()) {
	return every(ctx, c.cfg.AckWait/3, func() bool {
		for _, m := range msgs {
			_ = m.InProgress()
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

func indexOf(ds []*Delivery, d *Delivery) int {
	for i := range ds {
		if ds[i] == d {
			return i
		}
	}
	return -1
}

// startSpan opens the delivery's span as a child of the trace the producer put in
// the headers (traceparent), if any.
func (c *Consumer) startSpan(ctx context.Context, d *Delivery) {
	parent := propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier(d.Headers))
	d.ctx, d.span = c.tracer.Start(parent, "idem.consume "+d.Subject,
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			attribute.String("idem.consumer", c.cfg.Name),
			attribute.String("idem.key", d.Key),
			attribute.Int("idem.deliveries", d.Deliveries),
		))
}

// decode turns a JetStream message into a Delivery, or says why it is poison.
func decode(m jetstream.Msg) (*Delivery, string) {
	d := &Delivery{raw: m, Deliveries: 1}
	d.Subject = m.Subject()
	d.Payload = m.Data()
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
	d.Key = m.Headers().Get(idem.HeaderKey)
	d.fingerprint = dedupe.Fingerprint(d.Payload)
	if d.Key == "" {
		return d, reasonNoKey
	}
	scope, key := idem.SplitScopedKey(d.Key)
	if _, err := idem.ParseKey(string(key)); err != nil {
		return d, fmt.Sprintf("%s: %v", reasonBadKey, err)
	}
	if err := idem.ValidateScope(scope); err != nil {
		return d, fmt.Sprintf("%s: %v", reasonBadKey, err)
	}
	return d, ""
}

// Dead-letter reasons (the prefix of idem_dead_letters.reason).
const (
	reasonNoKey      = "missing Idempotency-Key header"
	reasonBadKey     = "malformed Idempotency-Key"
	reasonMismatch   = "fingerprint mismatch: this key was first seen with a different payload"
	reasonPermanent  = "permanent handler error"
	reasonMaxDeliver = "max deliveries exceeded"
)
