package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/internal/app/refapp"
)

// Table rows of the e2e scenario.
const (
	rowE2EMax      = "e2e (max)"
	rowE2ERatePref = "e2e @"
)

// PipelineConfig configures one run of the whole pipeline: producers writing
// payments and outbox rows in one transaction per batch, the relay, JetStream and
// the idem consumer writing the ledger.
type PipelineConfig struct {
	Scenario string
	N        int
	// PayloadBytes sizes each message's payload (0: a small charge).
	PayloadBytes int
	// EnqueueBatch is how many intents one producer transaction writes.
	EnqueueBatch int
	// Producers is how many producer goroutines run (unthrottled when Rate is 0).
	Producers int
	// Rate, when positive, is the offered load in intents/s: one producer starts a
	// transaction every EnqueueBatch/Rate seconds on a fixed schedule.
	Rate int
	// RelayBatch, BatchSize and Concurrency tune the relay and the consumer.
	RelayBatch  int
	BatchSize   int
	Concurrency int
	// Duplicate enqueues every intent twice, the second copy with a Nats-Msg-Id of
	// its own (Outbox.Republish) so the broker cannot fold it: only the inbox can.
	Duplicate bool
	// DropFraction of committed batches have their acks dropped (the
	// consumer.after-commit fault point fails), so they are redelivered after
	// AckWait.
	DropFraction float64
	AckWait      time.Duration
	// Reconcile runs a reconciler beside the relay, which then awaits proof
	// (outbox.RelayConfig.AwaitProof), as the worker does.
	Reconcile bool
	// AtomicPublish makes the relay publish each batch as one JetStream atomic
	// batch (outbox.RelayConfig.AtomicPublish).
	AtomicPublish bool
	Timeout       time.Duration
	Log           *slog.Logger
}

// pipelineRun is what one pipeline run measured.
type pipelineRun struct {
	meas Measurement
	// effects is when the last intent's effect committed, from the start.
	effects time.Duration
	// produced is when the last producer transaction committed.
	produced time.Duration
	// drained is when every message was published and acked.
	drained time.Duration
	// latencies, sorted: producer COMMIT issued -> consumer COMMIT returned.
	latencies []time.Duration
	// p99Halves is the p99 latency of the first and of the second half of the intents.
	p99Halves  [2]time.Duration
	ledger     Ledger
	processed  int64
	duplicates int64
	dropped    int64
	// proven is when the reconciler had proven every intent complete (Reconcile).
	proven time.Duration
}

var errDropAcks = errors.New("bench: acks of this batch dropped on purpose")

// dupGeneration is the Msg-Id generation of e2e-dup's copies: the copy of an intent
// is published as idem.MsgID(subject, key) + " copy", which the broker does not fold
// into the original.
const dupGeneration = "copy"

