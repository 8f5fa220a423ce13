// Command watermill is the peer of idem's e2e-http benchmark scenario: the same
// HTTP shape, built the way a Watermill user builds it (see pipeline.go):
//
//	POST /v1/payments -> one Postgres transaction: the payments row, and a message
//	    published with watermill-sql's Publisher bound to that transaction, wrapped
//	    by the forwarder's Publisher -> commit -> 202
//	forwarder (components/forwarder): watermill-sql Subscriber -> watermill-nats
//	    JetStream Publisher
//	Router: watermill-nats JetStream Subscriber -> middleware.Deduplicator keyed on
//	    the idempotency key -> one ledger_entries row per message
//
// It is a module of its own so that Watermill's dependencies stay out of idem's
// go.mod. cmd/bench runs it (scenario watermill-http) and decodes the JSON array
// of rows (cmd/bench's report.Result) it prints on stdout; progress goes to
// stderr. The measurements are cmd/bench's own (package measure), so the rows
// compare.
//
//	go run . -database-url postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable \
//	    -n 10000 -clients 32 -rate 1000 -rate-n 10000 -timeout 2m
//
// Like e2e-http it runs two phases, each on a fresh database (the test kit's)
// and a fresh embedded JetStream server: "watermill-http (max)", -n requests from
// -clients keep-alive clients as fast as they go, and "watermill-http @<rate>/s",
// min(-rate-n, -n) requests offered open loop at -rate requests/s. Latency is
// request sent -> ledger row committed; throughput is requests over first request
// sent -> last ledger row committed; CPU is this process's (the Go code and the
// embedded broker) and that of the Postgres backends of the phase's database.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

const scenario = "watermill-http"

// options are the command-line flags (the names cmd/bench passes).
type options struct {
	databaseURL string
	n           int
	clients     int
	rate        int
	rateN       int
	timeout     time.Duration
	keep        bool
	subscribers int
	// pollInterval is watermill-sql's SubscriberConfig.PollInterval (0: its
	// default, 1s).
	pollInterval time.Duration
	verbose      bool
}

func parseFlags(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("watermill", flag.ContinueOnError)
	fs.StringVar(&o.databaseURL, "database-url", envOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"), "Postgres server to create the benchmark databases on")
	fs.IntVar(&o.n, "n", 10000, "requests in the max phase (and the most the rate phase sends)")
	fs.IntVar(&o.clients, "clients", 32, "keep-alive clients in the max phase")
	fs.IntVar(&o.rate, "rate", 1000, "offered requests/s in the latency phase (open loop)")
	fs.IntVar(&o.rateN, "rate-n", 10000, "requests in the latency phase (at most -n)")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "give up on a phase whose ledger rows are not all committed this long after the last response")
	fs.BoolVar(&o.keep, "keep", false, "keep each phase's database (and print its name) instead of dropping it")
	fs.IntVar(&o.subscribers, "subscribers", 1, "watermill-nats SubscribersCount of the router's subscriber (1 is Watermill's default)")
	fs.DurationVar(&o.pollInterval, "poll-interval", 0, "watermill-sql SubscriberConfig.PollInterval of the forwarder's subscriber (0: Watermill's default, 1s)")
	fs.BoolVar(&o.verbose, "v", false, "log Watermill's info messages to stderr (default: errors only)")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if o.n <= 0 || o.clients <= 0 || o.rate <= 0 || o.rateN <= 0 || o.subscribers <= 0 || o.timeout <= 0 || o.pollInterval < 0 {
		return o, errors.New("-n, -clients, -rate, -rate-n, -subscribers and -timeout must be positive, -poll-interval not negative")
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
		fmt.Fprintln(os.Stderr, "watermill-http:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	level := slog.LevelError
	if opts.verbose {
		level = slog.LevelInfo
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	results, err := run(ctx, opts, log)
	if err != nil {
		fmt.Fprintln(os.Stderr, "watermill-http: FAILED:", err)
		os.Exit(1)
	}
	rss, err := measure.PeakRSS()
	if err != nil {
		fmt.Fprintln(os.Stderr, "watermill-http:", err)
		os.Exit(1)
	}
	for i := range results {
		results[i].PeakRSS = rss
	}
	if err := json.NewEncoder(os.Stdout).Encode(results); err != nil {
		fmt.Fprintln(os.Stderr, "watermill-http:", err)
		os.Exit(1)
	}
}

// run runs the max phase and the rate phase, each on a fresh environment.
func run(ctx context.Context, opts options, log *slog.Logger) ([]report.Result, error) {
	versions := moduleVersions()
	fmt.Fprintf(os.Stderr, "watermill-http: watermill %s, watermill-sql %s, watermill-nats %s, nats-server v%s (embedded, default sync)\n",
		versions["watermill"], versions["watermill_sql"], versions["watermill_nats"], server.VERSION)
	var results []report.Result
	for _, phase := range []struct {
		row  string
		rate int
		n    int
	}{
		{scenario + " (max)", 0, opts.n},
		{fmt.Sprintf("%s @%d/s", scenario, opts.rate), opts.rate, min(opts.rateN, opts.n)},
	} {
		r, err := runPhase(ctx, opts, log, phase.row, phase.n, phase.rate)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", phase.row, err)
		}
		cfg := map[string]any{
			"clients":                opts.clients,
			"rate":                   phase.rate,
			"one_intent_per_request": true,
			"nats_subscribers":       opts.subscribers,
			"sql_poll_interval":      pollInterval(opts).String(),
			"nats_server":            "v" + server.VERSION,
		}
		for k, v := range versions {
			cfg[k] = v
		}
		r.Config = cfg
		results = append(results, r)
	}
	return results, nil
}

// moduleVersions reads the versions of the Watermill modules (and pgx) this
// binary was built with.
func moduleVersions() map[string]string {
	out := map[string]string{"watermill": "unknown", "watermill_sql": "unknown", "watermill_nats": "unknown", "pgx": "unknown"}
	names := map[string]string{
		"github.com/ThreeDotsLabs/watermill":         "watermill",
		"github.com/ThreeDotsLabs/watermill-sql/v4":  "watermill_sql",
		"github.com/ThreeDotsLabs/watermill-nats/v2": "watermill_nats",
		"github.com/jackc/pgx/v5":                    "pgx",
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if name, ok := names[d.Path]; ok {
				out[name] = d.Version
			}
		}
	}
	return out
}

// runPhase runs one phase on a fresh environment.
func runPhase(ctx context.Context, opts options, log *slog.Logger, row string, n, rate int) (report.Result, error) {
	// As cmd/bench sizes the e2e-http pool: the clients, plus room for the
	// forwarder, the router and the meter.
	e, err := newEnv(ctx, row, opts.databaseURL, int32(opts.clients+8+4), opts.keep)
	if err != nil {
		return report.Result{}, err
	}
	defer e.close(context.WithoutCancel(ctx))
	return measurePhase(ctx, e, opts, log, row, n, rate)
}

// pollInterval is the forwarder subscriber's effective PollInterval.
func pollInterval(o options) time.Duration {
	if o.pollInterval == 0 {
		return time.Second // watermill-sql's default (SubscriberConfig.setDefaults)
	}
	return o.pollInterval
}
