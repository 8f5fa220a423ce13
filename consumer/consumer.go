package consumer

import (
	"context"
	"fmt"
	"log/slog"
	"sync"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
)

// Outcomes reported to Config.Observer (Event.Outcome).
const (
	// OutcomeProcessed: the effect ran (or, for an External, completed) and the
	// message was acked.
	OutcomeProcessed = "processed"
	// OutcomeDuplicate: the key was done already; the message was acked, no effect.
	OutcomeDuplicate = "duplicate"
	// OutcomeFailed: the attempt failed (handler error, database or broker error);
	// the message will be redelivered.
	OutcomeFailed = "failed"
	// OutcomeDeadLettered: the message was filed in idem_dead_letters with its
	// reason and terminated.
	OutcomeDeadLettered = "dead_lettered"
	// OutcomeBusy: (External) another worker holds a live lease on the key; the
	// delivery was handed back to be retried after that lease would end.
	OutcomeBusy = "busy"
	// OutcomeAbandoned: a test fault point abandoned the work as if the worker had
	// died there.
	OutcomeAbandoned = "abandoned"
	// OutcomeSkipped: a dead-letter replay meant for another consumer
	// (idem.HeaderReplayFor); acked without an effect.
	OutcomeSkipped = "skipped"
)

// Consumer runs a handler over a durable JetStream pull consumer, exactly once per
// key; see the package documentation. One engine serves both kinds of handler: the
// pull loop, the acks, the retries and the dead letters are the same, only the
// step between "delivered" and "settled" differs (one transaction for a batch, or
// a lease around one external effect).
type Consumer struct {
	pool   *pgxpool.Pool
	js     jetstream.JetStream
	cfg    Config
	log    *slog.Logger
	tracer trace.Tracer
	inbox  *dedupe.Inbox
	q      queries
	batch  BatchHandler // the in-transaction handler, nil for External

	attempts *attemptCounter
	// stopping is closed when Run's context ends: work held while the database is
	// down is handed back then.
	stopping <-chan struct{}
}

// New returns a consumer. It does not touch the broker until Run.
func New(pool *pgxpool.Pool, js jetstream.JetStream, cfg Config) (*Consumer, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if pool == nil || js == nil {
		return nil, fmt.Errorf("consumer %s: nil pool or JetStream", cfg.Name)
	}
	cfg = cfg.WithDefaults()
	inbox, err := dedupe.New(dedupe.Config{Schema: cfg.Schema})
	if err != nil {
		return nil, err
	}
	c := &Consumer{
		pool: pool, js: js, cfg: cfg, inbox: inbox, q: newQueries(cfg.Schema),
		log:    cfg.Logger.With("consumer", cfg.Name, "subject", cfg.Subject),
		tracer: cfg.TracerProvider.Tracer("github.com/idemkit/idem/consumer"),
	}
	c.attempts = &attemptCounter{pool: pool, consumer: cfg.Name, lifetime: cfg.KeyLifetime, q: c.q}
	switch {
	case cfg.BatchHandler != nil:
		c.batch = cfg.BatchHandler
	case cfg.Handler != nil:
		c.batch = singleAsBatch{cfg.Handler}
	}
	return c, nil
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
		// delivering would vanish without a trace. The consumer counts attempts
		// and dead-letters past MaxDeliver instead.
		MaxDeliver:    -1,
		MaxAckPending: c.cfg.MaxAckPending,
	}
}

// Run consumes until ctx is cancelled, then stops fetching, finishes the work
// already started (commit or complete, then ack) and returns nil. Messages received
// but not started are handed straight back to the broker.
func (c *Consumer) Run(ctx context.Context) error {
	c.stopping = ctx.Done()
	jc, err := c.js.CreateOrUpdateConsumer(ctx, c.cfg.Stream, c.JetStreamConfig())
	if err != nil {
		return fmt.Errorf("consumer %s: create durable consumer on stream %s: %w", c.cfg.Name, c.cfg.Stream, err)
	}
	// The queue holds about what the workers can start soon: BatchSize per worker,
	// and no more bytes than MaxBufferedBytes; the pulls ask for no more bytes
	// than that either.
	maxBuffered := c.cfg.MaxBufferedBytes
	if mp := c.js.Conn().MaxPayload(); maxBuffered < mp {
		maxBuffered = mp // a smaller pull could never fetch the biggest message
	}
	q := newQueue(c.cfg.BatchSize*c.cfg.Concurrency, maxBuffered)
	cc, err := jc.Consume(func(m jetstream.Msg) {
		if !q.push(ctx, m) {
			_ = m.Nak() // shutting down: hand it straight back for another worker
		}
	}, jetstream.PullMaxBytes(int(maxBuffered)),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			c.log.WarnContext(ctx, "consumer: pull error", "err", err)
		}))
	if err != nil {
		return fmt.Errorf("consumer %s: consume: %w", c.cfg.Name, err)
	}
	c.log.InfoContext(ctx, "consumer started", "stream", c.cfg.Stream, "external", c.cfg.External != nil,
		"batch_size", c.cfg.BatchSize, "concurrency", c.cfg.Concurrency)
	// Queued messages get heartbeats like those being worked on.
	stopBeat := every(ctx, c.cfg.AckWait/3, func() bool {
		q.each(func(m jetstream.Msg) { _ = m.InProgress() })
		return true
	})

	// Work in flight finishes on a context that survives ctx: a half-done batch
	// would only be redelivered (an effect cut off half-way performed again after
	// its lease expired), but finishing it is the graceful thing to do.
	work := context.WithoutCancel(ctx)
	var wg sync.WaitGroup
	for range c.cfg.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				batch, ok := q.take(ctx, c.cfg.BatchSize, c.cfg.MaxBatchBytes, c.cfg.Linger)
				if len(batch) > 0 {
					c.process(work, batch)
				}
				if !ok || ctx.Err() != nil {
					return
				}
			}
		}()
	}
	<-ctx.Done()
	cc.Stop()
	wg.Wait()
	stopBeat()
	// Messages queued but never started go back to the broker now rather than
	// after AckWait.
	for _, m := range q.drain() {
		_ = m.Nak()
	}
	c.log.InfoContext(ctx, "consumer stopped")
	return nil
}

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
		if target := d.Headers[idem.HeaderReplayFor]; target != "" && target != c.cfg.Name {
			c.ack(ctx, d)
			c.observe(OutcomeSkipped, 1, 0)
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
