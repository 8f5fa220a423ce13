package scenario

// Every call the benchmark makes into the library's constructors, its event
// outcomes, its fault points and the reference application, in one file: the
// scenarios describe what they want in the bench's own terms (consumerSpec,
// relaySpec, eventKind).

import (
	"context"
	"log/slog"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/app/refapp"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/outbox"
)

// runner is a component the scenario runs until it cancels its context.
type runner interface {
	Run(ctx context.Context) error
}

// eventKind is what the benchmark counts of a component's events.
type eventKind int

const (
	evOther     eventKind = iota
	evProcessed           // a consumer committed the effect
	evDuplicate           // a consumer's inbox folded a delivery of a key it had
	evFailed              // a handler or a publish failed; it is retried
	evPublished           // the relay published outbox rows
)

func consumerObserver(f func(eventKind, int)) idem.Observer {
	if f == nil {
		return nil
	}
	return func(e idem.Event) {
		k := evOther
		switch e.Outcome {
		case consumer.OutcomeProcessed:
			k = evProcessed
		case consumer.OutcomeDuplicate:
			k = evDuplicate
		case consumer.OutcomeFailed:
			k = evFailed
		}
		f(k, e.Count)
	}
}

func relayObserver(f func(eventKind, int)) idem.Observer {
	if f == nil {
		return nil
	}
	return func(e idem.Event) {
		k := evOther
		switch e.Outcome {
		case outbox.OutcomePublished:
			k = evPublished
		case outbox.OutcomeFailed:
			k = evFailed
		}
		f(k, e.Count)
	}
}

// consumerSpec is what a scenario asks of an idem consumer.
type consumerSpec struct {
	Name, Subject string
	Handler       consumer.BatchHandler
	// BatchSize, Concurrency and AckWait: zero leaves the library's default.
	BatchSize, Concurrency int
	AckWait                time.Duration
	// Partitions, when positive, runs one consumer per partition subject of
	// Subject (consumer.Partitioned).
	Partitions int
	Observe    func(eventKind, int)
}

func (s consumerSpec) config(log *slog.Logger) consumer.Config {
	return consumer.Config{
		Name:         s.Name,
		Stream:       refapp.StreamName,
		Subject:      s.Subject,
		BatchHandler: s.Handler,
		BatchSize:    s.BatchSize,
		Concurrency:  s.Concurrency,
		AckWait:      s.AckWait,
		Logger:       log,
		Observer:     consumerObserver(s.Observe),
	}
}

// chargeConsumer is the reference application's charge consumer, as the e2e
// scenarios run it.
func chargeConsumer(batchSize, concurrency int, ackWait time.Duration, observe func(eventKind, int)) consumerSpec {
	return consumerSpec{Name: refapp.ChargeConsumer, Subject: refapp.SubjectCharge, Handler: refapp.ChargeHandler{},
		BatchSize: batchSize, Concurrency: concurrency, AckWait: ackWait, Observe: observe}
}

// newConsumers builds the consumers of s: one, or one per partition.
func newConsumers(env *benchenv.Env, log *slog.Logger, s consumerSpec) ([]runner, error) {
	cfgs := []consumer.Config{s.config(log)}
	if s.Partitions > 0 {
		var err error
		if cfgs, err = consumer.Partitioned(cfgs[0], s.Partitions); err != nil {
			return nil, err
		}
	}
	var out []runner
	for _, cfg := range cfgs {
		c, err := consumer.New(env.Pool, env.JS, cfg)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

// newConsumer builds one consumer, and returns the settings it runs with (its
// defaults filled in) for the row's config.
func newConsumer(env *benchenv.Env, log *slog.Logger, s consumerSpec) (runner, map[string]any, error) {
	c, err := consumer.New(env.Pool, env.JS, s.config(log))
	if err != nil {
		return nil, nil, err
	}
	cfg := c.Config()
	return c, map[string]any{"batch_size": cfg.BatchSize, "concurrency": cfg.Concurrency,
		"max_ack_pending": cfg.MaxAckPending, "linger": cfg.Linger.String()}, nil
}

// relaySpec is what a scenario asks of the relay.
type relaySpec struct {
	BatchSize int
	// AwaitProof leaves proving each row complete to a reconciler, as the worker
	// runs the relay beside one.
	AwaitProof bool
	// AtomicPublish publishes each batch as one JetStream atomic batch.
	AtomicPublish bool
	// OrderedSubjects are published in order per subject.
	OrderedSubjects []string
	Observe         func(eventKind, int)
}

func newRelay(env *benchenv.Env, log *slog.Logger, s relaySpec) (runner, error) {
	return outbox.NewRelay(env.Pool, env.JS, outbox.RelayConfig{
		Stream:          refapp.StreamName,
		BatchSize:       s.BatchSize,
		AwaitProof:      s.AwaitProof,
		AtomicPublish:   s.AtomicPublish,
		OrderedSubjects: s.OrderedSubjects,
		Logger:          log,
		Observer:        relayObserver(s.Observe),
	})
}

// reconcileEvery is the reconciler's pass interval in the benchmark, shorter than
// its default: a timed phase lasts seconds, and with the default a pass would
// hardly run in it, leaving out a cost every intent pays.
const reconcileEvery = time.Second

func newReconciler(env *benchenv.Env, log *slog.Logger) (runner, error) {
	return reconcile.New(env.Pool, env.JS, reconcile.Config{Stream: refapp.StreamName, Interval: reconcileEvery, Logger: log})
}

// unproven counts the published intents the reconciler has not yet proven
// complete.
func unproven(ctx context.Context, env *benchenv.Env) (int64, error) {
	s, err := reconcile.ReadStatus(ctx, env.Pool, "")
	if err != nil {
		return 0, err
	}
	return int64(s.Unproven), nil
}

// afterCommit returns ctx with f run by every consumer started with it right
// after each batch's COMMIT returned and before its acks (the
// consumer.after-commit fault point), with the batch's keys. An error from f
// abandons the batch unacked.
func afterCommit(ctx context.Context, f func(ctx context.Context, keys []string) error) context.Context {
	return faults.With(ctx, faults.New().Func(faults.ConsumerAfterCommit, f))
}

// refApp is the reference application running on an environment.
type refApp interface {
	Addr() string
	Shutdown(ctx context.Context) error
}

// startRefApp runs the reference application as `go run ./cmd/worker` does: its
// ingress, relay, reconciler, consumers and collector.
func startRefApp(ctx context.Context, env *benchenv.Env, log *slog.Logger) (refApp, error) {
	return refapp.Start(ctx, env.Pool, env.NC, refapp.Config{HTTPAddr: "127.0.0.1:0", Logger: log,
		Reconcile: reconcile.Config{Interval: reconcileEvery}})
}
