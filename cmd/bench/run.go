package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/cmd/bench/internal/report"
	"github.com/idemkit/idem/cmd/bench/internal/scenario"
)

// runParent runs each scenario in a child process (or in this one, -inprocess),
// one after another, then prints the table and writes the JSON.
func runParent(ctx context.Context, cfg config, log *slog.Logger) error {
	machine, err := describeMachine(ctx, cfg)
	if err != nil {
		return err
	}
	isolation := "one child process per scenario"
	if cfg.InProcess {
		isolation = "every scenario in this process"
	}
	fmt.Fprintf(os.Stderr, "bench: N=%d, scenarios %s, embedded JetStream SyncAlways=%v, %s\n",
		cfg.N, strings.Join(cfg.Scenarios, ","), cfg.SyncAlways, isolation)
	started := time.Now()
	var results []report.Result
	var failures []string
	for _, name := range cfg.Scenarios {
		fmt.Fprintf(os.Stderr, "== %s\n", name)
		var rs []report.Result
		if cfg.InProcess {
			rs, err = runOne(ctx, cfg, name, log)
			if err == nil {
				rss, _ := measure.PeakRSS()
				for i := range rs {
					rs[i].PeakRSS = rss
				}
			}
		} else {
			rs, err = spawn(ctx, name)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "== %s FAILED: %v\n", name, err)
			failures = append(failures, fmt.Sprintf("%s: %v", name, err))
			if ctx.Err() != nil {
				break
			}
			continue
		}
		results = append(results, rs...)
	}
	fmt.Fprintf(os.Stderr, "bench: done in %s\n", time.Since(started).Round(time.Second))

	rep := report.New(started.UTC().Format(time.RFC3339), strings.Join(os.Args, " "), machine, optionsMap(cfg), results, failures)
	report.PrintTable(os.Stdout, rep)
	if cfg.JSONPath != "" {
		if err := report.WriteJSON(cfg.JSONPath, rep); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "bench: results written to %s\n", cfg.JSONPath)
	}
	if len(failures) > 0 {
		return fmt.Errorf("%d scenario(s) failed", len(failures))
	}
	return nil
}

// spawn runs one scenario in a child process of this binary and reads its results
// from the child's stdout. The child's stderr (progress) passes through.
func spawn(ctx context.Context, name string) ([]report.Result, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find own executable: %w", err)
	}
	args := append(append([]string{}, os.Args[1:]...), "-child", name)
	cmd := exec.CommandContext(ctx, exe, args...)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, os.Stderr
	// On interrupt, let the child drop its database.
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 30 * time.Second
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("child process: %w", err)
	}
	var rs []report.Result
	if err := json.Unmarshal(stdout.Bytes(), &rs); err != nil {
		return nil, fmt.Errorf("child process: decode results: %w", err)
	}
	return rs, nil
}

// runChild runs cfg.child and prints its results, with the process's peak RSS, as
// JSON on stdout.
func runChild(ctx context.Context, cfg config, log *slog.Logger) error {
	rs, err := runOne(ctx, cfg, cfg.child, log)
	if err != nil {
		return err
	}
	rss, err := measure.PeakRSS()
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

// runOne runs the scenario called name.
func runOne(ctx context.Context, cfg config, name string, log *slog.Logger) ([]report.Result, error) {
	s, err := scenario.Lookup(name)
	if err != nil {
		return nil, err
	}
	return scenario.Run(ctx, s, &scenario.Harness{Opts: cfg.Options, Log: log})
}

// describeMachine reads where the numbers are taken: this machine, and the
// Postgres server's version and durability settings.
func describeMachine(ctx context.Context, cfg config) (report.Machine, error) {
	m := report.Machine{
		NumCPU:     runtime.NumCPU(),
		GoVersion:  runtime.Version(),
		NATSServer: "v" + server.VERSION,
		SyncAlways: cfg.SyncAlways,
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		if kb, err := measure.ParseKB(b, "MemTotal"); err == nil {
			m.Memory = fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20))
		}
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		m.CPUModel = measure.CPUModel(b)
	}
	conn, err := pgx.Connect(ctx, cfg.DatabaseURL)
	if err != nil {
		return m, fmt.Errorf("connect to %s: %w", redact(cfg.DatabaseURL), err)
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

func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparseable URL)"
	}
	return u.Redacted()
}

// optionsMap is the JSON's "options": the knobs of the run, by their JSON names.
func optionsMap(c config) map[string]any {
	return map[string]any{
		"n": c.N, "scenarios": c.Scenarios, "workers": c.Workers, "batch": c.BatchSize,
		"concurrency": c.Concurrency, "relay_batch": c.RelayBatch, "enqueue_batch": c.EnqueueBatch,
		"producers": c.Producers, "rate": c.Rate, "rate_batch": c.RateBatch, "dup_drop": c.DupDrop,
		"dup_ack_wait": c.DupAckWait.String(), "sync_always": c.SyncAlways, "inprocess": c.InProcess,
		"pg_plan_cache_mode": c.PlanCache, "durability_batch": c.DurabilityBatch,
		"http_clients": c.HTTPClients, "http_rate": c.HTTPRate, "http_rate_n": c.HTTPRateN,
	}
}
