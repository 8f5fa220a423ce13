package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/producer"
)

// headerReserve is what the ingress's default body limit leaves for the headers the
// relay puts on a message (the key twice, in Idempotency-Key and Nats-Msg-Id, the
// subject, the trace context): a body just under max_payload would otherwise be
// accepted and then refused by the outbox.
const headerReserve = 4 << 10

// streamCheckInterval is how often the worker checks that its stream exists, at
// most (see New).
const streamCheckInterval = 5 * time.Second

// component is one long-running part of the worker.
type component struct {
	name string
	run  func(ctx context.Context) error
}

// Worker runs idem's moving parts in one process; see the package documentation.
// Build it with New, then Start it; Stop it to shut down gracefully.
type Worker struct {
	pool *pgxpool.Pool
	nc   *nats.Conn
	js   jetstream.JetStream
	cfg  Config
	log  *slog.Logger

	metrics   *metrics
	outbox    *outbox.Outbox
	ingress   *producer.Middleware
	consumers []*consumer.Consumer
	relay     *outbox.Relay
	reconcile *reconcile.Reconciler
	keeper    *streamKeeper
	collector *collector

	mu        sync.Mutex
	started   bool
	lifetimes []Lifetime
	cancel    context.CancelFunc
	done      chan struct{}
	err       error
}

// New validates cfg and builds every component without touching the database or
// the broker. pool and nc are the caller's: the worker never closes them.
func New(pool *pgxpool.Pool, nc *nats.Conn, cfg Config) (*Worker, error) {
	if pool == nil || nc == nil {
		return nil, errors.New("worker: a pgx pool and a NATS connection are required")
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("worker: jetstream: %w", err)
	}
	w := &Worker{pool: pool, nc: nc, js: js, cfg: cfg, log: cfg.Logger, done: make(chan struct{})}
	w.metrics = newMetrics(w)
	observe := idem.Observers(w.metrics.observe, cfg.Observer)

	// What the broker can carry bounds what the outbox accepts, and so what the
	// ingress lets in: a request whose message could never be published is refused
	// with 413 before anything commits.
	maxPayload := nc.MaxPayload()
	if w.outbox, err = outbox.New(outbox.Config{Schema: cfg.Schema, Subjects: cfg.Stream.Subjects, MaxPayload: maxPayload,
		Stream: cfg.Stream.Name, TracerProvider: cfg.TracerProvider}); err != nil {
		return nil, fmt.Errorf("worker: %w", err)
	}
	budget := connectionBudget(pool, cfg)
	if budget.short != "" {
		w.log.Warn("worker: " + budget.short)
	}
	if cfg.Ingress != nil {
		ic := *cfg.Ingress
		ic.Schema = cfg.Schema
		ic.Outbox = w.outbox
		ic.Observer = idem.Observers(observe, ic.Observer)
		if ic.Logger == nil {
			ic.Logger = w.log
		}
		if ic.MaxBodyBytes == 0 {
			ic.MaxBodyBytes = min(producer.DefaultMaxBodyBytes, maxPayload-headerReserve)
		}
		if ic.MaxInFlight == 0 {
			ic.MaxInFlight = budget.ingress
		}
		if w.ingress, err = producer.NewMiddleware(pool, ic); err != nil {
			return nil, fmt.Errorf("worker: ingress: %w", err)
		}
	}
	for _, cc := range cfg.Consumers {
		cc.Stream = cfg.Stream.Name
		cc.Schema = cfg.Schema
		cc.Observer = idem.Observers(observe, cc.Observer)
		if cc.Logger == nil {
			cc.Logger = w.log
		}
		if cc.TracerProvider == nil {
			cc.TracerProvider = cfg.TracerProvider
		}
		c, err := consumer.New(pool, js, cc)
		if err != nil {
			return nil, fmt.Errorf("worker: %w", err)
		}
		w.consumers = append(w.consumers, c)
	}
	if !cfg.DisableRelay {
		rc := cfg.Relay
		rc.Schema, rc.Stream = cfg.Schema, cfg.Stream.Name
		// The ingress wakes this relay directly: no NOTIFY on its hot path.
		rc.Outbox = w.outbox
		if rc.TracerProvider == nil {
			rc.TracerProvider = cfg.TracerProvider
		}
		rc.Observer = idem.Observers(observe, rc.Observer)
		if rc.Logger == nil {
			rc.Logger = w.log
		}
		if !cfg.DisableReconciler {
			rc.AwaitProof = true
		}
		if w.relay, err = outbox.NewRelay(pool, js, rc); err != nil {
			return nil, fmt.Errorf("worker: %w", err)
		}
		if !cfg.DisableReconciler {
			rec := cfg.Reconcile
			rec.Schema, rec.Stream = cfg.Schema, cfg.Stream.Name
			rec.Observer = idem.Observers(observe, rec.Observer)
			if rec.Retention == 0 {
				rec.Retention = cfg.Relay.Retention
			}
			if rec.Logger == nil {
				rec.Logger = w.log
			}
			if w.reconcile, err = reconcile.New(pool, js, rec); err != nil {
				return nil, fmt.Errorf("worker: %w", err)
			}
		}
	}
	// The stream is checked as often as the most watchful consumer checks its
	// durable consumer, which it cannot recreate while the stream is missing.
	keeperEvery := streamCheckInterval
	for _, c := range w.consumers {
		keeperEvery = min(keeperEvery, c.Config().CheckInterval)
	}
	w.keeper = &streamKeeper{w: w, interval: keeperEvery}
	if !cfg.DisableRetention {
		ret := cfg.Retention
		for _, c := range w.consumers {
			ret.Partitions.KeyLifetime = max(ret.Partitions.KeyLifetime, c.Config().KeyLifetime)
		}
		w.collector = newCollector(pool, cfg.Schema, ret, w.log, observe)
	}
	return w, nil
}

