package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/internal/app/refapp"
)

// ConsumerConfig configures the idem-consumer scenario.
type ConsumerConfig struct {
	N           int
	BatchSize   int
	Concurrency int
	Timeout     time.Duration
	Log         *slog.Logger
}

// runIdemConsumer drains a pre-filled stream with consumer.Consumer and
// refapp.ChargeHandler: the timed phase runs from Run until the last ack.
func runIdemConsumer(ctx context.Context, env *Env, cfg ConsumerConfig) ([]Result, error) {
	intents := makeIntents(cfg.N, 0)
	if err := prefill(ctx, env, scConsumer, intents); err != nil {
		return nil, fmt.Errorf("%s: %w", scConsumer, err)
	}
	settled := newCounter(cfg.N)
	c, err := consumer.New(env.Pool, env.JS, consumer.Config{
		Name:         refapp.ChargeConsumer,
		Stream:       refapp.StreamName,
		Subject:      refapp.SubjectCharge,
		BatchHandler: refapp.ChargeHandler{},
		BatchSize:    cfg.BatchSize,
		Concurrency:  cfg.Concurrency,
		Logger:       cfg.Log,
		// Told after the acks of each batch.
		Observer: func(e idem.Event) {
			if e.Outcome == idem.OutcomeProcessed || e.Outcome == idem.OutcomeDuplicate {
				settled.Add(e.Count)
			}
		},
	})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", scConsumer, err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go progress(runCtx, scConsumer, "acked", cfg.N, settled.Load)

	meter, err := env.StartMeter(ctx)
	if err != nil {
		return nil, err
	}
	runErr := make(chan error, 1)
	go func() { runErr <- c.Run(runCtx) }()
	waitErr := settled.wait(ctx, cfg.Timeout, "acked")
	meas, merr := meter.Stop(ctx)
	cancel()
	if err := <-runErr; err != nil {
		return nil, fmt.Errorf("%s: %w", scConsumer, err)
	}
	if waitErr != nil {
		return nil, fmt.Errorf("%s: %w", scConsumer, waitErr)
	}
	if merr != nil {
		return nil, merr
	}
	res := Result{Scenario: scConsumer, Row: scConsumer, N: cfg.N, Messages: cfg.N,
		Config: map[string]any{"batch_size": c.Config().BatchSize, "concurrency": c.Config().Concurrency,
			"max_ack_pending": c.Config().MaxAckPending, "linger": c.Config().Linger.String()}}
	res.setMeasurement(meas, cfg.N)
	if _, err := waitDrained(ctx, env, refapp.ChargeConsumer, 10*time.Second); err != nil {
		res.Notes = append(res.Notes, err.Error())
	}
	l, err := verifyExactlyOnce(ctx, env, cfg.N)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", scConsumer, err)
	}
	res.Ledger, res.Verified = &l, "ok"
	return []Result{res}, nil
}

// RelayBenchConfig configures the relay scenario.
type RelayBenchConfig struct {
	N int
	// EnqueueBatch is how many rows each pre-fill transaction writes.
	EnqueueBatch int
	// BatchSize is outbox.RelayConfig.BatchSize.
	BatchSize int
	Timeout   time.Duration
	Log       *slog.Logger
}

// runRelay pre-inserts N outbox rows (Outbox.Enqueue, cfg.EnqueueBatch per
// transaction) and times outbox.Relay publishing all of them.
func runRelay(ctx context.Context, env *Env, cfg RelayBenchConfig) ([]Result, error) {
	intents := makeIntents(cfg.N, 0)
	start := time.Now()
	for lo := 0; lo < cfg.N; lo += cfg.EnqueueBatch {
		hi := min(lo+cfg.EnqueueBatch, cfg.N)
		msgs := make([]idem.Message, 0, hi-lo)
		for i := lo; i < hi; i++ {
			msgs = append(msgs, intents[i].message())
		}
		err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error { return env.Outbox.Enqueue(ctx, tx, msgs...) })
		if err != nil {
			return nil, fmt.Errorf("%s: pre-fill outbox: %w", scRelay, err)
		}
	}
	fmt.Fprintf(os.Stderr, "[%s] outbox pre-filled with %d rows in %s\n", scRelay, cfg.N, time.Since(start).Round(time.Millisecond))

	published := newCounter(cfg.N)
	var failed atomic.Int64
	r, err := outbox.NewRelay(env.Pool, env.JS, outbox.RelayConfig{
		Stream:    refapp.StreamName,
		BatchSize: cfg.BatchSize,
		Logger:    cfg.Log,
		Observer:  relayObserver(published, &failed),
	})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", scRelay, err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go progress(runCtx, scRelay, "published", cfg.N, published.Load)

	meter, err := env.StartMeter(ctx)
	if err != nil {
		return nil, err
	}
	runErr := make(chan error, 1)
	go func() { runErr <- r.Run(runCtx) }()
	waitErr := published.wait(ctx, cfg.Timeout, "published")
	meas, merr := meter.Stop(ctx)
	cancel()
	if err := <-runErr; err != nil {
		return nil, fmt.Errorf("%s: %w", scRelay, err)
	}
	if waitErr != nil {
		return nil, fmt.Errorf("%s: %w", scRelay, waitErr)
	}
	if merr != nil {
		return nil, merr
	}
	res := Result{Scenario: scRelay, Row: scRelay, N: cfg.N, Messages: cfg.N,
		Config: map[string]any{"relay_batch": cfg.BatchSize, "prefill_batch": cfg.EnqueueBatch}}
	res.setMeasurement(meas, cfg.N)
	if n := failed.Load(); n > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d publishes failed and were retried", n))
	}

	// Verify: every row marked published, every message in the stream once.
	var unpublished int
	if err := env.Pool.QueryRow(ctx, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL`).Scan(&unpublished); err != nil {
		return nil, fmt.Errorf("%s: verify: %w", scRelay, err)
	}
	info, err := env.Stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("%s: verify: stream info: %w", scRelay, err)
	}
	if unpublished != 0 || info.State.Msgs != uint64(cfg.N) {
		return nil, fmt.Errorf("%s: VERIFY FAILED: %d outbox rows unpublished, stream holds %d messages, want 0 and %d", scRelay, unpublished, info.State.Msgs, cfg.N)
	}
	res.Verified = fmt.Sprintf("ok: stream holds %d", info.State.Msgs)
	return []Result{res}, nil
}

// relayObserver counts the relay's published rows into published and its failed
// publishes (retried later) into failed, when failed is not nil.
func relayObserver(published *counter, failed *atomic.Int64) idem.Observer {
	return func(e idem.Event) {
		switch e.Outcome {
		case idem.OutcomePublished:
			published.Add(e.Count)
		case idem.OutcomeFailed:
			if failed != nil {
				failed.Add(int64(e.Count))
			}
		}
	}
}
