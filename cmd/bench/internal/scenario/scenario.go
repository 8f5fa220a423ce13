// Package scenario holds the benchmark's scenarios, one file each, and their
// registry. A scenario runs each of its phases on a fresh environment (package
// benchenv) and returns one report.Result per row it declares.
//
// Every call into the library's constructors is in wiring.go, so that a change
// of their signatures is adapted in one file.
package scenario

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// Scenario is one measurement: what -scenarios names, and the rows it adds to the
// table.
type Scenario interface {
	// Name is what -scenarios takes and what each of its rows carries as
	// "scenario" in the JSON.
	Name() string
	// Summary says in one line what runs, for -h.
	Summary() string
	// Rows lists the labels of the rows Run returns with o, in order.
	Rows(o Options) []string
	// Run measures, each phase on a fresh environment, and returns one result
	// per row.
	Run(ctx context.Context, h *Harness) ([]report.Result, error)
}

// All returns every scenario, in the order a full run takes them.
func All() []Scenario {
	return []Scenario{
		naive{}, handwrittenInbox{}, idemConsumer{}, relay{},
		e2e{}, e2eDup{}, e2eDurability{}, e2eOrdered{},
		plainHTTP{}, e2eHTTP{}, watermillHTTP{}, publishBatch{},
	}
}

// Names lists every scenario's name, in run order.
func Names() []string {
	var out []string
	for _, s := range All() {
		out = append(out, s.Name())
	}
	return out
}

// Lookup returns the scenario called name.
func Lookup(name string) (Scenario, error) {
	for _, s := range All() {
		if s.Name() == name {
			return s, nil
		}
	}
	return nil, fmt.Errorf("unknown scenario %q (have %s)", name, strings.Join(Names(), ", "))
}

// Parse turns a comma-separated list into scenario names, checked against the
// registry. Blanks around names are ignored; an empty list is refused.
func Parse(list string) ([]string, error) {
	var out []string
	for s := range strings.SplitSeq(list, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if _, err := Lookup(s); err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no scenario named (have %s)", strings.Join(Names(), ", "))
	}
	return out, nil
}

// Options are the knobs the scenarios read: the benchmark's flags, but for those
// of the process itself (the JSON path, -inprocess, -v).
type Options struct {
	// N is the intents (messages) per scenario.
	N int
	// Timeout bounds a scenario's timed phase.
	Timeout time.Duration

	// DatabaseURL is the server the environments' databases are created on.
	DatabaseURL string
	// Keep leaves each environment's database in place.
	Keep bool
	// SyncAlways runs the embedded JetStream server with fsync on every write.
	SyncAlways bool
	// CPUProfile, TraceSQL and PlanCache are the environments' experiment knobs
	// (benchenv.Config).
	CPUProfile string
	TraceSQL   bool
	PlanCache  string

	Workers      int // baseline consumers' goroutines (and connections)
	BatchSize    int // idem consumer batch size
	Concurrency  int // idem consumer batches in flight
	RelayBatch   int // relay batch size
	EnqueueBatch int // intents per producer transaction in the pipeline scenarios
	Producers    int // producer goroutines in the e2e max-throughput phase and e2e-dup
	Rate         int // offered load of the e2e latency phase, intents/s
	RateBatch    int // intents per producer transaction in the latency phase
	// PayloadBytes pads each pipeline message's payload (0: a small charge).
	PayloadBytes int
	DupDrop      float64 // fraction of committed batches whose acks e2e-dup drops
	DupAckWait   time.Duration
	// DurabilityBatch is e2e-durability's intents per producer transaction.
	DurabilityBatch int
	HTTPClients     int // HTTP scenarios: keep-alive clients of the max phase
	HTTPRate        int // HTTP scenarios: offered requests/s of the latency phase
	HTTPRateN       int // HTTP scenarios: requests of the latency phase (at most N)
	// WatermillDir is the watermill-http peer's package directory.
	WatermillDir string
	// Relay is the relay idem's scenarios run: "log", "poll", or "" for what the
	// worker would choose (the log relay where the server allows it).
	Relay string
}

