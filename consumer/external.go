package consumer

// The external path: one delivery, a lease committed before the effect, the result
// committed after it; see ExternalHandler and the package documentation.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"github.com/idemkit/idem"

	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/internal/faults"
)

// ExternalHandler performs an effect that cannot join a Postgres transaction: it
// sends an email, calls a payment provider. It runs between the two phases of the
// inbox claim and must pass the key downstream — e.Key or a key derived from it with
// e.KeyFor — so that a second attempt after a crash is folded by the downstream.
//
// The result is stored as the key's first result. Returning an error releases the
// lease, keeping the last recovery point, and the message is redelivered after a
// delay, up to MaxDeliver attempts, then dead-lettered. Wrap the error with
// Permanent when retrying cannot help (a payload that does not decode, a downstream
// that rejects the request).
//
// ctx is cancelled if the lease is lost (another worker took the key over after
// this one failed to extend it): stop then, the new holder is performing the effect
// with the same key.
type ExternalHandler interface {
	Perform(ctx context.Context, e *Effect) (result []byte, err error)
}

// ExternalHandlerFunc adapts a function to ExternalHandler.
type ExternalHandlerFunc func(ctx context.Context, e *Effect) ([]byte, error)

// Perform calls f.
func (f ExternalHandlerFunc) Perform(ctx context.Context, e *Effect) ([]byte, error) {
	return f(ctx, e)
}

// Effect is one delivery whose key the worker holds a lease on, as handed to an
// ExternalHandler. The embedded Delivery carries the message: e.Key is the scoped
// idempotency key, e.Payload the body.
type Effect struct {
	*Delivery

	// Attempt is 1 on the first attempt at this key. Above 1 an earlier attempt
	// died or failed after it may already have reached the downstream: this one
	// must present the same downstream key, which it does if it uses e.Key or
	// e.KeyFor.
	Attempt int
	// Step and StepState are the last recovery point (Checkpoint) of earlier
	// attempts, or empty. A multi-step handler skips the steps up to and including
	// Step and resumes with StepState.
	Step      string
	StepState []byte

	c      *Consumer
	holder dedupe.Holder
}

// Checkpoint records a recovery point: step has completed, and state is what the
// remaining steps need. An attempt that takes over after a crash or a failure
// resumes after step with state instead of starting over. It also updates e.Step
// and e.StepState. It fails with dedupe.ErrLeaseLost if another worker took the key
// over; the handler must then stop.
func (e *Effect) Checkpoint(ctx context.Context, step string, state []byte) error {
	if err := e.c.inbox.RecordStep(ctx, e.c.pool, e.holder, step, state); err != nil {
		return fmt.Errorf("consumer: checkpoint %q of %q: %w", step, e.Key, err)
	}
	e.Step, e.StepState = step, state
	return nil
}

// KeyFor derives the key to present downstream for one purpose of this intent
// ("authorize", "capture", ...): 64 hex digits, the same on every attempt, distinct
// per purpose and per scoped key. A downstream that allows one operation per key
// (a payment provider does) needs one key per step; and the scoped key itself may
// hold a separator byte no HTTP header or mail header accepts.
func (e *Effect) KeyFor(purpose string) string {
	// The key never contains NUL, so the join is unambiguous.
	sum := sha256.Sum256([]byte(e.Key + "\x00" + purpose))
	return hex.EncodeToString(sum[:])
}

// errLeaseLost is the cause with which Perform's context is cancelled when an
// extension finds that another worker took the key over.
var errLeaseLost = errors.New("consumer: lease lost to another worker")

