package scenario

import (
	"context"
	"fmt"

	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// e2e runs the pipeline twice, each time on a fresh environment: unthrottled (max
// sustained intents/s) and at a fixed offered load (latency). The relay runs
// beside a reconciler, as the product does.
type e2e struct{}

func (e2e) Name() string { return "e2e" }

func (e2e) Summary() string {
	return "payments + Outbox.Enqueue -> relay (+ reconciler) -> JetStream -> idem consumer -> ledger: max sustained intents/s (-producers), and latency p50/p99 at -rate intents/s"
}

func (s e2e) Rows(o Options) []string {
	return []string{s.Name() + " (max)", fmt.Sprintf("%s @%d/s", s.Name(), o.Rate)}
}

func (s e2e) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	name, rows := s.Name(), s.Rows(h.Opts)

	maxCfg := pipelineConfigFrom(h.Opts)
	maxCfg.Label, maxCfg.Producers, maxCfg.Reconcile = name+"/max", h.Opts.Producers, true
	run, err := withEnv(ctx, h, name+"-max", func(env *benchenv.Env) (pipelineRun, error) { return runPipeline(ctx, env, h, maxCfg) })
	if err != nil {
		return nil, fmt.Errorf("%s (max): %w", name, err)
	}
	lat := run.latency()
	maxRow := report.Result{Scenario: name, Row: rows[0], N: maxCfg.N, Messages: maxCfg.N, Config: maxCfg.configMap()}
	maxRow.SetMeasurement(run.meas, maxCfg.N)
	maxRow.Seconds, maxRow.Rate = run.effects.Seconds(), measure.Rate(maxCfg.N, run.effects)
	maxRow.Ledger, maxRow.Verified = &run.ledger, "ok"
	maxRow.Notes = append(maxRow.Notes,
		fmt.Sprintf("producers finished after %.2fs (%.0f intents/s offered); last effect at %.2fs",
			run.produced.Seconds(), measure.Rate(maxCfg.N, run.produced), run.effects.Seconds()),
		fmt.Sprintf("latency under saturation (queueing included): p50 %.0f ms, p99 %.0f ms", measure.Ms(lat.P50), measure.Ms(lat.P99)))

	rateCfg := pipelineConfigFrom(h.Opts)
	rateCfg.Label, rateCfg.Producers, rateCfg.Rate, rateCfg.EnqueueBatch, rateCfg.Reconcile = name+"/rate", 1, h.Opts.Rate, h.Opts.RateBatch, true
	run, err = withEnv(ctx, h, name+"-rate", func(env *benchenv.Env) (pipelineRun, error) { return runPipeline(ctx, env, h, rateCfg) })
	if err != nil {
		return nil, fmt.Errorf("%s (rate): %w", name, err)
	}
	rateRow := report.Result{Scenario: name, Row: rows[1], N: rateCfg.N, Messages: rateCfg.N, Config: rateCfg.configMap()}
	rateRow.SetMeasurement(run.meas, rateCfg.N)
	// The rate of this row is the load actually offered; it can only fall short of
	// the target if a producer transaction took longer than its slot.
	rateRow.Rate = measure.Rate(rateCfg.N, run.produced)
	rateRow.SetLatency(run.latency())
	rateRow.Ledger, rateRow.Verified = &run.ledger, "ok"
	rateRow.Notes = append(rateRow.Notes, fmt.Sprintf("offered %.0f intents/s in transactions of %d; latency = producer COMMIT issued -> consumer COMMIT returned; max %.1f ms; p99 of the first half %.1f ms, of the second half %.1f ms",
		rateRow.Rate, rateCfg.EnqueueBatch, rateRow.MaxMs, measure.Ms(run.p99Halves[0]), measure.Ms(run.p99Halves[1])))
	return []report.Result{maxRow, rateRow}, nil
}
