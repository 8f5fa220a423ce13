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

// relay pre-inserts N outbox rows and times a relay publishing all of them: the
// polling relay, and the log relay reading them from its slot (its price: the
// decoding, in Postgres's CPU, against the polling relay's claims and marks).
type relay struct{}

func (relay) Name() string { return "relay" }

func (relay) Summary() string {
	return "N outbox rows (Outbox.Enqueue, 1000 per transaction) relayed to JetStream: by the polling relay (-relay-batch), and by the log relay from its slot"
}

// Row labels: the polling relay keeps the scenario's name.
const rowRelayLog = "relay, log relay"

func (s relay) Rows(o Options) []string {
	switch o.Relay {
	case "poll":
		return []string{s.Name()}
	case "log":
		return []string{rowRelayLog}
	}
	return []string{s.Name(), rowRelayLog}
}

// relayPrefillBatch is how many rows each pre-fill transaction writes.
const relayPrefillBatch = 1000

func (s relay) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	var out []report.Result
	for _, row := range s.Rows(h.Opts) {
		mode := "poll"
		if row == rowRelayLog {
			mode = "log"
		}
		rs, err := withEnv(ctx, h, s.Name(), func(env *benchenv.Env) ([]report.Result, error) { return s.run(ctx, env, h, row, mode) })
		if err != nil {
			return out, err
		}
		out = append(out, rs...)
	}
	return out, nil
}

func (s relay) run(ctx context.Context, env *benchenv.Env, h *Harness, row, mode string) ([]report.Result, error) {
	name, n := s.Name(), h.Opts.N
	published := newCounter(n)
	var failed atomic.Int64
	// The relay is made first: the log relay's slot must exist before the rows
	// are written, to stream them.
	r, _, err := newRelay(ctx, env, relaySpec{BatchSize: h.Opts.RelayBatch, Mode: mode, Observe: func(k eventKind, count int) {
		switch k {
		case evPublished:
			published.Add(count)
		case evFailed:
			failed.Add(int64(count))
		}
	}})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", row, err)
	}
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
			return nil, fmt.Errorf("%s: pre-fill outbox: %w", row, err)
		}
	}
	fmt.Fprintf(os.Stderr, "[%s] outbox pre-filled with %d rows in %s\n", row, n, time.Since(start).Round(time.Millisecond))

	meas, err := timedRun(ctx, env, h.Opts.Timeout, row, "published", published, r.Run)
	if err != nil {
		return nil, err
	}
	res := report.Result{Scenario: name, Row: row, N: n, Messages: n,
		Config: map[string]any{"relay_batch": h.Opts.RelayBatch, "prefill_batch": relayPrefillBatch, "relay": mode}}
	res.SetMeasurement(meas, n)
	if f := failed.Load(); f > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d publishes failed and were retried", f))
	}

	// Verify: every row published (marked by the polling relay, in a window of the
	// log relay's), every message in the stream once.
	var unpublished int
	err = env.Pool.QueryRow(ctx, `SELECT count(*) FROM idem_outbox o WHERE published_at IS NULL
		AND NOT EXISTS (SELECT 1 FROM idem_outbox_published w WHERE w.id_range @> o.id AND o.id = ANY(w.ids))`).Scan(&unpublished)
	if err != nil {
		return nil, fmt.Errorf("%s: verify: %w", row, err)
	}
	info, err := env.Stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("%s: verify: stream info: %w", row, err)
	}
	if unpublished != 0 || info.State.Msgs != uint64(n) {
		return nil, fmt.Errorf("%s: VERIFY FAILED: %d outbox rows unpublished, stream holds %d messages, want 0 and %d", row, unpublished, info.State.Msgs, n)
	}
	res.Verified = fmt.Sprintf("ok: stream holds %d", info.State.Msgs)
	return []report.Result{res}, nil
}
