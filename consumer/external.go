package consumer

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
)

// Outcomes reported to ExternalConfig.OnOutcome in addition to the Consumer's.
const (
	// OutcomeBusy: another worker holds a live lease on the key; the delivery was
	// handed back to be retried after that lease would end.
	OutcomeBusy = "busy"
	// OutcomeAbandoned: ExternalConfig.AfterPerform abandoned the delivery (a fault
	// point standing for a worker that died there).
	OutcomeAbandoned = "abandoned"
)

// ExternalHandler performs an effect that cannot join a Postgres transaction: it
// sends an email, calls a payment provider. It runs between the two phases of the
// inbox claim (see External) and must pass the key downstream — e.Key or a key
// derived from it with e.KeyFor — so that a second attempt after a crash is folded
// by the downstream.
//
// The result is stored as the key's first result. Returning an error releases the
// lease, keeping the last recovery point, and the message is redelivered after a
// delay, up to MaxDeliver times, then dead-lettered. Wrap the error with Permanent
// when retrying cannot help (a payload that does not decode, a downstream that
// rejects the request).
//
// ctx is cancelled if the lease is lost (another worker took the key over after
// this one failed to extend it): stop then, the new holder is performing the
// effect with the same key.
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

	pool   *pgxpool.Pool
	holder dedupe.Holder
}

