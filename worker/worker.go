package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/internal/relay"
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
	inst *install.Installation
	pool *pgxpool.Pool
	js   jetstream.JetStream
	cfg  Config
	log  *slog.Logger

	metrics   *metrics
	outbox    *outbox.Outbox
	ingress   *producer.Middleware
	consumers []*consumer.Consumer
	relay     *relay.Relay    // the polling relay: alone, or beside the log relay
	logRelay  *relay.LogRelay // nil unless the log relay runs (chooseRelay)
	reconcile *reconcile.Reconciler
	keeper    *streamKeeper
	broker    *brokerWatch
	collector *collector

	mu        sync.Mutex
	started   bool
	lifetimes []Lifetime
	cancel    context.CancelFunc // the soft stop: stop taking work
	hardStop  context.CancelFunc // the hard stop: cancel the work in flight
	done      chan struct{}
	err       error
}

// New validates cfg and builds every component of inst's worker without touching
// the database or the broker. The worker's metrics observe every component beside
// the installation's own Observer.
func New(inst *install.Installation, cfg Config) (*Worker, error) {
	if inst.JetStream() == nil {
		return nil, errors.New("worker: the installation has no NATS connection")
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	w := &Worker{pool: inst.Pool(), js: inst.JetStream(), cfg: cfg, log: inst.Logger(), done: make(chan struct{})}
	w.metrics = newMetrics(w)
	inst = inst.Observing(w.metrics.observe)
	w.inst = inst
	// Every part shares the installation's outbox wake-ups: the ingress wakes this
	// worker's relay directly, no NOTIFY on its hot path.
	w.outbox = outbox.New(inst)

	budget := connectionBudget(w.pool, cfg)
	if budget.short != "" {
		w.log.Warn("worker: " + budget.short)
	}
	var err error
	if cfg.Ingress != nil {
		ic := *cfg.Ingress
		// What the broker can carry bounds what the outbox accepts, and so what
		// the ingress lets in: a request whose message could never be published is
		// refused with 413 before anything commits.
		// A connection still waiting for its first server (RetryOnFailedConnect)
		// knows no max_payload yet: the ingress keeps its default, the outbox then
		// checks nothing, and the relay dead-letters what the broker refuses.
		if mp := inst.JetStream().Conn().MaxPayload(); ic.MaxBodyBytes == 0 && mp > headerReserve {
			ic.MaxBodyBytes = min(producer.DefaultMaxBodyBytes, mp-headerReserve)
		}
		if ic.MaxInFlight == 0 {
			ic.MaxInFlight = budget.ingress
		}
		if w.ingress, err = producer.NewMiddleware(inst, ic); err != nil {
			return nil, fmt.Errorf("worker: ingress: %w", err)
		}
	}
	for _, cc := range cfg.Consumers {
		c, err := consumer.New(inst, cc)
		if err != nil {
			return nil, fmt.Errorf("worker: %w", err)
		}
		w.consumers = append(w.consumers, c)
	}
	if !cfg.DisableRelay {
		if w.relay, err = relay.New(parts.Of(inst), cfg.Relay.config(cfg)); err != nil {
			return nil, fmt.Errorf("worker: %w", err)
		}
		if !cfg.DisableReconciler {
			if w.reconcile, err = reconcile.New(parts.Of(inst), cfg.Reconcile.config(cfg)); err != nil {
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
	w.broker = newBrokerWatch(inst.JetStream().Conn(), w.log)
	if !cfg.DisableRetention {
		var keyLifetime time.Duration
		for _, c := range w.consumers {
			keyLifetime = max(keyLifetime, c.Config().KeyLifetime)
		}
		w.collector = newCollector(inst, cfg.Retention, keyLifetime)
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
// them fails, which stops the others: see Done and Err). The NATS connection is
// watched as one of them: its disconnects and reconnects are logged, and a
// connection that closes for good (nats.go gave up reconnecting: connect with
// nats.MaxReconnects(-1) to keep it trying) ends the worker, since a closed
// connection never comes back. Values ctx carries, such as a trace, reach the
// components.
func (w *Worker) Start(ctx context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.started {
		return errors.New("worker: already started")
	}
	mcfg := migrations.Config{Schema: w.inst.Schema()}
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
	if err := w.chooseRelay(ctx); err != nil {
		return err
	}
	filters := map[string]string{}
	for _, c := range w.consumers {
		filters[c.Config().Name] = c.Config().Subject
	}
	warnings, err := checkStream(info, w.inst.Stream(), filters, w.reconcile != nil)
	if err != nil {
		return fmt.Errorf("worker: refusing to start: %w", err)
	}
	for _, warning := range warnings {
		w.log.WarnContext(ctx, "worker: "+warning)
	}

	// Every consumer registers before any runs: one that settled messages would
	// make a sibling registering after it look renamed from it.
	for _, c := range w.consumers {
		if err := c.Register(ctx); err != nil {
			return fmt.Errorf("worker: consumer %s: %w", c.Config().Name, err)
		}
	}

	// Partitions first, so a partitioned inbox has today's and the days ahead
	// before the first claim; a failure only leaves rows to the default partition.
	if w.collector != nil {
		if err := w.collector.maintainPartitions(ctx); err != nil {
			w.log.WarnContext(ctx, "worker: partition maintenance at start failed; the collector retries", "err", err)
		}
	}

	// Work in flight runs on a context that outlives the soft stop (a batch
	// commits and acks, an effect completes, the relay marks its batch) and ends
	// only at the hard stop; the components stop taking work when runCtx ends.
	workCtx, hardStop := context.WithCancel(context.WithoutCancel(ctx))
	runCtx, cancel := context.WithCancel(workCtx)
	var comps []component
	for _, c := range w.consumers {
		comps = append(comps, component{"consumer " + c.Config().Name, func(ctx context.Context) error { return c.RunWork(ctx, workCtx) }})
	}
	if w.relay != nil {
		comps = append(comps, component{"relay", func(ctx context.Context) error { return w.relay.RunWork(ctx, workCtx) }})
	}
	if w.logRelay != nil {
		comps = append(comps, component{"log relay", func(ctx context.Context) error {
			defer parts.Of(w.inst).Waker.ByLog(false) // the Outboxes of this process wake relays again
			return w.logRelay.RunWork(ctx, workCtx)
		}})
	}
	if w.reconcile != nil {
		comps = append(comps, component{"reconciler", w.reconcile.Run})
	}
	if w.collector != nil {
		comps = append(comps, component{"collector", w.collector.run})
	}
	comps = append(comps, component{"stream keeper", w.keeper.run}, component{"lag watch", w.metrics.lag.run},
		component{"nats", w.broker.run})
	w.cancel, w.hardStop = cancel, hardStop
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
		hardStop()
		close(w.done)
	}()
	w.log.InfoContext(ctx, "worker started", "stream", w.inst.Stream().Name, "consumers", len(w.consumers),
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

// Stop shuts the worker down in two steps. The soft stop comes first: it stops
// fetching and lets the work in flight finish (batches commit and ack, the relay
// marks its batch, effects complete). If ctx ends before that work is done, the
// hard stop follows: the handlers' contexts are cancelled, so an in-transaction
// batch rolls back and an external effect is abandoned, and their messages are
// redelivered later, as after a crash; nothing is lost. An external effect whose
// Perform returns success after its context was cancelled is still recorded: Stop
// waits for that record as long as its lease holds (a short grace if it has
// ended), so an effect that happened is not performed again by a takeover. Either way Stop returns
// only once every goroutine of the worker has returned — after a hard stop, with
// ctx's error. Otherwise it returns the first component failure, if there was one.
//
// A handler that ignores its context's cancellation holds the hard stop up until
// it returns.
func (w *Worker) Stop(ctx context.Context) error {
	w.mu.Lock()
	started, cancel, hardStop := w.started, w.cancel, w.hardStop
	w.mu.Unlock()
	if !started {
		return nil
	}
	cancel()
	select {
	case <-w.done:
		return w.Err()
	case <-ctx.Done():
	}
	w.log.WarnContext(ctx, "worker: work in flight did not finish in time; cancelling it (its messages are redelivered)")
	hardStop()
	<-w.done
	return fmt.Errorf("worker: stop: work in flight cancelled: %w", ctx.Err())
}

// Done is closed once every component has returned: after Stop, or after a
// component failed or the NATS connection closed for good (see Err). A service
// waits on it beside its signals, and exits when it closes.
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
// transactions. Its Wake reaches this worker's relay directly.
func (w *Worker) Outbox() *outbox.Outbox { return w.outbox }

// Installation is the worker's installation, observed by its metrics.
func (w *Worker) Installation() *install.Installation { return w.inst }

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