// Start prepares the installation and starts every component in the background:
// it applies the migrations (with NoMigrate it only checks that they were applied,
// and fails naming the missing ones), then judges the lifetime invariant — against
// the configured MaxAge before it creates an absent stream, against the stream's
// real configuration when it exists, for every consumer registered in the
// installation and for the clients' re-send horizon — and refuses to start, naming
// the numbers, when a key could be forgotten while its intent can still arrive.
// Then it runs the consumers, the relay, the reconciler, the collector and the
// stream keeper, which judges the invariant again every few seconds, so that an
// edited stream or a newly registered consumer that breaks it makes the worker
// unready (see Ready).
//
// ctx bounds the start-up only; the components run until Stop (or until one of
// them fails, which stops the others: see Done and Err). Values ctx carries, such as
// a trace, reach the components.
func (w *Worker) Start(ctx context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.started {
		return errors.New("worker: already started")
	}
	mcfg := migrations.Config{Schema: w.cfg.Schema}
	if w.cfg.NoMigrate {
		if err := migrations.Check(ctx, w.pool, mcfg); err != nil {
			return fmt.Errorf("worker: started with NoMigrate: %w", err)
		}
	} else {
		applied, err := migrations.Apply(ctx, w.pool, mcfg)
		if err != nil {
			return fmt.Errorf("worker: %w", err)
		}
		if len(applied) > 0 {
			w.log.InfoContext(ctx, "schema migrated", "applied", applied)
		}
	}
	info, err := w.prepareStream(ctx)
	if err != nil {
		return err
	}
	filters := map[string]string{}
	for _, c := range w.consumers {
		filters[c.Config().Name] = c.Config().Subject
	}
	warnings, err := checkStream(info, w.cfg.Stream, filters, w.reconcile != nil)
	if err != nil {
		return fmt.Errorf("worker: refusing to start: %w", err)
	}
	for _, warning := range warnings {
		w.log.WarnContext(ctx, "worker: "+warning)
	}

	// Partitions first, so a partitioned inbox has today's and the days ahead
	// before the first claim; a failure only leaves rows to the default partition.
	if w.collector != nil {
		if err := w.collector.maintainPartitions(ctx); err != nil {
			w.log.WarnContext(ctx, "worker: partition maintenance at start failed; the collector retries", "err", err)
		}
	}

	var comps []component
	for _, c := range w.consumers {
		comps = append(comps, component{"consumer " + c.Config().Name, c.Run})
	}
	if w.relay != nil {
		comps = append(comps, component{"relay", w.relay.Run})
	}
	if w.reconcile != nil {
		comps = append(comps, component{"reconciler", w.reconcile.Run})
	}
	if w.collector != nil {
		comps = append(comps, component{"collector", w.collector.run})
	}
	comps = append(comps, component{"stream keeper", w.keeper.run}, component{"lag watch", w.metrics.lag.run})
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	w.cancel = cancel
	w.started = true
	var wg sync.WaitGroup
	for _, c := range comps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.run(runCtx); err != nil {
				w.fail(runCtx, fmt.Errorf("worker: %s: %w", c.name, err))
			}
		}()
	}
	go func() {
		wg.Wait()
		close(w.done)
	}()
	w.log.InfoContext(ctx, "worker started", "stream", w.cfg.Stream.Name, "consumers", len(w.consumers),
		"relay", w.relay != nil, "reconciler", w.reconcile != nil, "retention", w.collector != nil, "ingress", w.ingress != nil)
	return nil
}