// Checkpoint records a recovery point: step has completed, and state is what the
// remaining steps need. An attempt that takes over after a crash or a failure
// resumes after step with state instead of starting over. It also updates e.Step
// and e.StepState. It fails with dedupe.ErrLeaseLost if another worker took the key
// over; the handler must then stop.
func (e *Effect) Checkpoint(ctx context.Context, step string, state []byte) error {
	if err := dedupe.RecordStep(ctx, e.pool, e.holder, step, state); err != nil {
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

// ExternalConfig configures an External consumer. The zero value of every optional
// field means its default.
type ExternalConfig struct {
	// Name is the durable JetStream consumer and the inbox's consumer column.
	// Required. A name is used either by an External or by a Consumer, never both.
	Name string
	// Subject is the filter subject, e.g. idem.emails.send. Required.
	Subject string
	// Handler performs the effect. Required.
	Handler ExternalHandler

	// LeaseFor is how long a claim outlives a worker that stops extending it
	// (default 30s). It is extended every third of min(LeaseFor, AckWait) while
	// Perform runs, so it bounds how long a crashed worker delays the retry, not
	// how long Perform may take.
	LeaseFor time.Duration
	// AckWait is how long JetStream waits for an ack before redelivering (default
	// 30s); in-progress heartbeats extend it while Perform runs.
	AckWait time.Duration
	// Concurrency is how many messages are performed at once (default 1). Each is
	// processed alone, from lease to ack.
	Concurrency int
	// MaxDeliver is how many attempts at the effect a message gets before it is
	// dead-lettered (default 10). A delivery that finds the key busy is handed
	// back without an attempt and does not count; one that finds it done is acked.
	MaxDeliver int
	// Backoff is the redelivery delay after the n-th failed attempt (default
	// DefaultBackoff).
	Backoff func(attempts int) time.Duration
	// KeyLifetime is how long inbox keys are remembered (default
	// dedupe.DefaultLifetime).
	KeyLifetime time.Duration

	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// TracerProvider makes one span per delivery, continuing the producer's trace,
	// as for Consumer; Perform's context carries it (default: no tracing).
	TracerProvider trace.TracerProvider
	// OnOutcome, when set, counts outcomes (for metrics): the Outcome* constants.
	OnOutcome func(consumer, outcome string, n int)
	// AfterPerform, when set, runs after Perform returned (err is its error) and
	// before the outcome is recorded. Returning an error abandons the delivery as
	// if the worker died there: the lease is neither completed nor released nor
	// extended, and the message is neither acked nor naked. A fault point for
	// tests and fault injection.
	AfterPerform func(ctx context.Context, d *Delivery, err error) error
}

func (c ExternalConfig) validate() error {
	switch {
	case c.Name == "":
		return errors.New("consumer: external: Name is required")
	case c.Subject == "":
		return errors.New("consumer: external: Subject is required")
	case c.Handler == nil:
		return errors.New("consumer: external: Handler is required")
	case c.Concurrency < 0, c.MaxDeliver < 0:
		return errors.New("consumer: external: sizes must not be negative")
	case c.LeaseFor < 0, c.AckWait < 0, c.KeyLifetime < 0:
		return errors.New("consumer: external: durations must not be negative")
	}
	return nil
}

func (c ExternalConfig) withDefaults() ExternalConfig {
	if c.LeaseFor == 0 {
		c.LeaseFor = 30 * time.Second
	}
	if c.AckWait == 0 {
		c.AckWait = 30 * time.Second
	}
	if c.Concurrency == 0 {
		c.Concurrency = 1
	}
	if c.MaxDeliver == 0 {
		c.MaxDeliver = 10
	}
	if c.Backoff == nil {
		c.Backoff = DefaultBackoff
	}
	if c.KeyLifetime == 0 {
		c.KeyLifetime = dedupe.DefaultLifetime
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.TracerProvider == nil {
		c.TracerProvider = noop.NewTracerProvider()
	}
	return c
}

// RedeliveryHorizon is the longest time over which one message can still be
// delivered again: for every delivery, the longer of the ack wait and the lease (a
// crashed worker's message comes back after AckWait but is performed only once
// its lease ends), plus every backoff. The inbox must remember a key for longer.
func (c ExternalConfig) RedeliveryHorizon() time.Duration {
	c = c.withDefaults()
	total := time.Duration(0)
	for n := 1; n <= c.MaxDeliver; n++ {
		total += max(c.AckWait, c.LeaseFor) + c.Backoff(n)
	}
	return total
}

// External runs an ExternalHandler over a durable JetStream pull consumer, with a
// two-phase claim in idem_inbox instead of one transaction:
//
//  1. Lease: claim the key as leased for LeaseFor, and commit.
//  2. Perform the effect, passing the key downstream. Meanwhile the lease is
//     extended and JetStream is sent in-progress heartbeats; a multi-step handler
//     records recovery points (Effect.Checkpoint).
//  3. Complete: store the result, mark the key done, and commit. Then ack.
//
// A delivery of a key that is done is acked without an effect. One that finds a
// live lease (another worker is performing it right now) is handed back to be
// retried when that lease would end, instead of running a second copy. One that
// finds an expired lease — its worker died mid-effect — takes it over and performs
// the effect again, with the same key, from the last recovery point.
//
// # What this guarantees
//
// The window between the effect reaching the downstream and step 3 committing
// cannot be closed by any local transaction. A worker that dies in it leaves a
// performed effect under a lease that expires, and the next attempt performs the
// effect again with the same key. So:
//
//   - Toward a downstream that honours the key (a provider's Idempotency-Key, a
//     mail system that dedupes on Message-ID): exactly once. The second attempt is
//     folded downstream; the inbox then records the first result.
//   - Toward a downstream that does not: at least once. A crash in the window
//     produces a second effect. Never silently zero: a key is marked done only
//     after Perform returned success, and a message is acked only after that, or
//     dead-lettered with its reason.
//   - Never two attempts at once, as long as the holder is alive: a live lease
//     makes every other delivery back off. Only a worker that stopped extending its
//     lease for LeaseFor (crashed, partitioned from Postgres, paused) can be
//     overtaken; it then loses the lease, its Perform's context is cancelled at its
//     next extension, and it cannot complete the key or overwrite its recovery
//     point.
//
// Recovery points narrow the re-run to the step that was under way: steps already
// checkpointed are not repeated at all.
//
// # Poison
//
// A message without a key or with a malformed one, a key first seen with another
// payload, a Permanent handler error, and a message that used up MaxDeliver
// attempts (failing, or dying mid-effect) are dead-lettered in idem_dead_letters
// with the reason and terminated. A dead-lettered key that had started keeps its
// recovery point, so a replay resumes it.
type External struct {
	pool *pgxpool.Pool
	js   jetstream.JetStream
	cfg  ExternalConfig
	log  *slog.Logger
	// base shares ack, failure and dead-letter handling with the in-transaction
	// Consumer, so both kinds of consumer dead-letter alike.
	base *Consumer
}

// NewExternal returns an External consumer. It does not touch the broker until Run.
func NewExternal(pool *pgxpool.Pool, js jetstream.JetStream, cfg ExternalConfig) (*External, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	log := cfg.Logger.With("consumer", cfg.Name, "subject", cfg.Subject, "effect", "external")
	base := &Consumer{
		pool: pool, js: js, log: log,
		tracer: cfg.TracerProvider.Tracer("github.com/idemkit/idem/consumer"),
		cfg: Config{
			Name:           cfg.Name,
			Subject:        cfg.Subject,
			AckWait:        cfg.AckWait,
			MaxDeliver:     cfg.MaxDeliver,
			Backoff:        cfg.Backoff,
			KeyLifetime:    cfg.KeyLifetime,
			Logger:         log,
			TracerProvider: cfg.TracerProvider,
			OnOutcome:      cfg.OnOutcome,
		},
	}
	return &External{pool: pool, js: js, cfg: cfg, log: log, base: base}, nil
}

// Config returns the configuration with defaults filled in.
func (x *External) Config() ExternalConfig { return x.cfg }

// JetStreamConfig is the durable consumer this External creates or updates.
func (x *External) JetStreamConfig() jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       x.cfg.Name,
		FilterSubject: x.cfg.Subject,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       x.cfg.AckWait,
		// As for Consumer: the broker never gives up on a message by itself; the
		// consumer dead-letters past MaxDeliver, with a trace.
		MaxDeliver: -1,
	}
}

// Run consumes until ctx is cancelled, then stops fetching, lets the effects under
// way finish (complete and ack) and returns nil. Messages received but not started
// are handed back to the broker.
func (x *External) Run(ctx context.Context) error {
	jc, err := x.js.CreateOrUpdateConsumer(ctx, idem.StreamName, x.JetStreamConfig())
	if err != nil {
		return fmt.Errorf("consumer %s: create durable consumer: %w", x.cfg.Name, err)
	}
	// A small buffer: a message waiting here gets no heartbeats, and effects are
	// slow, so prefetching many would only let their ack waits run out.
	buffer := make(chan jetstream.Msg, x.cfg.Concurrency)
	cc, err := jc.Consume(func(m jetstream.Msg) {
		select {
		case buffer <- m:
		case <-ctx.Done():
			_ = m.Nak()
		}
	}, jetstream.PullMaxMessages(2*x.cfg.Concurrency),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			x.log.Warn("consumer: pull error", "err", err)
		}))
	if err != nil {
		return fmt.Errorf("consumer %s: consume: %w", x.cfg.Name, err)
	}
	x.log.Info("external consumer started", "concurrency", x.cfg.Concurrency, "lease_for", x.cfg.LeaseFor)

	// Effects under way finish on a context that survives ctx: an effect cut off
	// half-way would only be performed again after its lease expired.
	work := context.WithoutCancel(ctx)
	var wg sync.WaitGroup
	for range x.cfg.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-ctx.Done():
					return
				case m := <-buffer:
					if ctx.Err() != nil {
						_ = m.Nak() // picked in the same instant as the shutdown
						return
					}
					x.handle(work, m)
				}
			}
		}()
	}
	<-ctx.Done()
	cc.Stop()
	wg.Wait()
	for {
		select {
		case m := <-buffer:
			_ = m.Nak()
			continue
		default:
		}
		break
	}
	x.log.Info("external consumer stopped")
	return nil
}

