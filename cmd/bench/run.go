package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
)

// envFactory makes a fresh environment; label names it in messages and profiles.
type envFactory func(ctx context.Context, label string) (*Env, error)

// Machine describes where the numbers were taken.
type Machine struct {
	NumCPU     int    `json:"num_cpu"`
	CPUModel   string `json:"cpu_model"`
	Memory     string `json:"memory"`
	GoVersion  string `json:"go"`
	Postgres   string `json:"postgres"`
	PGSettings string `json:"postgres_settings"`
	NATSServer string `json:"nats_server"`
	SyncAlways bool   `json:"jetstream_sync_always"`
}

// runParent runs each scenario in a child process, one after another, then prints
// the table and writes the JSON.
func runParent(ctx context.Context, opts Options, log *slog.Logger) error {
	machine, err := describeMachine(ctx, opts)
	if err != nil {
		return err
	}
	isolation := "one child process per scenario"
	if opts.InProcess {
		isolation = "every scenario in this process"
	}
	fmt.Fprintf(os.Stderr, "bench: N=%d, scenarios %s, embedded JetStream SyncAlways=%v, %s\n",
		opts.N, strings.Join(opts.Scenarios, ","), opts.SyncAlways, isolation)
	started := time.Now()
	var results []Result
	var failures []string
	for _, sc := range opts.Scenarios {
		fmt.Fprintf(os.Stderr, "== %s\n", sc)
		var rs []Result
		if opts.InProcess {
			rs, err = runScenario(ctx, opts, sc, log)
			if err == nil {
				rss, _ := peakRSS()
				for i := range rs {
					rs[i].PeakRSS = rss
				}
			}
		} else {
			rs, err = spawn(ctx, sc)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "== %s FAILED: %v\n", sc, err)
			failures = append(failures, fmt.Sprintf("%s: %v", sc, err))
			if ctx.Err() != nil {
				break
			}
			continue
		}
		results = append(results, rs...)
	}
	fmt.Fprintf(os.Stderr, "bench: done in %s\n", time.Since(started).Round(time.Second))

	ratios, targets := ratiosAndTargets(results)
	rep := Report{
		Date:     started.UTC().Format(time.RFC3339),
		Command:  commandLine(),
		Machine:  machine,
		Options:  optionsMap(opts),
		Results:  results,
		Ratios:   ratios,
		Targets:  targets,
		Failures: failures,
	}
	printTable(os.Stdout, rep)
	if opts.JSONPath != "" {
		if err := writeJSON(opts.JSONPath, rep); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "bench: results written to %s\n", opts.JSONPath)
	}
	if len(failures) > 0 {
		return fmt.Errorf("%d scenario(s) failed", len(failures))
	}
	return nil
}

// spawn runs one scenario in a child process of this binary and reads its results
// from the child's stdout. The child's stderr (progress) passes through.
func spawn(ctx context.Context, scenario string) ([]Result, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find own executable: %w", err)
	}
	args := append(append([]string{}, os.Args[1:]...), "-child", scenario)
	cmd := exec.CommandContext(ctx, exe, args...)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, os.Stderr
	// On interrupt, let the child drop its database.
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 30 * time.Second
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("child process: %w", err)
	}
	var rs []Result
	if err := json.Unmarshal(stdout.Bytes(), &rs); err != nil {
		return nil, fmt.Errorf("child process: decode results: %w", err)
	}
	return rs, nil
}

// runChild runs opts.child and prints its results, with the process's peak RSS, as
// JSON on stdout.
func runChild(ctx context.Context, opts Options, log *slog.Logger) error {
	rs, err := runScenario(ctx, opts, opts.child, log)
	if err != nil {
		return err
	}
	rss, err := peakRSS()
	if err != nil {
		return err
	}
	for i := range rs {
		if rs[i].PeakRSS == 0 { // the peer reports its own process's
			rs[i].PeakRSS = rss
		}
	}
	return json.NewEncoder(os.Stdout).Encode(rs)
}