// perform takes one delivery of an external effect from lease to ack.
func (c *Consumer) perform(ctx context.Context, d *Delivery) {
	// The local clock's view of when the lease was taken: read before the statement
	// is sent, so the lease cannot have started earlier than this (see fence).
	var lr dedupe.LeaseResult
	var sent time.Time
	stopBeat := c.heartbeat(ctx, []*Delivery{d}) // while the database may be down
	err := c.whileDatabaseDown(ctx, []*Delivery{d}, func() (err error) {
		sent = time.Now()
		lr, err = c.inbox.Lease(ctx, c.pool, c.cfg.Name, c.idOf(d), d.Payload, c.cfg.LeaseFor, c.cfg.KeyLifetime)
		return err
	})
	stopBeat()
	if err != nil {
		return // shutting down: handed back by whileDatabaseDown
	}
	switch lr.Outcome {
	case dedupe.LeaseDone:
		c.log.DebugContext(ctx, "duplicate folded", "key", d.Key, "deliveries", d.Deliveries)
		c.ack(ctx, d)
		c.observe(idem.OutcomeDuplicate, 1, 0)
	case dedupe.LeaseMismatch:
		c.deadLetter(ctx, d, reasonMismatch)
	case dedupe.LeaseBusy:
		// Someone is performing this key right now. Come back when its lease would
		// end: if the holder finished, the key is done; if it died, the lease is
		// ours to take. Busy deliveries are not failures and are never
		// dead-lettered for their count: the holder's own message carries the
		// MaxDeliver budget.
		delay := min(lr.RetryIn, c.cfg.LeaseFor) + c.cfg.LeaseFor/10
		c.log.DebugContext(ctx, "key leased by another worker; backing off", "key", d.Key, "retry_in", delay)
		_ = d.raw.NakWithDelay(delay)
		c.observe(idem.OutcomeBusy, 1, 0)
	case dedupe.LeaseAcquired:
		c.performLeased(ctx, d, lr, sent)
	default:
		c.log.ErrorContext(ctx, "unknown lease outcome; will be redelivered", "key", d.Key, "outcome", lr.Outcome)
		c.retryLater(d, c.cfg.Backoff(1))
	}
}

// performLeased runs the handler under the lease it acquired (the acquisition was
// sent at sent, by the local clock), then records the outcome.
func (c *Consumer) performLeased(ctx context.Context, d *Delivery, lr dedupe.LeaseResult, sent time.Time) {
	h := lr.Holder
	attempt := chargedAttempts(d, lr)
	if attempt > c.cfg.MaxDeliver {
		// Every earlier attempt died before reaching an outcome. Give the key back
		// (its recovery point stays, for a replay) and file the message.
		c.release(ctx, h)
		c.deadLetter(ctx, d, fmt.Sprintf("%s: attempted %d times (%d deliveries), MaxDeliver is %d",
			reasonMaxDeliver, attempt-1, d.Deliveries, c.cfg.MaxDeliver))
		return
	}
	if lr.Attempt > 1 {
		c.log.InfoContext(ctx, "taking over an interrupted effect; performing it again with the same key",
			"key", d.Key, "attempt", lr.Attempt, "resume_after", lr.Step)
	}
	e := &Effect{Delivery: d, Attempt: lr.Attempt, Step: lr.Step, StepState: lr.StepState, c: c, holder: h}

	// Perform's context carries the delivery's span (d.Context() derives from ctx),
	// so the handler's own spans — an HTTP call downstream — join the intent's trace.
	pctx, cancel := context.WithCancelCause(d.Context())
	defer cancel(nil)
	start := time.Now()
	f := c.fence(cancel, sent)
	stopBeat := c.keepAlive(pctx, cancel, d, h, f)
	result, err := c.runPerform(pctx, e)
	stopBeat()
	f.stop()
	cause := context.Cause(pctx)
	lost := errors.Is(cause, errLeaseLost) || errors.Is(cause, errLeaseRunningOut)

	if err == nil {
		if ferr := faults.From(ctx).Hit(ctx, faults.ExternalAfterPerform, []string{d.Key}); ferr != nil {
			// As if the worker died here: the lease is neither completed nor
			// released nor extended, and the message neither acked nor naked.
			c.log.WarnContext(ctx, "delivery abandoned after the effect, before its outcome was recorded (fault point)", "key", d.Key, "err", ferr)
			c.observe(idem.OutcomeAbandoned, 1, 0)
			return
		}
	}

	switch {
	case err == nil:
		// The effect happened: record it whenever the token still holds, even if
		// the fence cancelled Perform late or the lease ran out while the database
		// stalled. Only a takeover (ErrLeaseLost) stops the record, and then the
		// new holder performs it again with the same key.
		c.complete(ctx, d, h, result, time.Since(start), f.end())
	case lost:
		// Another worker holds the key, or may by the time this one could record
		// anything: it performs the effect (again, with the same key) and
		// completes it; this delivery will find it done or busy.
		c.log.WarnContext(ctx, "lease lost while performing; leaving the key to its next holder", "key", d.Key, "cause", cause, "err", err)
		c.retryLater(d, c.cfg.LeaseFor)
	default:
		c.release(ctx, h)
		c.fail(ctx, d, attempt, err)
	}
}