// handle takes one message from delivery to ack.
func (x *External) handle(ctx context.Context, m jetstream.Msg) {
	d, reason := decode(m)
	x.base.startSpan(ctx, d)
	defer d.span.End()
	if reason != "" {
		x.base.deadLetter(ctx, d, reason)
		return
	}
	lr, err := dedupe.Lease(ctx, x.pool, x.cfg.Name, d.Key, d.fingerprint, x.cfg.LeaseFor, x.cfg.KeyLifetime)
	if err != nil {
		// The database failed, not the message: try again shortly.
		x.log.Error("lease failed; will be redelivered", "key", d.Key, "err", err)
		_ = d.raw.NakWithDelay(x.cfg.Backoff(1))
		x.base.count(OutcomeFailed, 1)
		return
	}
	switch lr.Outcome {
	case dedupe.LeaseDone:
		x.log.Debug("duplicate folded", "key", d.Key, "deliveries", d.Deliveries)
		x.base.ack(ctx, d)
		x.base.count(OutcomeDuplicate, 1)
	case dedupe.LeaseMismatch:
		x.base.deadLetter(ctx, d, reasonMismatch)
	case dedupe.LeaseBusy:
		// Someone is performing this key right now. Come back when its lease would
		// end: if the holder finished, the key is done; if it died, the lease is
		// ours to take. Busy deliveries are not failures and are never
		// dead-lettered for their count: the holder's own message carries the
		// MaxDeliver budget.
		delay := min(lr.RetryIn, x.cfg.LeaseFor) + x.cfg.LeaseFor/10
		x.log.Debug("key leased by another worker; backing off", "key", d.Key, "retry_in", delay)
		_ = d.raw.NakWithDelay(delay)
		x.base.count(OutcomeBusy, 1)
	case dedupe.LeaseAcquired:
		x.perform(ctx, d, lr)
	default:
		x.log.Error("unknown lease outcome; will be redelivered", "key", d.Key, "outcome", lr.Outcome)
		_ = d.raw.NakWithDelay(x.cfg.Backoff(1))
		x.base.count(OutcomeFailed, 1)
	}
}

