package scenario

import (
	"context"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// relay pre-inserts N outbox rows and times the relay publishing all of them.
type relay struct{}

func (relay) Name() string { return "relay" }

func (relay) Summary() string {
	return "N outbox rows (Outbox.Enqueue, 1000 per transaction) relayed to JetStream by the relay (-relay-batch)"
}

func (s relay) Rows(Options) []string { return []string{s.Name()} }

// relayPrefillBatch is how many rows each pre-fill transaction writes.
const relayPrefillBatch = 1000

func (s relay) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	return withEnv(ctx, h, s.Name(), func(env *benchenv.Env) ([]report.Result, error) { return s.run(ctx, env, h) })
}

func (s relay) run(ctx context.Context, env *benchenv.Env, h *Harness) ([]report.Result, error) {
	name, n := s.Name(), h.Opts.N
	intents := makeIntents(n, 0)
	start := time.Now()
	for lo := 0; lo < n; lo += relayPrefillBatch {
		hi := min(lo+relayPrefillBatch, n)
		msgs := make([]idem.Message, 0, hi-lo)
		for i := lo; i < hi; i++ {
			msgs = append(msgs, intents[i].message())
		}
		err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error { return env.Outbox.Enqueue(ctx, tx, msgs...) })
		if err != nil {
			return nil, fmt.Errorf("%s: pre-fill outbox: %w", name, err)
		}
	}
	fmt.Fprintf(os.Stderr, "[%s] outbox pre-filled with %d rows in %s\n", name, n, time.Since(start).Round(time.Millisecond))

	published := newCounter(n)
	var failed atomic.Int64
	r, err := newRelay(env, relaySpec{BatchSize: h.Opts.RelayBatch, Observe: func(k eventKind, count int) {
		switch k {
		case evPublished:
			published.Add(count)
		case evFailed:
			failed.Add(int64(count))
		}
	}})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	meas, err := timedRun(ctx, env, h.Opts.Timeout, name, "published", published, r.Run)
	if err != nil {
		return nil, err
	}
	res := report.Result{Scenario: name, Row: name, N: n, Messages: n,
		Config: map[string]any{"relay_batch": h.Opts.RelayBatch, "prefill_batch": relayPrefillBatch}}
	res.SetMeasurement(meas, n)
	if f := failed.Load(); f > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d publishes failed and were retried", f))
	}

	// Verify: every row marked published, every message in the stream once.
	var unpublished int
	if err := env.Pool.QueryRow(ctx, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL`).Scan(&unpublished); err != nil {
		return nil, fmt.Errorf("%s: verify: %w", name, err)
	}
	info, err := env.Stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("%s: verify: stream info: %w", name, err)
	}
	if unpublished != 0 || info.State.Msgs != uint64(n) {
		return nil, fmt.Errorf("%s: VERIFY FAILED: %d outbox rows unpublished, stream holds %d messages, want 0 and %d", name, unpublished, info.State.Msgs, n)
	}
	res.Verified = fmt.Sprintf("ok: stream holds %d", info.State.Msgs)
	return []report.Result{res}, nil
}
