package consumer

import (
	"context"
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

// Outcomes reported to Config.OnOutcome.
const (
	OutcomeProcessed    = "processed"
	OutcomeDuplicate    = "duplicate"
	OutcomeFailed       = "failed"
	OutcomeDeadLettered = "dead_lettered"
)

// Config configures a Consumer. The zero value of every optional field means its
// default.
type Config struct {
	// Name is the durable JetStream consumer and the inbox's consumer column.
	// Required. Two workers with the same Name share the work.
	Name string
	// Subject is the filter subject, e.g. idem.payments.charge. Required.
	Subject string
	// Handler or BatchHandler runs the effect; set exactly one.
	Handler      Handler
	BatchHandler BatchHandler

	// BatchSize is the most messages processed in one transaction (default 250).
	BatchSize int
	// Linger is how long a batch waits for more messages after its first one
	// (default 0: a batch is whatever is already buffered, so a lone message is
	// never held back).
	Linger time.Duration
	// Concurrency is how many batches run at once (default 2: one commits while
	// the next is being claimed).
	Concurrency int
	// AckWait is how long JetStream waits for an ack before redelivering (default
	// 30s). Long handlers extend it with in-progress heartbeats.
	AckWait time.Duration
	// MaxDeliver is how many deliveries a failing message gets before it is
	// dead-lettered (default 10).
	MaxDeliver int
	// Backoff is the redelivery delay after the n-th failed delivery (default:
	// 1s doubling to at most 1m).
	Backoff func(deliveries int) time.Duration
	// KeyLifetime is how long inbox keys are remembered (default
	// dedupe.DefaultLifetime).
	KeyLifetime time.Duration
	// DoubleAck waits for the server to confirm each ack. Off by default: a lost ack
	// costs only a redelivery, which the inbox folds.
	DoubleAck bool
	// MaxAckPending bounds messages delivered and not yet acked (default
	// max(1000, 4*BatchSize*Concurrency)).
	MaxAckPending int

	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// TracerProvider makes one span per delivery, continuing the producer's trace
	// from the traceparent header (default: no tracing).
	TracerProvider trace.TracerProvider
	// OnOutcome, when set, counts outcomes (for metrics).
	OnOutcome func(consumer, outcome string, n int)
	// BeforeCommit, when set, runs after the handlers' effects and before COMMIT.
	// Returning an error rolls the batch back: a fault point for tests.
	BeforeCommit func(ctx context.Context, ds []*Delivery) error
	// AfterCommit, when set, runs after a batch committed and before it is acked.
	// Returning an error abandons the batch unacked, as if the worker died there:
	// a fault point for tests and fault injection.
	AfterCommit func(ctx context.Context, ds []*Delivery) error

	// UnsafeSkipInboxClaim runs every delivery's handler without claiming its key.
	// It exists only so tests can show that removing the claim produces double
	// effects (a negative control). Never set it in production.
	UnsafeSkipInboxClaim bool
}

func (c Config) validate() error {
	switch {
	case c.Name == "":
		return errors.New("consumer: Name is required")
	case c.Subject == "":
		return errors.New("consumer: Subject is required")
	case (c.Handler == nil) == (c.BatchHandler == nil):
		return errors.New("consumer: set exactly one of Handler and BatchHandler")
	case c.BatchSize < 0, c.Concurrency < 0, c.MaxDeliver < 0, c.MaxAckPending < 0:
		return errors.New("consumer: sizes must not be negative")
	case c.AckWait < 0, c.Linger < 0, c.KeyLifetime < 0:
		return errors.New("consumer: durations must not be negative")
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.BatchSize == 0 {
		c.BatchSize = 250
	}
	if c.Concurrency == 0 {
		c.Concurrency = 2
	}
	if c.AckWait == 0 {
		c.AckWait = 30 * time.Second
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
	if c.MaxAckPending == 0 {
		c.MaxAckPending = max(1000, 4*c.BatchSize*c.Concurrency)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.TracerProvider == nil {
		c.TracerProvider = noop.NewTracerProvider()
	}
	if c.BatchHandler == nil {
		c.BatchHandler = singleAsBatch{c.Handler}
	}
	return c
}

// DefaultBackoff waits 1s after the first failed delivery, doubling to at most 1m.
func DefaultBackoff(deliveries int) time.Duration {
	d := time.Second
	for i := 1; i < deliveries && d < time.Minute; i++ {
		d *= 2
	}
	return min(d, time.Minute)
}

// RedeliveryHorizon is the longest time over which one message can still be
// delivered again: every delivery's ack wait plus every backoff. The inbox must
// remember a key for longer than this.
func (c Config) RedeliveryHorizon() time.Duration {
	c = c.withDefaults()
	total := time.Duration(0)
	for n := 1; n <= c.MaxDeliver; n++ {
		total += c.AckWait + c.Backoff(n)
	}
	return total
}

// Consumer runs a handler over a durable JetStream pull consumer, exactly once per
// key: each batch of deliveries is processed in one Postgres transaction that claims
// the keys in idem_inbox, runs the handlers of the new keys, stores their results and
// commits; only then are the messages acked.
type Consumer struct {
	pool   *pgxpool.Pool
	js     jetstream.JetStream
	cfg    Config
	log    *slog.Logger
	tracer trace.Tracer
}

// New returns a consumer. It does not touch the broker until Run.
func New(pool *pgxpool.Pool, js jetstream.JetStream, cfg Config) (*Consumer, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	return &Consumer{
		pool: pool, js: js, cfg: cfg,
		log:    cfg.Logger.With("consumer", cfg.Name, "subject", cfg.Subject),
		tracer: cfg.TracerProvider.Tracer("github.com/idemkit/idem/consumer"),
	}, nil
}

// Config returns the consumer's configuration with defaults filled in.
func (c *Consumer) Config() Config { return c.cfg }

// JetStreamConfig is the durable consumer this Consumer creates or updates.
func (c *Consumer) JetStreamConfig() jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       c.cfg.Name,
		FilterSubject: c.cfg.Subject,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       c.cfg.AckWait,
		// The broker never gives up on a message by itself: a message it stopped
		// delivering would vanish without a trace. The consumer counts deliveries
		// and dead-letters past MaxDeliver instead.
		MaxDeliver:    -1,
		MaxAckPending: c.cfg.MaxAckPending,
	}
}

// Run consumes until ctx is cancelled, then stops fetching, finishes the batches
// already received (commit and ack) and returns nil. Messages received but not
// processed are left unacked and will be redelivered.
func (c *Consumer) Run(ctx context.Context) error {
	jc, err := c.js.CreateOrUpdateConsumer(ctx, idem.StreamName, c.JetStreamConfig())
	if err != nil {
		return fmt.Errorf("consumer %s: create durable consumer: %w", c.cfg.Name, err)
	}
	buffer := make(chan jetstream.Msg, c.cfg.BatchSize*c.cfg.Concurrency)
	cc, err := jc.Consume(func(m jetstream.Msg) {
		select {
		case buffer <- m:
		case <-ctx.Done():
			// Shutting down: hand it straight back for another worker.
			_ = m.Nak()
		}
	}, jetstream.PullMaxMessages(2*c.cfg.BatchSize*c.cfg.Concurrency),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			c.log.Warn("consumer: pull error", "err", err)
		}))
	if err != nil {
		return fmt.Errorf("consumer %s: consume: %w", c.cfg.Name, err)
	}
	c.log.Info("consumer started", "batch_size", c.cfg.BatchSize, "concurrency", c.cfg.Concurrency)

	// Batches in flight finish on a context that survives ctx: a half-done batch
	// would only be redelivered, but finishing it is the graceful thing to do.
	work := context.WithoutCancel(ctx)
	var wg sync.WaitGroup
	for range c.cfg.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				batch, ok := c.nextBatch(ctx, buffer)
				if len(batch) > 0 {
					c.process(work, batch)
				}
				if !ok {
					return
				}
			}
		}()
	}
	<-ctx.Done()
	cc.Stop()
	wg.Wait()
	// Messages buffered but never started go back to the broker now rather than
	// after AckWait.
	for {
		select {
		case m := <-buffer:
			_ = m.Nak()
			continue
		default:
		}
		break
	}
	c.log.Info("consumer stopped")
	return nil
}

// nextBatch blocks for one message, then takes whatever else is buffered (waiting
// at most Linger) up to BatchSize. ok is false once ctx is done.
func (c *Consumer) nextBatch(ctx context.Context, buffer <-chan jetstream.Msg) (batch []jetstream.Msg, ok bool) {
	select {
	case <-ctx.Done():
		return nil, false
	case m := <-buffer:
		batch = append(batch, m)
	}
	var linger <-chan time.Time
	if c.cfg.Linger > 0 {
		t := time.NewTimer(c.cfg.Linger)
		defer t.Stop()
		linger = t.C
	}
	for len(batch) < c.cfg.BatchSize {
		select {
		case m := <-buffer:
			batch = append(batch, m)
			continue
		default:
		}
		if linger == nil {
			return batch, true
		}
		select {
		case m := <-buffer:
			batch = append(batch, m)
		case <-linger:
			return batch, true
		case <-ctx.Done():
			return batch, true
		}
	}
	return batch, true
}
