// Command bench measures idem against baselines in one run on one machine.
//
//	go run ./cmd/bench                      # every scenario, N=20000
//	go run ./cmd/bench -scenarios idem-consumer,naive -n 50000
//
// Each scenario runs in a child process of this same binary (so its peak RSS is its
// own), against a fresh database (idem_bench_<random>, migrated with
// migrations.Apply and refapp.Migrate, dropped afterwards unless -keep) and a fresh
// embedded JetStream server with the reference application's stream. Scenarios run one after another; the parent prints a table on stdout and
// writes every number as JSON (-json). Progress goes to stderr.
//
// Scenarios:
//
//	naive              JetStream pull consumer, one autocommit INSERT per message, ack (no dedupe)
//	handwritten-inbox  one transaction per message: inbox INSERT ... ON CONFLICT DO NOTHING, ledger row, commit, ack
//	idem-consumer      consumer.Consumer + refapp.ChargeHandler over a pre-filled stream
//	relay              N outbox rows (Outbox.Enqueue) relayed to JetStream by outbox.Relay
//	e2e                payments + Outbox.Enqueue -> relay -> JetStream -> idem consumer -> ledger:
//	                   max sustained intents/s, and latency p50/p99 at a fixed offered load
//	e2e-dup            e2e with every message published twice and a fraction of acked batches dropped
//	plain-http         an HTTP server whose handler commits the payment row alone, one request per
//	                   intent: the floor of "one commit per request"
//	e2e-http           the reference application as `go run ./cmd/worker` runs it (ingress, relay,
//	                   reconciler, consumer), one intent per HTTP request from keep-alive clients;
//	                   latency is request sent -> ledger row committed
//	e2e-durability     e2e (max) twice: JetStream fsyncing every write, and JetStream at its default
//	                   sync interval with the reconciler proving every intent settled (-sync-always
//	                   does not apply)
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"time"
)

// Scenario names, in the order they run.
const (
	scNaive    = "naive"
	scInbox    = "handwritten-inbox"
	scConsumer = "idem-consumer"
	scRelay    = "relay"
	scE2E      = "e2e"
	scE2EDup   = "e2e-dup"
	// scE2EDurability compares the broker's fsync with the reconciler.
	scE2EDurability = "e2e-durability"
	// scE2EHTTP and scPlainHTTP go through a real HTTP server, one intent per
	// request: the reference application as the worker runs it, and the floor of
	// one plain commit per request.
	scE2EHTTP   = "e2e-http"
	scPlainHTTP = "plain-http"
	// scWatermillHTTP is the peer: the same HTTP shape built with Watermill
	// (watermill-sql publisher in the request transaction, its forwarder to
	// JetStream, a router with its Deduplicator). It is a nested module
	// (Options.WatermillDir), so Watermill's dependencies stay out of idem's go.mod.
	scWatermillHTTP = "watermill-http"
)

var allScenarios = []string{scNaive, scInbox, scConsumer, scRelay, scE2E, scE2EDup, scE2EDurability, scE2EOrdered, scPlainHTTP, scE2EHTTP, scWatermillHTTP, scPublishBatch}

// Options are the command-line flags.
type Options struct {
	N            int
	Scenarios    []string
	JSONPath     string
	DatabaseURL  string
	CPUProfile   string
	Keep         bool
	SyncAlways   bool
	InProcess    bool
	Timeout      time.Duration
	Verbose      bool
	TraceSQL     bool
	PlanCache    string
	Workers      int     // baseline consumers' goroutines (and connections)
	BatchSize    int     // idem consumer batch size
	Concurrency  int     // idem consumer batches in flight
	RelayBatch   int     // relay batch size
	EnqueueBatch int     // intents per producer transaction (e2e) and per outbox pre-fill transaction (relay)
	Producers    int     // producer goroutines in the e2e max-throughput phase
	Rate         int     // offered load of the e2e latency phase, intents/s
	RateBatch    int     // intents per producer transaction in the latency phase
	DupDrop      float64 // fraction of committed batches whose acks e2e-dup drops
	DupAckWait   time.Duration
	PayloadBytes int // e2e: each message's payload size (0: a small charge)
	// DurabilityBatch: e2e-durability's intents per producer transaction.
	DurabilityBatch int
	HTTPClients     int // HTTP scenarios: keep-alive clients of the max phase
	HTTPRate        int // HTTP scenarios: offered requests/s of the latency phase
	HTTPRateN       int // HTTP scenarios: requests of the latency phase
	WatermillDir    string

	child string // set in a child process: the one scenario to run
}

