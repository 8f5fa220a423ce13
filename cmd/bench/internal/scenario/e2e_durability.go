package scenario

import (
	"context"
	"fmt"

	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// e2eDurability measures the two ways to make a published intent survive the
// broker: JetStream fsyncing every write, or JetStream at its default sync
// interval with the reconciler proving every intent settled (and re-driving what
// a crash lost). Every row is the unthrottled pipeline with -durability-batch
// intents per producer transaction, each on a fresh environment; -sync-always
// does not apply.
type e2eDurability struct{}

func (e2eDurability) Name() string { return "e2e-durability" }

func (e2eDurability) Summary() string {
	return "e2e (max), 16 producers of -durability-batch intents per transaction: JetStream fsyncing every write against its default sync with the reconciler proving every intent settled (-sync-always does not apply)"
}

// durabilityProducers is how many producers e2e-durability runs, each committing
// one intent per transaction: the shape of one intent per HTTP request, with that
// many requests in flight.
const durabilityProducers = 16

// durabilityVariant is one row of e2e-durability.
type durabilityVariant struct {
	row        string
	syncAlways bool
	reconcile  bool
	atomic     bool
}

func durabilityVariants(o Options) []durabilityVariant {
	vs := []durabilityVariant{
		{"e2e, fsync always", true, false, false},
		{"e2e, fsync always, atomic batch publish", true, false, true},
		{"e2e, fsync always + reconciler", true, true, false},
		{"e2e, default fsync + reconciler", false, true, false},
		// No shipped setting: a broker crash can lose writes it already
		// acknowledged, and nothing re-drives them. It prices the reconciler's
		// proof at the default fsync.
		{"e2e, default fsync, no reconciler (not shipped: loses what a broker crash loses)", false, false, false},
	}
	if o.DurabilityBatch > 1 {
		// Not the shape users run: extra, labelled rows.
		for i := range vs {
			vs[i].row += fmt.Sprintf(" (%d intents per transaction)", o.DurabilityBatch)
		}
	}
	return vs
}

func (s e2eDurability) Rows(o Options) []string {
	var out []string
	for _, v := range durabilityVariants(o) {
		out = append(out, v.row)
	}
	return out
}

func (s e2eDurability) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	name := s.Name()
	var results []report.Result
	for _, v := range durabilityVariants(h.Opts) {
		p := pipelineConfigFrom(h.Opts)
		p.Label, p.Producers, p.EnqueueBatch, p.Reconcile, p.AtomicPublish = v.row, durabilityProducers, h.Opts.DurabilityBatch, v.reconcile, v.atomic
		vh := *h
		vh.Opts.SyncAlways = v.syncAlways
		run, err := withEnv(ctx, &vh, name, func(env *benchenv.Env) (pipelineRun, error) { return runPipeline(ctx, env, &vh, p) })
		if err != nil {
			return nil, fmt.Errorf("%s: %w", v.row, err)
		}
		lat := run.latency()
		r := report.Result{Scenario: name, Row: v.row, N: p.N, Messages: p.N, Config: p.configMap()}
		r.Config["jetstream_sync_always"] = v.syncAlways
		r.Config["atomic_publish"] = v.atomic
		r.SetMeasurement(run.meas, p.N)
		r.Seconds, r.Rate = run.effects.Seconds(), measure.Rate(p.N, run.effects)
		r.Ledger, r.Verified = &run.ledger, "ok"
		r.Notes = append(r.Notes, fmt.Sprintf("%d producers, %d intent(s) per transaction; producers finished after %.2fs; last effect at %.2fs; latency under saturation p50 %.0f ms, p99 %.0f ms",
			durabilityProducers, p.EnqueueBatch, run.produced.Seconds(), run.effects.Seconds(), measure.Ms(lat.P50), measure.Ms(lat.P99)))
		if v.reconcile {
			r.Notes = append(r.Notes, fmt.Sprintf("every intent proven settled by the reconciler (a pass each second) at %.2fs", run.proven.Seconds()))
		}
		results = append(results, r)
	}
	return results, nil
}