// errLeaseLost is the cause with which Perform's context is cancelled when an
// extension finds that another worker took the key over.
var errLeaseLost = errors.New("consumer: lease lost to another worker")

// perform runs the handler under the lease it acquired, then records the outcome.
func (x *External) perform(ctx context.Context, d *Delivery, lr dedupe.LeaseResult) {
	h := lr.Holder
	if n := attempts(d, lr); n > x.cfg.MaxDeliver {
		// Every earlier attempt died before reaching an outcome. Give the key back
		// (its recovery point stays, for a replay) and file the message.
		x.release(ctx, h)
		x.base.deadLetter(ctx, d, fmt.Sprintf("%s: attempted %d times (%d deliveries), MaxDeliver is %d",
			reasonMaxDeliver, n-1, d.Deliveries, x.cfg.MaxDeliver))
		return
	}
	if lr.Attempt > 1 {
		x.log.Info("taking over an interrupted effect; performing it again with the same key",
			"key", d.Key, "attempt", lr.Attempt, "resume_after", lr.Step)
	}
	e := &Effect{Delivery: d, Attempt: lr.Attempt, Step: lr.Step, StepState: lr.StepState, pool: x.pool, holder: h}

	// Perform's context carries the delivery's span (d.Context() derives from ctx),
	// so the handler's own spans — an HTTP call downstream — join the intent's trace.
	pctx, cancel := context.WithCancelCause(d.Context())
	defer cancel(nil)
	stopBeat := x.keepAlive(pctx, cancel, d, h)
	result, err := x.cfg.Handler.Perform(pctx, e)
	stopBeat()
	lost := errors.Is(context.Cause(pctx), errLeaseLost)

	if x.cfg.AfterPerform != nil {
		if ferr := x.cfg.AfterPerform(ctx, d, err); ferr != nil {
			x.log.Warn("delivery abandoned after the effect, before its outcome was recorded (fault point)", "key", d.Key, "err", ferr)
			x.base.count(OutcomeAbandoned, 1)
			return
		}
	}

	switch {
	case lost:
		// The new holder performs the effect (again, with the same key) and
		// completes it; this delivery will find it done or busy.
		x.log.Warn("lease lost while performing; leaving the key to its new holder", "key", d.Key, "err", err)
		_ = d.raw.NakWithDelay(x.cfg.LeaseFor)
		x.base.count(OutcomeFailed, 1)
	case err != nil:
		x.release(ctx, h)
		x.fail(ctx, d, attempts(d, lr), err)
	default:
		x.complete(ctx, d, h, result)
	}
}

