package scenario

// Every call the benchmark makes into the library's constructors, its event
// outcomes, its fault points and the reference application, in one file: the
// scenarios describe what they want in the bench's own terms (consumerSpec,
// relaySpec, eventKind).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/reconcile"
	idemrelay "github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/worker"
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

// observed is env's installation telling f the events of component, or the
// installation itself when f is nil. Observers belong to an installation: a
// component built on the copy reports to f, the others (on env.Inst) do not.
func observed(env *benchenv.Env, component string, f func(eventKind, int)) *install.Installation {
	if f == nil {
		return env.Inst
	}
	return env.Inst.Observing(func(e idem.Event) {
		if e.Component != component {
			return
		}
		k := evOther
		switch e.Outcome {
		case idem.OutcomeProcessed:
			k = evProcessed
		case idem.OutcomeDuplicate:
			k = evDuplicate
		case idem.OutcomeFailed:
			k = evFailed
		case idem.OutcomePublished:
			k = evPublished
		}
		f(k, e.Count)
	})
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

func (s consumerSpec) config() consumer.Config {
	return consumer.Config{
		Name:         s.Name,
		Subject:      s.Subject,
		BatchHandler: s.Handler,
		BatchSize:    s.BatchSize,
		Concurrency:  s.Concurrency,
		AckWait:      s.AckWait,
	}
}

// chargeConsumer is the reference application's charge consumer, as the e2e
// scenarios run it.
func chargeConsumer(batchSize, concurrency int, ackWait time.Duration, observe func(eventKind, int)) consumerSpec {
	return consumerSpec{Name: refapp.ChargeConsumer, Subject: refapp.SubjectCharge, Handler: refapp.ChargeHandler{},
		BatchSize: batchSize, Concurrency: concurrency, AckWait: ackWait, Observe: observe}
}

// newConsumers builds the consumers of s: one, or one per partition.
func newConsumers(env *benchenv.Env, s consumerSpec) ([]runner, error) {
	cfgs := []consumer.Config{s.config()}
	if s.Partitions > 0 {
		var err error
		if cfgs, err = consumer.Partitioned(cfgs[0], s.Partitions); err != nil {
			return nil, err
		}
	}
	inst := observed(env, idem.ComponentConsumer, s.Observe)
	var out []runner
	for _, cfg := range cfgs {
		c, err := consumer.New(inst, cfg)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

// newConsumer builds one consumer, and returns the settings it runs with (its
// defaults filled in) for the row's config. The consumer does not wait for a
// fuller batch, so the row's "linger" is 0s.
func newConsumer(env *benchenv.Env, s consumerSpec) (runner, map[string]any, error) {
	c, err := consumer.New(observed(env, idem.ComponentConsumer, s.Observe), s.config())
	if err != nil {
		return nil, nil, err
	}
	cfg := c.Config()
	return c, map[string]any{"batch_size": cfg.BatchSize, "concurrency": cfg.Concurrency,
		"max_ack_pending": c.JetStreamConfig().MaxAckPending, "linger": time.Duration(0).String()}, nil
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
	// Mode is the relay Options.Relay asks for ("" for the worker's choice);
	// atomic publish and ordered subjects always take the polling relay.
	Mode string
}

// newRelay builds the relay of env's installation the spec asks for: the
// polling relay, woken by env.Outbox's commits; or the log relay, with the
// polling relay beside it for the rows it hands over, its slot made and the
// outbox's new rows its own before newRelay returns.
func newRelay(ctx context.Context, env *benchenv.Env, s relaySpec) (runner, idemrelay.Mode, error) {
	cfg := idemrelay.Config{BatchSize: s.BatchSize, AwaitProof: s.AwaitProof, AtomicPublish: s.AtomicPublish, OrderedSubjects: s.OrderedSubjects}
	inst := observed(env, idem.ComponentRelay, s.Observe)
	mode, err := relayMode(ctx, env, s)
	if err != nil || mode == idemrelay.ModePoll {
		r, nerr := idemrelay.New(parts.Of(inst), cfg)
		return r, idemrelay.ModePoll, errors.Join(err, nerr)
	}
	behind := cfg
	behind.BehindLog = true
	poll, err := idemrelay.New(parts.Of(inst), behind)
	if err != nil {
		return nil, "", err
	}
	// A first log relay makes the slot and takes the outbox's new rows; the one
	// the scenario runs reads them from the slot.
	first, err := idemrelay.NewLog(parts.Of(inst), cfg, nil)
	if err != nil {
		return nil, "", err
	}
	if err := readOnce(ctx, first); err != nil {
		return nil, "", err
	}
	log, err := idemrelay.NewLog(parts.Of(inst), cfg, poll.Wake)
	if err != nil {
		return nil, "", err
	}
	return both{poll, log}, idemrelay.ModeLog, nil
}

// relayMode is the relay s gets on env's server.
func relayMode(ctx context.Context, env *benchenv.Env, s relaySpec) (idemrelay.Mode, error) {
	if s.AtomicPublish || len(s.OrderedSubjects) > 0 || s.Mode == "poll" {
		return idemrelay.ModePoll, nil
	}
	c, err := idemrelay.LogCapability(ctx, env.Pool, env.Inst.Schema())
	if err != nil {
		return "", err
	}
	if c.Mode == idemrelay.ModePoll && s.Mode == "log" {
		return "", fmt.Errorf("-relay log: %s", c.Why)
	}
	return c.Mode, nil
}

// readOnce runs l until it reads its slot, then stops it.
func readOnce(ctx context.Context, l *idemrelay.LogRelay) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	for !l.Reading() {
		select {
		case err := <-done:
			return fmt.Errorf("log relay: ended before it read its slot: %v", err)
		case <-ctx.Done():
			return fmt.Errorf("log relay: did not read its slot within 30s")
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	return <-done
}

// both runs several runners until the first fails or ctx ends.
type both []runner

func (b both) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, len(b))
	for _, r := range b {
		go func() { errs <- r.Run(ctx) }()
	}
	var first error
	for range b {
		if err := <-errs; err != nil && first == nil {
			first = err
			cancel()
		}
	}
	return first
}

// reconcileEvery is the reconciler's pass interval in the benchmark, shorter than
// its default: a timed phase lasts seconds, and with the default a pass would
// hardly run in it, leaving out a cost every intent pays.
const reconcileEvery = time.Second

func newReconciler(env *benchenv.Env) (runner, error) {
	return reconcile.New(parts.Of(env.Inst), reconcile.Config{Interval: reconcileEvery})
}

// unproven counts the published intents the reconciler has not yet proven
// complete.
func unproven(ctx context.Context, env *benchenv.Env) (int64, error) {
	s, err := reconcile.ReadStatus(ctx, env.Pool, env.Inst.Schema())
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
// ingress, relay, reconciler, consumers and collector. The worker does not let
// its reconciler's pass interval be tuned, so a second reconciler of the same
// installation runs beside it with a pass every reconcileEvery (reconcilers
// share the rows, each claimed by one pass): as two workers would run it.
func startRefApp(ctx context.Context, env *benchenv.Env, relayMode string, log *slog.Logger) (refApp, error) {
	rec, err := newReconciler(env)
	if err != nil {
		return nil, err
	}
	svc, err := refapp.Start(ctx, env.Pool, env.NC, refapp.Config{HTTPAddr: "127.0.0.1:0", Logger: log, Relay: worker.RelayConfig{Mode: relayMode}})
	if err != nil {
		return nil, err
	}
	if relayMode != "poll" {
		awaitLogRelay(ctx, env, 15*time.Second)
	}
	recCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	recDone := make(chan error, 1)
	go func() { recDone <- rec.Run(recCtx) }()
	return &refAppReconciled{refApp: svc, stop: stop, done: recDone}, nil
}

// awaitLogRelay waits, at most limit, until a log relay reads the database's slot,
// if the worker runs one. A fresh installation's first log relay takes the outbox
// over once in the database's life (a slot made, the outbox's default changed,
// rows written meanwhile published by the polling relay); every phase starts on a
// fresh database, and the timed phase measures the steady state after it.
func awaitLogRelay(ctx context.Context, env *benchenv.Env, limit time.Duration) {
	for deadline := time.Now().Add(limit); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var reading bool
		err := env.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE database = current_database() AND active)
			AND EXISTS (SELECT 1 FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
			            WHERE d.adrelid = 'idem_outbox'::regclass AND a.attname = 'relay')`).Scan(&reading)
		if err != nil || reading || ctx.Err() != nil {
			return
		}
	}
}

// refAppReconciled is the reference application and the benchmark's reconciler
// beside it; Shutdown stops both.
type refAppReconciled struct {
	refApp
	stop context.CancelFunc
	done chan error
}

func (a *refAppReconciled) Shutdown(ctx context.Context) error {
	err := a.refApp.Shutdown(ctx)
	a.stop()
	return errors.Join(err, <-a.done)
}