// runPipeline runs cfg.N intents through the pipeline in env.
func runPipeline(ctx context.Context, env *Env, cfg PipelineConfig) (pipelineRun, error) {
	var out pipelineRun
	intents := makeIntents(cfg.N, cfg.PayloadBytes)
	index := indexByKey(intents)
	messages := cfg.N
	if cfg.Duplicate {
		messages = 2 * cfg.N
	}
	// Times are nanoseconds since base on the monotonic clock: producer and consumer
	// are in this process, so one clock times both ends.
	var baseP atomic.Pointer[time.Time] // set once, before the first intent is produced
	since := func() int64 { return int64(time.Since(*baseP.Load())) }
	enqueued := make([]atomic.Int64, cfg.N)
	committed := make([]atomic.Int64, cfg.N)
	effects := newCounter(cfg.N)
	var processed, duplicates, dropped, badKey atomic.Int64

	c, err := consumer.New(env.Pool, env.JS, consumer.Config{
		Name:         refapp.ChargeConsumer,
		Stream:       refapp.StreamName,
		Subject:      refapp.SubjectCharge,
		BatchHandler: refapp.ChargeHandler{},
		BatchSize:    cfg.BatchSize,
		Concurrency:  cfg.Concurrency,
		AckWait:      cfg.AckWait,
		Logger:       cfg.Log,
		Observer: func(e idem.Event) {
			switch e.Outcome {
			case idem.OutcomeProcessed:
				processed.Add(int64(e.Count))
			case idem.OutcomeDuplicate:
				duplicates.Add(int64(e.Count))
			}
		},
	})
	if err != nil {
		return out, fmt.Errorf("consumer: %w", err)
	}
	// The consumer.after-commit fault point runs right after each batch's COMMIT
	// returned and before its acks: the moment the effects became durable. A
	// delivery's key may have committed in an earlier batch (a duplicate); only the
	// first commit of a key counts. Returning an error abandons the batch unacked.
	afterCommit := func(_ context.Context, keys []string) error {
		now := since()
		for _, k := range keys {
			seq, ok := index[k]
			if !ok {
				badKey.Add(1)
				continue
			}
			if committed[seq].CompareAndSwap(0, now) {
				effects.Add(1)
			}
		}
		if cfg.DropFraction > 0 && rand.Float64() < cfg.DropFraction {
			dropped.Add(1)
			return errDropAcks
		}
		return nil
	}
	published := newCounter(messages)
	relay, err := outbox.NewRelay(env.Pool, env.JS, outbox.RelayConfig{
		Stream:     refapp.StreamName,
		BatchSize:  cfg.RelayBatch,
		AwaitProof: cfg.Reconcile,
		Logger:     cfg.Log,
		Observer:   relayObserver(published, nil),

		AtomicPublish: cfg.AtomicPublish,
	})
	if err != nil {
		return out, fmt.Errorf("relay: %w", err)
	}
	var rec *reconcile.Reconciler
	if cfg.Reconcile {
		// A pass every second, not the default 30s: in a run of seconds the
		// default would hardly run, and its cost would not be measured.
		if rec, err = reconcile.New(env.Pool, env.JS, reconcile.Config{Stream: refapp.StreamName, Interval: time.Second, Logger: cfg.Log}); err != nil {
			return out, fmt.Errorf("reconciler: %w", err)
		}
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	consumerCtx := faults.With(runCtx, faults.New().Func(faults.ConsumerAfterCommit, afterCommit))
	var wg sync.WaitGroup
	errs := make(chan error, 3+cfg.Producers)
	wg.Add(2)
	go func() { defer wg.Done(); errs <- c.Run(consumerCtx) }()
	go func() { defer wg.Done(); errs <- relay.Run(runCtx) }()
	if rec != nil {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- rec.Run(runCtx) }()
	}
	stopAll := func() {
		cancel()
		wg.Wait()
	}
	// Let the relay's LISTEN connection and the durable consumer come up, so the
	// first batches are not left to the relay's 1 s poll.
	time.Sleep(300 * time.Millisecond)
	go progress(runCtx, cfg.Scenario, "effects committed", cfg.N, effects.Load)

	meter, err := env.StartMeter(ctx)
	if err != nil {
		stopAll()
		return out, err
	}
	base := time.Now()
	baseP.Store(&base)

	// produce writes intents [lo, hi) as payments and outbox rows in one transaction.
	produce := func(lo, hi int) error {
		keys := make([]string, 0, hi-lo)
		accounts := make([]string, 0, hi-lo)
		amounts := make([]int64, 0, hi-lo)
		msgs := make([]idem.Message, 0, hi-lo)
		for i := lo; i < hi; i++ {
			in := intents[i]
			keys, accounts, amounts = append(keys, in.Key), append(accounts, in.Account), append(amounts, in.Amount)
			msgs = append(msgs, in.message())
		}
		return pgx.BeginFunc(runCtx, env.Pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(runCtx, `INSERT INTO payments (idempotency_key, account, amount_cents)
				SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])`, keys, accounts, amounts)
			if err != nil {
				return fmt.Errorf("insert payments: %w", err)
			}
			if err := env.Outbox.Enqueue(runCtx, tx, msgs...); err != nil {
				return err
			}
			if cfg.Duplicate {
				// The copies follow the originals, so with batches of the same size
				// they mostly land in another consumer batch and are folded by the
				// inbox claim, not inside one batch. Enqueue refuses a caller's own
				// Msg-Id; Republish gives the copies a Msg-Id generation of their own,
				// in one statement.
				if err := env.Outbox.Republish(runCtx, tx, dupGeneration, "", msgs...); err != nil {
					return err
				}
			}
			now := since()
			for i := lo; i < hi; i++ {
				enqueued[i].Store(now)
			}
			return nil // BeginFunc commits
		})
	}

	var producers sync.WaitGroup
	var lastProduced atomic.Int64
	var nextBatch atomic.Int64
	nProducers := cfg.Producers
	if cfg.Rate > 0 {
		nProducers = 1
	}
	interval := time.Duration(float64(cfg.EnqueueBatch) / float64(max(cfg.Rate, 1)) * float64(time.Second))
	for range nProducers {
		producers.Add(1)
		go func() {
			defer producers.Done()
			for {
				b := int(nextBatch.Add(1) - 1)
				lo := b * cfg.EnqueueBatch
				if lo >= cfg.N {
					return
				}
				if cfg.Rate > 0 {
					// Open loop: batch b is due at base + b*interval, whatever the
					// previous one cost.
					if d := time.Until(base.Add(time.Duration(b) * interval)); d > 0 {
						select {
						case <-time.After(d):
						case <-runCtx.Done():
							return
						}
					}
				}
				if err := produce(lo, min(lo+cfg.EnqueueBatch, cfg.N)); err != nil {
					if runCtx.Err() == nil {
						errs <- fmt.Errorf("producer: %w", err)
					}
					return
				}
				lastProduced.Store(since())
			}
		}()
	}

	// Until every effect committed, anything on errs is a failure: a producer error,
	// or the consumer or relay returning before it was asked to.
	var waitErr error
	select {
	case <-effects.done:
	case err := <-errs:
		waitErr = fmt.Errorf("pipeline stopped early (%d of %d effects committed): %v", effects.Load(), cfg.N, err)
	case <-ctx.Done():
		waitErr = ctx.Err()
	case <-time.After(cfg.Timeout):
		waitErr = fmt.Errorf("timed out after %s: %d of %d effects committed", cfg.Timeout, effects.Load(), cfg.N)
	}
	meas, merr := meter.Stop(ctx)
	if err := errors.Join(waitErr, merr); err != nil {
		stopAll() // cancels the producers too
		producers.Wait()
		return out, err
	}
	producers.Wait() // all effects committed: every producer has returned or is about to
	out.meas = meas
	out.produced = time.Duration(lastProduced.Load())

	// Drain: every message published and acked (the dropped batches come back after
	// AckWait and are folded as duplicates).
	if err := published.wait(ctx, cfg.Timeout, "published"); err != nil {
		stopAll()
		return out, err
	}
	if _, err := waitDrained(ctx, env, refapp.ChargeConsumer, cfg.Timeout); err != nil {
		stopAll()
		return out, err
	}
	out.drained = time.Since(base)
	if rec != nil {
		if err := waitProven(ctx, env, cfg.Timeout); err != nil {
			stopAll()
			return out, err
		}
		out.proven = time.Since(base)
	}
	stopAll()
	close(errs)
	for err := range errs {
		if err != nil {
			return out, err
		}
	}
	if n := badKey.Load(); n > 0 {
		return out, fmt.Errorf("%d deliveries with a key the benchmark never enqueued", n)
	}

	out.latencies = make([]time.Duration, cfg.N)
	for i := range cfg.N {
		c, e := committed[i].Load(), enqueued[i].Load()
		out.latencies[i] = time.Duration(c - e)
		out.effects = max(out.effects, time.Duration(c))
	}
	// Intents are produced in index order: the halves are the first and the second
	// half of the run, which shows latency that grows as the tables grow.
	half := cfg.N / 2
	first, second := slices.Clone(out.latencies[:half]), slices.Clone(out.latencies[half:])
	slices.Sort(first)
	slices.Sort(second)
	out.p99Halves = [2]time.Duration{percentile(first, 99), percentile(second, 99)}
	slices.Sort(out.latencies)
	out.processed, out.duplicates, out.dropped = processed.Load(), duplicates.Load(), dropped.Load()

	if out.ledger, err = verifyExactlyOnce(ctx, env, cfg.N); err != nil {
		return out, err
	}
	var payments, unpublished int
	err = env.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM payments), (SELECT count(*) FROM idem_outbox WHERE published_at IS NULL)`).Scan(&payments, &unpublished)
	if err != nil {
		return out, fmt.Errorf("verify: %w", err)
	}
	if payments != cfg.N || unpublished != 0 {
		return out, fmt.Errorf("VERIFY FAILED: %d payments (want %d), %d outbox rows unpublished", payments, cfg.N, unpublished)
	}
	return out, nil
}

// E2EConfig configures the e2e and e2e-dup scenarios.
type E2EConfig struct {
	Pipeline PipelineConfig
	// MaxProducers is the producer count of the max-throughput phase.
	MaxProducers int
	// Rate and RateBatch shape the latency phase.
	Rate      int
	RateBatch int
	// DurabilityBatch is e2e-durability's intents per transaction (1: one intent
	// per request, the shape users run).
	DurabilityBatch int
}

func pipelineConfigMap(p PipelineConfig) map[string]any {
	return map[string]any{
		"enqueue_batch": p.EnqueueBatch, "producers": p.Producers, "rate": p.Rate,
		"relay_batch": p.RelayBatch, "consumer_batch": p.BatchSize, "consumer_concurrency": p.Concurrency,
		"duplicate": p.Duplicate, "drop_fraction": p.DropFraction, "ack_wait": p.AckWait.String(),
	}
}

// runE2E runs the pipeline twice, each time on a fresh environment: unthrottled
// (max sustained intents/s) and at a fixed offered load (latency).
func runE2E(ctx context.Context, newEnv envFactory, cfg E2EConfig) ([]Result, error) {
	var results []Result

	maxCfg := cfg.Pipeline
	maxCfg.Scenario, maxCfg.Producers, maxCfg.Rate = scE2E+"/max", cfg.MaxProducers, 0
	run, err := withEnv(ctx, labelled(newEnv, scE2E+"-max"), func(env *Env) (pipelineRun, error) { return runPipeline(ctx, env, maxCfg) })
	if err != nil {
		return nil, fmt.Errorf("%s (max): %w", scE2E, err)
	}
	r := Result{Scenario: scE2E, Row: rowE2EMax, N: maxCfg.N, Messages: maxCfg.N, Config: pipelineConfigMap(maxCfg)}
	r.setMeasurement(run.meas, maxCfg.N)
	r.Seconds, r.Rate = run.effects.Seconds(), float64(maxCfg.N)/run.effects.Seconds()
	r.Ledger, r.Verified = &run.ledger, "ok"
	r.Notes = append(r.Notes,
		fmt.Sprintf("producers finished after %.2fs (%.0f intents/s offered); last effect at %.2fs",
			run.produced.Seconds(), float64(maxCfg.N)/run.produced.Seconds(), run.effects.Seconds()),
		fmt.Sprintf("latency under saturation (queueing included): p50 %.0f ms, p99 %.0f ms",
			ms(percentile(run.latencies, 50)), ms(percentile(run.latencies, 99))))
	results = append(results, r)

	rateCfg := cfg.Pipeline
	rateCfg.Scenario, rateCfg.Producers, rateCfg.Rate, rateCfg.EnqueueBatch = scE2E+"/rate", 1, cfg.Rate, cfg.RateBatch
	run, err = withEnv(ctx, labelled(newEnv, scE2E+"-rate"), func(env *Env) (pipelineRun, error) { return runPipeline(ctx, env, rateCfg) })
	if err != nil {
		return nil, fmt.Errorf("%s (rate): %w", scE2E, err)
	}
	r = Result{Scenario: scE2E, Row: fmt.Sprintf("%s%d/s", rowE2ERatePref, rateCfg.Rate), N: rateCfg.N, Messages: rateCfg.N, Config: pipelineConfigMap(rateCfg)}
	r.setMeasurement(run.meas, rateCfg.N)
	// The rate of this row is the load actually offered; it can only fall short of
	// the target if a producer transaction took longer than its slot.
	r.Rate = float64(rateCfg.N) / run.produced.Seconds()
	r.P50ms, r.P99ms = ms(percentile(run.latencies, 50)), ms(percentile(run.latencies, 99))
	r.MaxMs = ms(run.latencies[len(run.latencies)-1])
	r.Ledger, r.Verified = &run.ledger, "ok"
	r.Notes = append(r.Notes, fmt.Sprintf("offered %.0f intents/s in transactions of %d; latency = producer COMMIT issued -> consumer COMMIT returned; max %.1f ms; p99 of the first half %.1f ms, of the second half %.1f ms",
		r.Rate, rateCfg.EnqueueBatch, r.MaxMs, ms(run.p99Halves[0]), ms(run.p99Halves[1])))
	results = append(results, r)
	return results, nil
}

// Rows of the e2e-durability scenario.
const (
	rowFsyncAlways     = "e2e, fsync always"
	rowFsyncReconciled = "e2e, fsync always + reconciler"
	rowReconciled      = "e2e, default fsync + reconciler"
	rowFsyncAtomic     = "e2e, fsync always, atomic batch publish"
	// rowUnproven is no shipped setting: a broker crash can lose writes it already
	// acknowledged, and nothing re-drives them. It is there to price the
	// reconciler's proof at the default fsync.
	rowUnproven = "e2e, default fsync, no reconciler (not shipped: loses what a broker crash loses)"
)

// durabilityProducers is how many producers e2e-durability runs, each committing
// one intent per transaction: the shape of one intent per HTTP request, with that
// many requests in flight.
const durabilityProducers = 16

// runE2EDurability measures the two ways to make a published intent survive the
// broker: JetStream fsyncing every write, or JetStream at its default sync interval
// with the reconciler proving every intent settled (and re-driving what a crash
// lost). Both rows are the unthrottled pipeline with one intent per producer
// transaction, each on a fresh environment.
func runE2EDurability(ctx context.Context, newEnv func(syncAlways bool) envFactory, cfg E2EConfig) ([]Result, error) {
	var results []Result
	for _, v := range []struct {
		row        string
		syncAlways bool
		reconcile  bool
		atomic     bool
	}{{rowFsyncAlways, true, false, false}, {rowFsyncAtomic, true, false, true}, {rowFsyncReconciled, true, true, false},
		{rowReconciled, false, true, false}, {rowUnproven, false, false, false}} {
		p := cfg.Pipeline
		p.Scenario, p.Producers, p.EnqueueBatch, p.Rate, p.Reconcile = v.row, durabilityProducers, cfg.DurabilityBatch, 0, v.reconcile
		p.AtomicPublish = v.atomic
		if p.EnqueueBatch > 1 {
			// Not the shape users run: an extra, labelled row.
			v.row += fmt.Sprintf(" (%d intents per transaction)", p.EnqueueBatch)
		}
		run, err := withEnv(ctx, labelled(newEnv(v.syncAlways), scE2EDurability), func(env *Env) (pipelineRun, error) { return runPipeline(ctx, env, p) })
		if err != nil {
			return nil, fmt.Errorf("%s: %w", v.row, err)
		}
		r := Result{Scenario: scE2EDurability, Row: v.row, N: p.N, Messages: p.N, Config: pipelineConfigMap(p)}
		r.Config["jetstream_sync_always"] = v.syncAlways
		r.Config["atomic_publish"] = v.atomic
		r.setMeasurement(run.meas, p.N)
		r.Seconds, r.Rate = run.effects.Seconds(), float64(p.N)/run.effects.Seconds()
		r.Ledger, r.Verified = &run.ledger, "ok"
		r.Notes = append(r.Notes, fmt.Sprintf("%d producers, %d intent(s) per transaction; producers finished after %.2fs; last effect at %.2fs; latency under saturation p50 %.0f ms, p99 %.0f ms",
			durabilityProducers, p.EnqueueBatch, run.produced.Seconds(), run.effects.Seconds(), ms(percentile(run.latencies, 50)), ms(percentile(run.latencies, 99))))
		if v.reconcile {
			r.Notes = append(r.Notes, fmt.Sprintf("every intent proven settled by the reconciler (a pass each second) at %.2fs", run.proven.Seconds()))
		}
		results = append(results, r)
	}
	return results, nil
}

// waitProven waits until the reconciler has proven every published intent complete.
func waitProven(ctx context.Context, env *Env, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		s, err := reconcile.ReadStatus(ctx, env.Pool, "")
		if err != nil {
			return err
		}
		if s.Unproven == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s: %d intents not proven settled", timeout, s.Unproven)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// runE2EDup runs the pipeline with every message published twice and a fraction of
// the consumer's acks dropped.
func runE2EDup(ctx context.Context, newEnv envFactory, cfg E2EConfig) ([]Result, error) {
	p := cfg.Pipeline
	p.Scenario, p.Producers, p.Rate, p.Duplicate = scE2EDup, cfg.MaxProducers, 0, true
	run, err := withEnv(ctx, labelled(newEnv, scE2EDup), func(env *Env) (pipelineRun, error) { return runPipeline(ctx, env, p) })
	if err != nil {
		return nil, fmt.Errorf("%s: %w", scE2EDup, err)
	}
	r := Result{Scenario: scE2EDup, Row: scE2EDup, N: p.N, Messages: 2 * p.N, Config: pipelineConfigMap(p)}
	r.setMeasurement(run.meas, p.N)
	r.Seconds, r.Rate = run.effects.Seconds(), float64(p.N)/run.effects.Seconds()
	r.Ledger = &run.ledger
	r.Verified = fmt.Sprintf("ok: %d rows for %d messages", run.ledger.Rows, 2*p.N)
	r.Notes = append(r.Notes,
		fmt.Sprintf("producers finished after %.2fs; all %d effects committed at %.2fs; all %d messages acked at %.2fs (%.0f msgs/s incl. redeliveries after AckWait %s)",
			run.produced.Seconds(), p.N, run.effects.Seconds(), 2*p.N, run.drained.Seconds(), float64(2*p.N)/run.drained.Seconds(), p.AckWait),
		fmt.Sprintf("%d batches had their acks dropped; consumer outcomes: %d processed, %d duplicates folded",
			run.dropped, run.processed, run.duplicates))
	return []Result{r}, nil
}

// withEnv runs f in a fresh environment and closes it.
func withEnv[T any](ctx context.Context, newEnv func(context.Context) (*Env, error), f func(*Env) (T, error)) (T, error) {
	env, err := newEnv(ctx)
	if err != nil {
		var zero T
		return zero, err
	}
	defer env.Close(context.WithoutCancel(ctx))
	return f(env)
}