// attempts is how many attempts at the effect this delivery is charged with,
// itself included. JetStream's delivery count also counts the deliveries that
// found the key busy and never attempted anything, and the key's attempt count
// also counts other messages with the same key (copies, a dead-letter replay). This
// message's own attempts are at most the smaller of the two, and that is what is
// charged: a busy back-off never uses up the budget, and a replayed dead letter
// (delivered once so far) gets a fresh one.
func attempts(d *Delivery, lr dedupe.LeaseResult) int {
	return min(d.Deliveries, lr.Attempt)
}

// fail handles an error from Perform, after the lease was released: dead-letter a
// permanent error or an exhausted message, retry anything else after a backoff.
func (x *External) fail(ctx context.Context, d *Delivery, attempt int, err error) {
	switch {
	case IsPermanent(err):
		x.base.deadLetter(ctx, d, fmt.Sprintf("%s: %v", reasonPermanent, err))
	case attempt >= x.cfg.MaxDeliver:
		x.base.deadLetter(ctx, d, fmt.Sprintf("%s: failed %d attempts (%d deliveries), last error: %v",
			reasonMaxDeliver, attempt, d.Deliveries, err))
	default:
		delay := x.cfg.Backoff(attempt)
		x.log.Warn("effect failed; will retry from its last recovery point", "key", d.Key, "attempt", attempt, "retry_in", delay, "err", err)
		_ = d.raw.NakWithDelay(delay)
		x.base.count(OutcomeFailed, 1)
	}
}

// complete records the result and acks. The effect has happened: failing to record
// it costs a second attempt (with the same key) once the lease expires, so a
// transient database error is retried a few times first.
func (x *External) complete(ctx context.Context, d *Delivery, h dedupe.Holder, result []byte) {
	var err error
	for try := range 3 {
		if try > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(time.Duration(try) * 100 * time.Millisecond):
			}
		}
		err = dedupe.CompleteLease(ctx, x.pool, h, result)
		if err == nil || errors.Is(err, dedupe.ErrLeaseLost) || ctx.Err() != nil {
			break
		}
	}
	switch {
	case err == nil:
		x.base.ack(ctx, d)
		x.base.count(OutcomeProcessed, 1)
	case errors.Is(err, dedupe.ErrLeaseLost):
		x.log.Warn("effect performed, but the lease was taken over before completion; the new holder performs it again with the same key",
			"key", d.Key)
		_ = d.raw.NakWithDelay(x.cfg.LeaseFor)
		x.base.count(OutcomeFailed, 1)
	default:
		x.log.Error("effect performed but not recorded; when the lease expires it is performed again with the same key",
			"key", d.Key, "err", err)
		_ = d.raw.NakWithDelay(x.cfg.LeaseFor)
		x.base.count(OutcomeFailed, 1)
	}
}

// release gives the key back after a failed attempt so the retry need not wait for
// the lease to expire. If it cannot, the lease expires by itself.
func (x *External) release(ctx context.Context, h dedupe.Holder) {
	if err := dedupe.ReleaseLease(ctx, x.pool, h); err != nil && !errors.Is(err, dedupe.ErrLeaseLost) {
		x.log.Warn("lease not released; the retry waits for it to expire", "key", h.Key, "err", err)
	}
}

// keepAlive sends JetStream in-progress heartbeats and extends the lease every
// third of min(LeaseFor, AckWait) until stop is called. If an extension finds the
// lease lost, it cancels Perform's context with errLeaseLost. stop waits for the
// heartbeat goroutine, so no extension lands after it returns.
func (x *External) keepAlive(ctx context.Context, cancel context.CancelCauseFunc, d *Delivery, h dedupe.Holder) (stop func()) {
	interval := max(min(x.cfg.LeaseFor, x.cfg.AckWait)/3, time.Millisecond)
	return every(ctx, interval, func() bool {
		_ = d.raw.InProgress()
		_, err := dedupe.ExtendLease(ctx, x.pool, h, x.cfg.LeaseFor)
		switch {
		case errors.Is(err, dedupe.ErrLeaseLost):
			cancel(errLeaseLost)
			return false
		case err != nil && ctx.Err() == nil:
			// Keep trying: the lease still runs for a while, and the next
			// extension may succeed.
			x.log.Warn("lease extension failed", "key", h.Key, "err", err)
		}
		return true
	})
}
