package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/app/refapp"
)

// BaselineConfig configures the naive and handwritten-inbox scenarios.
type BaselineConfig struct {
	N int
	// Workers is how many goroutines handle messages, one at a time each, every one
	// with its own pooled connection: that is how a plain consumer gets Postgres's
	// group commit to work for it.
	Workers int
	Timeout time.Duration
	Log     *slog.Logger
}

const (
	sqlLedgerOne = `INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ($1, $2, $3)`

	// The hand-written inbox is the table a team would write for itself: the
	// consumer and key, nothing else.
	sqlCreateHandInbox = `CREATE TABLE IF NOT EXISTS handwritten_inbox (
		consumer    text        NOT NULL,
		key         text        NOT NULL,
		received_at timestamptz NOT NULL DEFAULT now(),
		PRIMARY KEY (consumer, key))`
	sqlClaimHandInbox = `INSERT INTO handwritten_inbox (consumer, key) VALUES ($1, $2) ON CONFLICT DO NOTHING`
)

// handleFunc handles one message with the database; an error means nak.
type handleFunc func(ctx context.Context, pool *pgxpool.Pool, key string, c refapp.Charge) error

// naiveHandle: one autocommit INSERT, no dedupe. A redelivery is a second charge.
func naiveHandle(ctx context.Context, pool *pgxpool.Pool, key string, c refapp.Charge) error {
	_, err := pool.Exec(ctx, sqlLedgerOne, key, c.Account, c.AmountCents)
	return err
}

// inboxHandle: one transaction per message, claim then effect.
func inboxHandle(ctx context.Context, pool *pgxpool.Pool, key string, c refapp.Charge) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	tag, err := tx.Exec(ctx, sqlClaimHandInbox, "handwritten", key)
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 1 { // a new key: run the effect
		if _, err := tx.Exec(ctx, sqlLedgerOne, key, c.Account, c.AmountCents); err != nil {
			return err
		}
	}
	return tx.Commit(ctx)
}

func runNaive(ctx context.Context, env *Env, cfg BaselineConfig) ([]Result, error) {
	return runBaseline(ctx, env, scNaive, cfg, naiveHandle)
}

func runHandwrittenInbox(ctx context.Context, env *Env, cfg BaselineConfig) ([]Result, error) {
	if _, err := env.Pool.Exec(ctx, sqlCreateHandInbox); err != nil {
		return nil, fmt.Errorf("%s: create inbox table: %w", scInbox, err)
	}
	return runBaseline(ctx, env, scInbox, cfg, inboxHandle)
}

// runBaseline drains a pre-filled stream with a plain JetStream pull consumer
// (Consume) feeding cfg.Workers goroutines; each decodes the charge, runs handle and
// acks. A message whose handler fails is naked for redelivery.
func runBaseline(ctx context.Context, env *Env, name string, cfg BaselineConfig, handle handleFunc) ([]Result, error) {
	intents := makeIntents(cfg.N, 0)
	if err := prefill(ctx, env, name, intents); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	durable := "bench-" + name
	cons, err := env.JS.CreateOrUpdateConsumer(ctx, refapp.StreamName, jetstream.ConsumerConfig{
		Durable:       durable,
		FilterSubject: refapp.SubjectCharge,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       30 * time.Second,
		MaxAckPending: 1000, // the same bound the idem consumer runs with
	})
	if err != nil {
		return nil, fmt.Errorf("%s: create consumer: %w", name, err)
	}

	acked := newCounter(cfg.N)
	var failures atomic.Int64
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go progress(runCtx, name, "acked", cfg.N, acked.Load)

	meter, err := env.StartMeter(ctx)
	if err != nil {
		return nil, err
	}
	work := make(chan jetstream.Msg, cfg.Workers)
	var wg sync.WaitGroup
	for range cfg.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				var m jetstream.Msg
				select {
				case <-runCtx.Done():
					return
				case m = <-work:
				}
				c, err := refapp.DecodeCharge(m.Data())
				if err != nil {
					cfg.Log.Error("poison message", "scenario", name, "err", err)
					_ = m.Term()
					continue
				}
				if err := handle(runCtx, env.Pool, m.Headers().Get(idem.HeaderKey), c); err != nil {
					if runCtx.Err() == nil {
						failures.Add(1)
						cfg.Log.Error("handler failed; nak", "scenario", name, "err", err)
					}
					_ = m.Nak()
					continue
				}
				if err := m.Ack(); err != nil {
					cfg.Log.Error("ack failed", "scenario", name, "err", err)
				}
				acked.Add(1)
			}
		}()
	}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		select {
		case work <- m:
		case <-runCtx.Done():
		}
	}, jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
		cfg.Log.Warn("pull error", "scenario", name, "err", err)
	}))
	if err != nil {
		return nil, fmt.Errorf("%s: consume: %w", name, err)
	}
	waitErr := acked.wait(ctx, cfg.Timeout, "acked")
	meas, merr := meter.Stop(ctx)
	cc.Stop()
	cancel()
	wg.Wait()
	if waitErr != nil {
		return nil, fmt.Errorf("%s: %w", name, waitErr)
	}
	if merr != nil {
		return nil, merr
	}

	res := Result{Scenario: name, Row: name, N: cfg.N, Messages: cfg.N,
		Config: map[string]any{"workers": cfg.Workers, "max_ack_pending": 1000}}
	res.setMeasurement(meas, cfg.N)
	if _, err := waitDrained(ctx, env, durable, 10*time.Second); err != nil {
		res.Notes = append(res.Notes, err.Error())
	}
	if n := failures.Load(); n > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d handler failures were naked and redelivered", n))
	}
	l, err := readLedger(ctx, env)
	if err != nil {
		return nil, err
	}
	res.Ledger = &l
	switch {
	case l.Keys != cfg.N:
		return nil, fmt.Errorf("%s: VERIFY FAILED: ledger has %d distinct keys, want %d", name, l.Keys, cfg.N)
	case l.Rows != cfg.N && name == scNaive:
		// At-least-once: a redelivered message is charged again. Not a benchmark
		// failure, but it must be visible.
		res.Verified = fmt.Sprintf("at-least-once: %d double charges", l.Rows-cfg.N)
	case l.Rows != cfg.N:
		return nil, fmt.Errorf("%s: VERIFY FAILED: ledger has %d rows, want %d", name, l.Rows, cfg.N)
	default:
		res.Verified = "ok"
	}
	return []Result{res}, nil
}