// fail records the first component failure and stops the others: a worker missing
// a part is not a worker, and its supervisor should restart it.
func (w *Worker) fail(ctx context.Context, err error) {
	w.mu.Lock()
	if w.err == nil {
		w.err = err
	}
	cancel := w.cancel
	w.mu.Unlock()
	w.log.ErrorContext(ctx, "component failed; stopping the worker", "err", err)
	cancel()
}

// Stop stops fetching, lets work in flight finish (batches commit and ack, the
// relay marks its batch, effects complete) and returns when every component has
// returned, or with ctx's error when ctx ends first (unacked messages are simply
// redelivered later, so nothing is lost either way). It returns the first component
// failure, if there was one.
func (w *Worker) Stop(ctx context.Context) error {
	w.mu.Lock()
	started, cancel := w.started, w.cancel
	w.mu.Unlock()
	if !started {
		return nil
	}
	cancel()
	select {
	case <-w.done:
		return w.Err()
	case <-ctx.Done():
		return fmt.Errorf("worker: stop: %w", ctx.Err())
	}
}

// Done is closed once every component has returned: after Stop, or after a
// component failed (see Err). A service waits on it beside its signals.
func (w *Worker) Done() <-chan struct{} { return w.done }

// Err is the first component failure, or nil.
func (w *Worker) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// Ingress is the HTTP Idempotency-Key middleware built from Config.Ingress, or nil
// when none was configured. Wrap the service's state-changing routes with it. A
// route wrapped by a nil Ingress answers 500 ingress_not_configured (see
// producer.Middleware.Wrap).
func (w *Worker) Ingress() *producer.Middleware { return w.ingress }

// Outbox is the outbox the ingress enqueues into, bound to the stream's subjects;
// producers outside HTTP (a scheduled job, a gRPC handler) use it in their own
// transactions.
func (w *Worker) Outbox() *outbox.Outbox { return w.outbox }

// JetStream is the JetStream context the worker uses.
func (w *Worker) JetStream() jetstream.JetStream { return w.js }

// Consumers returns the configurations of the consumers, defaults filled in.
func (w *Worker) Consumers() []consumer.Config {
	out := make([]consumer.Config, len(w.consumers))
	for i, c := range w.consumers {
		out[i] = c.Config()
	}
	return out
}

// Lifetimes returns the windows the lifetime invariant last judged, one set per
// consumer of the stream in the installation (this worker's and those other
// processes registered) and one for the ingress, against the stream's MaxAge at
// that moment: at Start, then at each of the stream keeper's checks. Nil before
// Start.
func (w *Worker) Lifetimes() []Lifetime {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]Lifetime(nil), w.lifetimes...)
}
