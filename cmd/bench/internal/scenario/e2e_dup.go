package scenario

import (
	"context"
	"fmt"

	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// e2eDup runs the pipeline with every message published twice and a fraction of
// the consumer's acks dropped: only the inbox stands between the copies and a
// second effect.
type e2eDup struct{}

func (e2eDup) Name() string { return "e2e-dup" }

func (e2eDup) Summary() string {
	return "e2e (max) with every message published twice and a fraction of acked batches dropped (-dup-drop, -dup-ack-wait)"
}

func (s e2eDup) Rows(Options) []string { return []string{s.Name()} }

func (s e2eDup) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	name := s.Name()
	p := pipelineConfigFrom(h.Opts)
	p.Label, p.Producers, p.Duplicate = name, h.Opts.Producers, true
	p.DropFraction, p.AckWait = h.Opts.DupDrop, h.Opts.DupAckWait
	run, err := withEnv(ctx, h, name, func(env *benchenv.Env) (pipelineRun, error) { return runPipeline(ctx, env, h, p) })
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	r := report.Result{Scenario: name, Row: name, N: p.N, Messages: 2 * p.N, Config: p.configMap()}
	r.SetMeasurement(run.meas, p.N)
	r.Seconds, r.Rate = run.effects.Seconds(), measure.Rate(p.N, run.effects)
	r.Ledger = &run.ledger
	r.Verified = fmt.Sprintf("ok: %d rows for %d messages", run.ledger.Rows, 2*p.N)
	r.Notes = append(r.Notes,
		fmt.Sprintf("producers finished after %.2fs; all %d effects committed at %.2fs; all %d messages acked at %.2fs (%.0f msgs/s incl. redeliveries after AckWait %s)",
			run.produced.Seconds(), p.N, run.effects.Seconds(), 2*p.N, run.drained.Seconds(), measure.Rate(2*p.N, run.drained), p.AckWait),
		fmt.Sprintf("%d batches had their acks dropped; consumer outcomes: %d processed, %d duplicates folded",
			run.dropped, run.processed, run.duplicates))
	return []report.Result{r}, nil
}