// chargedAttempts is how many attempts at the effect this delivery is charged with,
// itself included. JetStream's delivery count also counts the deliveries that found
// the key busy and never attempted anything, and the key's attempt count also
// counts other messages with the same key (copies, a dead-letter replay). This
// message's own attempts are at most the smaller of the two, and that is what is
// charged: a busy back-off never uses up the budget, and a replayed dead letter
// (delivered once so far) gets a fresh one.
func chargedAttempts(d *Delivery, lr dedupe.LeaseResult) int {
	return min(d.Deliveries, lr.Attempt)
}

// complete records the result and acks. The effect has happened, so the record is
// written whenever this worker's token still holds: while the database is down the
// message is held (heartbeats) and the record tried again. Only a takeover stops
// it; failing to record costs a second attempt (with the same key) once the lease
// expires.
//
// The record does not depend on ctx, the work context: a hard stop that cancelled
// Perform must not also throw away the record of an effect that succeeded in spite
// of it. Once the worker is stopping, the record is tried until leaseEnd (the end
// of the lease by this worker's clock; a short grace if it has already passed),
// since until then nobody can take the key over; only a database unreachable that
// long leaves the key to a takeover.
func (c *Consumer) complete(ctx context.Context, d *Delivery, h dedupe.Holder, result []byte, took time.Duration, leaseEnd time.Time) {
	rctx := context.WithoutCancel(ctx)
	lost := false
	stopBeat := c.heartbeat(rctx, []*Delivery{d})
	record := func(octx context.Context) error {
		err := c.inbox.CompleteLease(octx, c.pool, h, result)
		if errors.Is(err, dedupe.ErrLeaseLost) {
			lost = true
			return nil
		}
		return err
	}
	var err error
	if c.recordOnWork {
		err = record(ctx) // the negative control: on the work context a hard stop cancels
	} else {
		err = c.untilRecorded(ctx, d, leaseEnd, record)
	}
	stopBeat()
	switch {
	case err == nil && !lost:
		c.ack(ctx, d)
		c.observeProcessed([]*Delivery{d}, took, took, time.Now())
	case lost:
		c.log.WarnContext(ctx, "effect performed, but the lease was taken over before completion; the new holder performs it again with the same key",
			"key", d.Key)
		c.retryLater(d, c.cfg.LeaseFor)
	case errors.Is(err, errStopping):
		c.log.ErrorContext(ctx, "effect performed but not recorded before shutdown (database unavailable); when the lease expires it is performed again with the same key",
			"key", d.Key)
	default:
		c.log.ErrorContext(ctx, "effect performed but not recorded; when the lease expires it is performed again with the same key",
			"key", d.Key, "err", err)
		c.retryLater(d, c.cfg.LeaseFor)
	}
}

// release gives the key back after a failed attempt so the retry need not wait for
// the lease to expire. If it cannot, the lease expires by itself.
func (c *Consumer) release(ctx context.Context, h dedupe.Holder) {
	if err := c.inbox.ReleaseLease(ctx, c.pool, h); err != nil && !errors.Is(err, dedupe.ErrLeaseLost) {
		c.log.WarnContext(ctx, "lease not released; the retry waits for it to expire", "key", h.Key, "err", err)
	}
}

