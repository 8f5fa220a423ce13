package scenario

import (
	"context"
	"fmt"
	"time"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// idemConsumer drains a pre-filled stream with the idem consumer and the
// reference application's charge handler: the timed phase runs from Run until
// the last ack.
type idemConsumer struct{}

func (idemConsumer) Name() string { return "idem-consumer" }

func (idemConsumer) Summary() string {
	return "the idem consumer with the reference application's charge handler over a pre-filled stream"
}

func (s idemConsumer) Rows(Options) []string { return []string{s.Name()} }

func (s idemConsumer) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	return withEnv(ctx, h, s.Name(), func(env *benchenv.Env) ([]report.Result, error) { return s.run(ctx, env, h) })
}

func (s idemConsumer) run(ctx context.Context, env *benchenv.Env, h *Harness) ([]report.Result, error) {
	name, n := s.Name(), h.Opts.N
	intents := makeIntents(n, 0)
	if err := prefill(ctx, env, name, intents); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	// Told after the acks of each batch.
	settled := newCounter(n)
	c, settings, err := newConsumer(env, chargeConsumer(h.Opts.BatchSize, h.Opts.Concurrency, 0, func(k eventKind, count int) {
		if k == evProcessed || k == evDuplicate {
			settled.Add(count)
		}
	}))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	meas, err := timedRun(ctx, env, h.Opts.Timeout, name, "acked", settled, c.Run)
	if err != nil {
		return nil, err
	}
	res := report.Result{Scenario: name, Row: name, N: n, Messages: n, Config: settings}
	res.SetMeasurement(meas, n)
	if _, err := waitDrained(ctx, env, refapp.ChargeConsumer, 10*time.Second); err != nil {
		res.Notes = append(res.Notes, err.Error())
	}
	l, err := verifyExactlyOnce(ctx, env, n)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	res.Ledger, res.Verified = &l, "ok"
	return []report.Result{res}, nil
}