// DefaultOptions are the flags' defaults.
func DefaultOptions() Options {
	return Options{
		N: 20000, Timeout: 2 * time.Minute,
		DatabaseURL: "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable",
		Workers:     32, BatchSize: 250, Concurrency: 2, RelayBatch: 500, EnqueueBatch: 100,
		Producers: 2, Rate: 2000, RateBatch: 100, DupDrop: 0.10, DupAckWait: 2 * time.Second,
		DurabilityBatch: 1, HTTPClients: 32, HTTPRate: 1000, HTTPRateN: 10000,
		WatermillDir: "cmd/bench/watermill",
	}
}

// Validate refuses options no scenario can run with, saying which flag to fix.
func (o Options) Validate() error {
	switch {
	case o.N <= 0:
		return errors.New("-n must be positive")
	case o.Workers <= 0, o.BatchSize <= 0, o.Concurrency <= 0, o.RelayBatch <= 0, o.EnqueueBatch <= 0, o.Producers <= 0,
		o.RateBatch <= 0, o.DurabilityBatch <= 0, o.HTTPClients <= 0, o.HTTPRate <= 0, o.HTTPRateN <= 0:
		return errors.New("-workers, -batch, -concurrency, -relay-batch, -enqueue-batch, -producers, -rate-batch, -durability-batch and the -http- flags must be positive")
	case o.Rate <= 0:
		return errors.New("-rate must be positive")
	case o.Timeout <= 0:
		return errors.New("-timeout must be positive")
	case o.PayloadBytes < 0:
		return errors.New("-payload-bytes must not be negative")
	case o.DupDrop < 0 || o.DupDrop >= 1:
		return errors.New("-dup-drop must be in [0, 1)")
	}
	return nil
}

// poolSize is the connections of every environment's pool: enough for the
// largest scenario's clients, producers and consumers, plus room for the meter.
func poolSize(o Options) int32 {
	return int32(max(o.Workers, o.Producers+o.Concurrency+4, durabilityProducers+o.Concurrency+4, o.HTTPClients+8) + 4)
}

// Harness is what a scenario runs with: the options, the logger, and fresh
// environments on demand.
type Harness struct {
	Opts Options
	Log  *slog.Logger
}

// newEnv makes a fresh environment; label names it in messages and profiles.
func (h *Harness) newEnv(ctx context.Context, label string) (*benchenv.Env, error) {
	return benchenv.New(ctx, benchenv.Config{
		AdminURL:      h.Opts.DatabaseURL,
		MaxConns:      poolSize(h.Opts),
		SyncAlways:    h.Opts.SyncAlways,
		Keep:          h.Opts.Keep,
		Label:         label,
		CPUProfile:    h.Opts.CPUProfile,
		TraceSQL:      h.Opts.TraceSQL,
		PlanCacheMode: h.Opts.PlanCache,
		Log:           h.Log,
	})
}

// withEnv runs f in a fresh environment and closes it.
func withEnv[T any](ctx context.Context, h *Harness, label string, f func(*benchenv.Env) (T, error)) (T, error) {
	env, err := h.newEnv(ctx, label)
	if err != nil {
		var zero T
		return zero, err
	}
	defer env.Close(context.WithoutCancel(ctx))
	return f(env)
}

// Run runs s and checks that it returned the rows it declares.
func Run(ctx context.Context, s Scenario, h *Harness) ([]report.Result, error) {
	rs, err := s.Run(ctx, h)
	if err != nil {
		return nil, err
	}
	if err := CheckRows(s, h.Opts, rs); err != nil {
		return nil, err
	}
	return rs, nil
}

// CheckRows fails unless rs are exactly the rows s declares for o, in order, each
// carrying s's name: the ratios and targets find rows by their labels.
func CheckRows(s Scenario, o Options, rs []report.Result) error {
	var got []string
	for _, r := range rs {
		if r.Scenario != s.Name() {
			return fmt.Errorf("%s: row %q carries scenario %q", s.Name(), r.Row, r.Scenario)
		}
		got = append(got, r.Row)
	}
	if want := s.Rows(o); !slices.Equal(got, want) {
		return fmt.Errorf("%s: returned rows %q, declares %q", s.Name(), got, want)
	}
	return nil
}