// errLeaseRunningOut is the cause with which Perform's context is cancelled when
// the lease may run out before it could be extended, by this worker's own clock.
var errLeaseRunningOut = errors.New("consumer: lease about to run out without an extension")

// fence cancels Perform before its lease can have expired. The database decides
// when a lease ends (lease_until, by its clock); this worker cannot see that clock
// while the database stalls for it, which is exactly when another worker may take
// the key over. So the holder keeps its own deadline, on its monotonic clock:
// LeaseFor after it sent the statement that started (or last extended) the lease —
// the lease cannot have started before that — minus a margin for clock rate skew
// and for Perform to stop. Past the deadline it cancels Perform with
// errLeaseRunningOut. No two workers perform at once as long as the handler stops
// when its context is cancelled, within the margin.
type leaseFence struct {
	mu     sync.Mutex
	timer  *time.Timer
	margin time.Duration
	ttl    time.Duration
	sent   time.Time // of the statement that started or last extended the lease
}

func (c *Consumer) fence(cancel context.CancelCauseFunc, sent time.Time) *leaseFence {
	margin := max(c.cfg.LeaseFor/5, 10*time.Millisecond)
	f := &leaseFence{margin: margin, ttl: c.cfg.LeaseFor, sent: sent}
	f.timer = time.AfterFunc(time.Until(sent.Add(f.ttl-margin)), func() { cancel(errLeaseRunningOut) })
	return f
}

// end is when the lease ends by this worker's clock: LeaseFor after the statement
// that started or last extended it was sent.
func (f *leaseFence) end() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.sent.Add(f.ttl)
}

// extended moves the deadline after an extension whose statement was sent at sent.
func (f *leaseFence) extended(sent time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sent = sent
	f.timer.Reset(time.Until(sent.Add(f.ttl - f.margin)))
}

func (f *leaseFence) stop() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.timer.Stop()
}

// runPerform runs the handler, turning a panic into its failure: the worker
// survives, the lease is released and the message retried like any failure.
func (c *Consumer) runPerform(ctx context.Context, e *Effect) (result []byte, err error) {
	defer func() {
		if v := recover(); v != nil {
			c.log.ErrorContext(ctx, "handler panicked", "key", e.Key, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
			result, err = nil, fmt.Errorf("handler panicked: %v", v)
		}
	}()
	faults.From(ctx).Marked(e.Headers[faults.MarkHeader])
	return c.cfg.External.Perform(ctx, e)
}

// keepAlive sends JetStream in-progress heartbeats and extends the lease every
// third of min(LeaseFor, AckWait) until stop is called. Each extension has a
// deadline (the interval: a database that stalls longer is treated as failed), and
// each that succeeds moves the fence. If an extension finds the lease lost, it
// cancels Perform's context with errLeaseLost. stop waits for the heartbeat
// goroutine, so no extension lands after it returns.
func (c *Consumer) keepAlive(ctx context.Context, cancel context.CancelCauseFunc, d *Delivery, h dedupe.Holder, f *leaseFence) (stop func()) {
	interval := max(min(c.cfg.LeaseFor, c.cfg.AckWait)/3, time.Millisecond)
	return every(ctx, interval, func() bool {
		_ = d.raw.InProgress()
		sent := time.Now()
		ectx, done := context.WithTimeout(ctx, interval)
		_, err := c.inbox.ExtendLease(ectx, c.pool, h, c.cfg.LeaseFor)
		done()
		switch {
		case err == nil:
			f.extended(sent)
		case errors.Is(err, dedupe.ErrLeaseLost):
			cancel(errLeaseLost)
			return false
		case ctx.Err() == nil:
			// Keep trying: the lease still runs for a while (the fence cancels
			// Perform before it could end), and the next extension may succeed.
			c.log.WarnContext(ctx, "lease extension failed", "key", h.Key, "err", err)
		}
		return true
	})
}
