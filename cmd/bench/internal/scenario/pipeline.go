package scenario

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// The pipeline is what the e2e scenarios run: producers writing payments and
// outbox rows in one transaction per batch, the relay, JetStream and the idem
// consumer writing the ledger.

// pipelineConfig configures one run of the pipeline.
type pipelineConfig struct {
	// Label names the run in progress messages.
	Label string
	N     int
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
	// Reconcile runs a reconciler beside the relay, which then awaits proof, as
	// the worker does.
	Reconcile bool
	// AtomicPublish makes the relay publish each batch as one JetStream atomic
	// batch.
	AtomicPublish bool
	Timeout       time.Duration
	// Relay is the relay asked for (Options.Relay); relay is the one that ran.
	Relay, relay string
}

// pipelineConfigFrom is the pipeline as the options shape it; each scenario
// then sets its producers, rate and variant.
func pipelineConfigFrom(o Options) pipelineConfig {
	return pipelineConfig{
		N: o.N, PayloadBytes: o.PayloadBytes, EnqueueBatch: o.EnqueueBatch, RelayBatch: o.RelayBatch,
		BatchSize: o.BatchSize, Concurrency: o.Concurrency, Timeout: o.Timeout, Relay: o.Relay,
	}
}

// configMap is the row's config.
func (p pipelineConfig) configMap() map[string]any {
	return map[string]any{
		"enqueue_batch": p.EnqueueBatch, "producers": p.Producers, "rate": p.Rate,
		"relay_batch": p.RelayBatch, "consumer_batch": p.BatchSize, "consumer_concurrency": p.Concurrency,
		"duplicate": p.Duplicate, "drop_fraction": p.DropFraction, "ack_wait": p.AckWait.String(), "relay": p.relay,
	}
}

// pipelineRun is what one pipeline run measured.
type pipelineRun struct {
	meas measure.Measurement
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
	ledger     report.Ledger
	processed  int64
	duplicates int64
	dropped    int64
	// proven is when the reconciler had proven every intent complete (Reconcile).
	proven time.Duration
}

// latency summarises the run's latencies.
func (r pipelineRun) latency() measure.Latency { return measure.Summarize(r.latencies) }

// intentLatencies returns each intent's latency, committed[i] - enqueued[i], in
// intent order, and the last commit. Both are nanoseconds since the run's start.
func intentLatencies(enqueued, committed []int64) (lat []time.Duration, last time.Duration) {
	lat = make([]time.Duration, len(committed))
	for i, c := range committed {
		lat[i] = time.Duration(c - enqueued[i])
		last = max(last, time.Duration(c))
	}
	return lat, last
}

var errDropAcks = errors.New("bench: acks of this batch dropped on purpose")

// dupGeneration is the Msg-Id generation of e2e-dup's copies: the copy of an intent
// is published as idem.MsgID(subject, key) + " copy", which the broker does not fold
// into the original.
const dupGeneration = "copy"

// runPipeline runs cfg.N intents through the pipeline in env.
func runPipeline(ctx context.Context, env *benchenv.Env, h *Harness, cfg pipelineConfig) (pipelineRun, error) {
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

	spec := chargeConsumer(cfg.BatchSize, cfg.Concurrency, cfg.AckWait, func(k eventKind, n int) {
		switch k {
		case evProcessed:
			processed.Add(int64(n))
		case evDuplicate:
			duplicates.Add(int64(n))
		}
	})
	cs, err := newConsumers(env, spec)
	if err != nil {
		return out, fmt.Errorf("consumer: %w", err)
	}
	c := cs[0]
	// Right after each batch's COMMIT returned and before its acks: the moment the
	// effects became durable. A delivery's key may have committed in an earlier
	// batch (a duplicate); only the first commit of a key counts. Returning an
	// error abandons the batch unacked.
	onCommit := func(_ context.Context, keys []string) error {
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
	rel, mode, err := newRelay(ctx, env, relaySpec{
		BatchSize:     cfg.RelayBatch,
		AwaitProof:    cfg.Reconcile,
		AtomicPublish: cfg.AtomicPublish,
		Mode:          cfg.Relay,
		Observe: func(k eventKind, n int) {
			if k == evPublished {
				published.Add(n)
			}
		},
	})
	if err != nil {
		return out, fmt.Errorf("relay: %w", err)
	}
	cfg.relay = string(mode)
	var rec runner
	if cfg.Reconcile {
		if rec, err = newReconciler(env); err != nil {
			return out, fmt.Errorf("reconciler: %w", err)
		}
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	consumerCtx := afterCommit(runCtx, onCommit)
	var wg sync.WaitGroup
	errs := make(chan error, 3+cfg.Producers)
	wg.Add(2)
	go func() { defer wg.Done(); errs <- c.Run(consumerCtx) }()
	go func() { defer wg.Done(); errs <- rel.Run(runCtx) }()
	if rec != nil {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- rec.Run(runCtx) }()
	}
	stopAll := func() {
		cancel()
		wg.Wait()
	}
	// Let the relay's LISTEN connection and the durable consumer come up, so the
	// first batches are not left to the relay's poll.
	time.Sleep(300 * time.Millisecond)
	go progress(runCtx, cfg.Label, "effects committed", cfg.N, effects.Load)

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

	enq, com := make([]int64, cfg.N), make([]int64, cfg.N)
	for i := range cfg.N {
		enq[i], com[i] = enqueued[i].Load(), committed[i].Load()
	}
	out.latencies, out.effects = intentLatencies(enq, com)
	// Intents are produced in index order: the halves are the first and the second
	// half of the run, which shows latency that grows as the tables grow.
	out.p99Halves = measure.HalvesP99(out.latencies)
	slices.Sort(out.latencies)
	out.processed, out.duplicates, out.dropped = processed.Load(), duplicates.Load(), dropped.Load()

	if out.ledger, err = verifyExactlyOnce(ctx, env, cfg.N); err != nil {
		return out, err
	}
	var payments, unpublished int
	// A row is published when the polling relay marked it or it is in a window of
	// the log relay's.
	err = env.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM payments), (SELECT count(*) FROM idem_outbox o WHERE published_at IS NULL
		AND NOT EXISTS (SELECT 1 FROM idem_outbox_published w WHERE w.id_range @> o.id AND o.id = ANY(w.ids)))`).Scan(&payments, &unpublished)
	if err != nil {
		return out, fmt.Errorf("verify: %w", err)
	}
	if payments != cfg.N || unpublished != 0 {
		return out, fmt.Errorf("VERIFY FAILED: %d payments (want %d), %d outbox rows unpublished", payments, cfg.N, unpublished)
	}
	return out, nil
}

// waitProven waits until the reconciler has proven every published intent complete.
func waitProven(ctx context.Context, env *benchenv.Env, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		n, err := unproven(ctx, env)
		if err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s: %d intents not proven settled", timeout, n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}