func parseFlags(args []string) (Options, error) {
	var o Options
	var scenarios string
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.IntVar(&o.N, "n", 20000, "intents (messages) per scenario")
	fs.StringVar(&scenarios, "scenarios", strings.Join(allScenarios, ","), "comma-separated scenarios to run: "+strings.Join(allScenarios, ", "))
	fs.StringVar(&o.JSONPath, "json", "bench-results.json", "write results as JSON to this path (empty: do not)")
	fs.StringVar(&o.DatabaseURL, "database-url", envOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"), "Postgres server to create the benchmark databases on")
	fs.StringVar(&o.CPUProfile, "cpuprofile", "", "write a CPU profile of each scenario's timed phase to PATH with the scenario name inserted before the extension")
	fs.BoolVar(&o.Keep, "keep", false, "keep each scenario's database (and print its name) instead of dropping it")
	fs.BoolVar(&o.SyncAlways, "sync-always", false, "run the embedded JetStream server with SyncAlways (fsync every write)")
	fs.BoolVar(&o.InProcess, "inprocess", false, "run every scenario in this process instead of one child process each (peak RSS is then cumulative)")
	fs.DurationVar(&o.Timeout, "timeout", 2*time.Minute, "give up on a scenario's timed phase after this long")
	fs.BoolVar(&o.TraceSQL, "trace-sql", false, "print the client-side time spent in each SQL statement during every timed phase")
	fs.StringVar(&o.PlanCache, "pg-plan-cache-mode", "", "set Postgres plan_cache_mode on every connection (auto, force_custom_plan, force_generic_plan); empty: server default")
	fs.BoolVar(&o.Verbose, "v", false, "log the components' warnings (abandoned batches and the like) to stderr")
	fs.IntVar(&o.Workers, "workers", 32, "baseline consumers: goroutines each handling one message at a time, each with its own connection")
	fs.IntVar(&o.BatchSize, "batch", 250, "idem consumer: messages per transaction (consumer.Config.BatchSize)")
	fs.IntVar(&o.Concurrency, "concurrency", 2, "idem consumer: batches in flight (consumer.Config.Concurrency)")
	fs.IntVar(&o.RelayBatch, "relay-batch", 500, "relay: rows claimed and published per transaction (outbox.RelayConfig.BatchSize)")
	fs.IntVar(&o.EnqueueBatch, "enqueue-batch", 100, "intents per producer transaction (one Outbox.Enqueue call)")
	fs.IntVar(&o.Producers, "producers", 2, "e2e max-throughput phase: producer goroutines")
	fs.IntVar(&o.Rate, "rate", 2000, "e2e latency phase: offered load in intents/s")
	fs.IntVar(&o.RateBatch, "rate-batch", 100, "e2e latency phase: intents per producer transaction")
	fs.IntVar(&o.PayloadBytes, "payload-bytes", 0, "e2e: pad each charge's payload to about this many bytes (0: small), to measure memory with large messages")
	fs.IntVar(&o.DurabilityBatch, "durability-batch", 1, "e2e-durability: intents per producer transaction (1, one intent per request, is the shape users run; more is an extra, labelled row)")
	fs.IntVar(&o.HTTPClients, "http-clients", 32, "e2e-http, plain-http, watermill-http: keep-alive clients in the max phase")
	fs.IntVar(&o.HTTPRate, "http-rate", 1000, "e2e-http, plain-http, watermill-http: offered requests/s in the latency phase")
	fs.IntVar(&o.HTTPRateN, "http-rate-n", 10000, "e2e-http, plain-http, watermill-http: requests in the latency phase (at most -n)")
	fs.StringVar(&o.WatermillDir, "watermill-dir", filepath.Join("cmd", "bench", "watermill"), "watermill-http: the peer's module directory (it is run with go run)")
	fs.Float64Var(&o.DupDrop, "dup-drop", 0.10, "e2e-dup: fraction of committed batches whose acks are dropped")
	fs.DurationVar(&o.DupAckWait, "dup-ack-wait", 2*time.Second, "e2e-dup: consumer AckWait (how soon a dropped ack is redelivered)")
	fs.StringVar(&o.child, "child", "", "internal: run one scenario and print its results as JSON on stdout")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	for _, s := range strings.Split(scenarios, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if !slices.Contains(allScenarios, s) {
			return o, fmt.Errorf("unknown scenario %q (have %s)", s, strings.Join(allScenarios, ", "))
		}
		o.Scenarios = append(o.Scenarios, s)
	}
	switch {
	case o.N <= 0:
		return o, errors.New("-n must be positive")
	case o.Workers <= 0, o.BatchSize <= 0, o.Concurrency <= 0, o.RelayBatch <= 0, o.EnqueueBatch <= 0, o.Producers <= 0, o.RateBatch <= 0, o.DurabilityBatch <= 0, o.HTTPClients <= 0, o.HTTPRate <= 0, o.HTTPRateN <= 0:
		return o, errors.New("-workers, -batch, -concurrency, -relay-batch, -enqueue-batch, -producers, -rate-batch, -durability-batch and the -http- flags must be positive")
	case o.Rate <= 0:
		return o, errors.New("-rate must be positive")
	case o.DupDrop < 0 || o.DupDrop >= 1:
		return o, errors.New("-dup-drop must be in [0, 1)")
	}
	return o, nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func main() {
	opts, err := parseFlags(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	level := slog.LevelError
	if opts.Verbose {
		level = slog.LevelWarn
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	if opts.child != "" {
		err = runChild(ctx, opts, log)
	} else {
		err = runParent(ctx, opts, log)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// profilePath inserts the scenario name before path's extension.
func profilePath(path, scenario string) string {
	ext := filepath.Ext(path)
	return strings.TrimSuffix(path, ext) + "." + scenario + ext
}

// startProfile starts a CPU profile written to path with scenario inserted before
// the extension; the returned stop is never nil.
func startProfile(path, scenario string) (stop func(), err error) {
	path = profilePath(path, scenario)
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("cpuprofile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
		fmt.Fprintf(os.Stderr, "[%s] CPU profile written to %s\n", scenario, path)
	}, nil
}