// runScenario runs one scenario with fresh environments.
func runScenario(ctx context.Context, opts Options, name string, log *slog.Logger) ([]Result, error) {
	envWith := func(syncAlways bool) envFactory {
		return func(ctx context.Context, label string) (*Env, error) {
			return NewEnv(ctx, EnvConfig{
				AdminURL:      opts.DatabaseURL,
				MaxConns:      int32(max(opts.Workers, opts.Producers+opts.Concurrency+4, durabilityProducers+opts.Concurrency+4, opts.HTTPClients+8) + 4),
				SyncAlways:    syncAlways,
				Keep:          opts.Keep,
				Scenario:      label,
				CPUProfile:    opts.CPUProfile,
				TraceSQL:      opts.TraceSQL,
				PlanCacheMode: opts.PlanCache,
				Log:           log,
			})
		}
	}
	newEnv := envWith(opts.SyncAlways)
	baseline := BaselineConfig{N: opts.N, Workers: opts.Workers, Timeout: opts.Timeout, Log: log}
	pipeline := PipelineConfig{
		N: opts.N, PayloadBytes: opts.PayloadBytes, EnqueueBatch: opts.EnqueueBatch, RelayBatch: opts.RelayBatch,
		BatchSize: opts.BatchSize, Concurrency: opts.Concurrency, Timeout: opts.Timeout, Log: log,
	}
	e2e := E2EConfig{Pipeline: pipeline, MaxProducers: opts.Producers, Rate: opts.Rate, RateBatch: opts.RateBatch, DurabilityBatch: opts.DurabilityBatch}

	switch name {
	case scNaive:
		return withEnv(ctx, labelled(newEnv, name), func(env *Env) ([]Result, error) { return runNaive(ctx, env, baseline) })
	case scInbox:
		return withEnv(ctx, labelled(newEnv, name), func(env *Env) ([]Result, error) { return runHandwrittenInbox(ctx, env, baseline) })
	case scConsumer:
		cfg := ConsumerConfig{N: opts.N, BatchSize: opts.BatchSize, Concurrency: opts.Concurrency, Timeout: opts.Timeout, Log: log}
		return withEnv(ctx, labelled(newEnv, name), func(env *Env) ([]Result, error) { return runIdemConsumer(ctx, env, cfg) })
	case scRelay:
		cfg := RelayBenchConfig{N: opts.N, EnqueueBatch: 1000, BatchSize: opts.RelayBatch, Timeout: opts.Timeout, Log: log}
		return withEnv(ctx, labelled(newEnv, name), func(env *Env) ([]Result, error) { return runRelay(ctx, env, cfg) })
	case scE2E:
		// The product runs a reconciler beside its relay: so does the bench.
		e2e.Pipeline.Reconcile = true
		return runE2E(ctx, newEnv, e2e)
	case scE2EHTTP, scPlainHTTP:
		hc := HTTPConfig{N: opts.N, Clients: opts.HTTPClients, Rate: opts.HTTPRate, RateN: opts.HTTPRateN, Timeout: opts.Timeout, Log: log}
		return runHTTPScenario(ctx, newEnv, name, hc)
	case scWatermillHTTP:
		return runWatermillHTTP(ctx, opts)
	case scE2EDurability:
		return runE2EDurability(ctx, envWith, e2e)
	case scE2EOrdered:
		return runE2EOrdered(ctx, newEnv, opts, log)
	case scPublishBatch:
		return runPublishBatch(ctx, opts)
	case scE2EDup:
		e2e.Pipeline.DropFraction, e2e.Pipeline.AckWait = opts.DupDrop, opts.DupAckWait
		return runE2EDup(ctx, newEnv, e2e)
	}
	return nil, fmt.Errorf("unknown scenario %q", name)
}

// labelled fixes the label of every environment f makes.
func labelled(f envFactory, label string) func(context.Context) (*Env, error) {
	return func(ctx context.Context) (*Env, error) { return f(ctx, label) }
}

func describeMachine(ctx context.Context, opts Options) (Machine, error) {
	m := Machine{
		NumCPU:     runtime.NumCPU(),
		GoVersion:  runtime.Version(),
		NATSServer: "v" + server.VERSION,
		SyncAlways: opts.SyncAlways,
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if rest, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				var kb int64
				fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), &kb)
				m.Memory = fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20))
			}
		}
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if rest, ok := strings.CutPrefix(line, "model name"); ok {
				m.CPUModel = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(rest), ":"))
				break
			}
		}
	}
	conn, err := pgx.Connect(ctx, opts.DatabaseURL)
	if err != nil {
		return m, fmt.Errorf("connect to %s: %w", redact(opts.DatabaseURL), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var version, syncCommit, fsync, sharedBuffers string
	err = conn.QueryRow(ctx, `SELECT current_setting('server_version'), current_setting('synchronous_commit'),
		current_setting('fsync'), current_setting('shared_buffers')`).Scan(&version, &syncCommit, &fsync, &sharedBuffers)
	if err != nil {
		return m, fmt.Errorf("read Postgres settings: %w", err)
	}
	m.Postgres = "PostgreSQL " + version
	m.PGSettings = fmt.Sprintf("synchronous_commit=%s fsync=%s shared_buffers=%s", syncCommit, fsync, sharedBuffers)
	if syncCommit != "on" || fsync != "on" {
		fmt.Fprintf(os.Stderr, "bench: warning: Postgres runs with %s; commits are not durable and the numbers flatter every scenario\n", m.PGSettings)
	}
	return m, nil
}

func optionsMap(o Options) map[string]any {
	return map[string]any{
		"n": o.N, "scenarios": o.Scenarios, "workers": o.Workers, "batch": o.BatchSize,
		"concurrency": o.Concurrency, "relay_batch": o.RelayBatch, "enqueue_batch": o.EnqueueBatch,
		"producers": o.Producers, "rate": o.Rate, "rate_batch": o.RateBatch, "dup_drop": o.DupDrop,
		"dup_ack_wait": o.DupAckWait.String(), "sync_always": o.SyncAlways, "inprocess": o.InProcess,
		"pg_plan_cache_mode": o.PlanCache, "durability_batch": o.DurabilityBatch,
		"http_clients": o.HTTPClients, "http_rate": o.HTTPRate, "http_rate_n": o.HTTPRateN,
	}
}
