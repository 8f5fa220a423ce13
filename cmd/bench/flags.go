package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/idemkit/idem/cmd/bench/internal/scenario"
)

// config is the command line: the scenarios' options and the process's own.
type config struct {
	scenario.Options
	// Scenarios are the names to run, in order, checked against the registry.
	Scenarios []string
	JSONPath  string
	InProcess bool
	Verbose   bool

	child string // set in a child process: the one scenario to run
}

// parseFlags reads the command line; -h writes the usage to out.
func parseFlags(args []string, out io.Writer) (config, error) {
	c := config{Options: scenario.DefaultOptions()}
	o := &c.Options
	var scenarios string
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() { usage(fs) }
	fs.IntVar(&o.N, "n", o.N, "intents (messages) per scenario (the HTTP scenarios' rate phases send at most -http-rate-n)")
	fs.StringVar(&scenarios, "scenarios", strings.Join(scenario.Names(), ","), "comma-separated scenarios to run, in the order given (see above)")
	fs.StringVar(&c.JSONPath, "json", "bench-results.json", "write results as JSON to this path (empty: do not)")
	fs.StringVar(&o.DatabaseURL, "database-url", envOr("DATABASE_URL", o.DatabaseURL), "Postgres server to create the benchmark databases on ($DATABASE_URL when set)")
	fs.StringVar(&o.CPUProfile, "cpuprofile", "", "write a CPU profile of each timed phase to PATH with the phase's label inserted before the extension (cpu.pprof: cpu.e2e-max.pprof, ...)")
	fs.BoolVar(&o.Keep, "keep", false, "keep each phase's database (and print its name) instead of dropping it")
	fs.BoolVar(&o.SyncAlways, "sync-always", false, "run the embedded JetStream servers with SyncAlways (fsync every write); e2e-durability and publish-batch run both settings regardless")
	fs.BoolVar(&c.InProcess, "inprocess", false, "run every scenario in this process instead of one child process each (peak RSS is then cumulative)")
	fs.DurationVar(&o.Timeout, "timeout", o.Timeout, "give up on a scenario's timed phase after this long")
	fs.BoolVar(&o.TraceSQL, "trace-sql", false, "print the client-side time spent in each SQL statement during every timed phase")
	fs.StringVar(&o.PlanCache, "pg-plan-cache-mode", "", "set Postgres plan_cache_mode on every connection (auto, force_custom_plan, force_generic_plan); empty: server default")
	fs.BoolVar(&c.Verbose, "v", false, "log the components' warnings (abandoned batches and the like) to stderr")
	fs.IntVar(&o.Workers, "workers", o.Workers, "naive, handwritten-inbox: goroutines each handling one message at a time, each with its own connection")
	fs.IntVar(&o.BatchSize, "batch", o.BatchSize, "idem-consumer and the e2e scenarios: the idem consumer's messages per transaction")
	fs.IntVar(&o.Concurrency, "concurrency", o.Concurrency, "idem-consumer and the e2e scenarios: the idem consumer's batches in flight")
	fs.IntVar(&o.RelayBatch, "relay-batch", o.RelayBatch, "relay, the e2e scenarios, e2e-ordered: rows the relay claims and publishes per transaction; publish-batch: messages per batch")
	fs.IntVar(&o.EnqueueBatch, "enqueue-batch", o.EnqueueBatch, "e2e (max), e2e-dup: intents per producer transaction (one Outbox.Enqueue call)")
	fs.IntVar(&o.Producers, "producers", o.Producers, "e2e (max), e2e-dup: producer goroutines")
	fs.IntVar(&o.Rate, "rate", o.Rate, "e2e latency phase: offered load in intents/s")
	fs.IntVar(&o.RateBatch, "rate-batch", o.RateBatch, "e2e latency phase: intents per producer transaction")
	fs.IntVar(&o.PayloadBytes, "payload-bytes", 0, "e2e, e2e-dup, e2e-durability: pad each charge's payload to about this many bytes (0: small), to measure memory with large messages")
	fs.IntVar(&o.DurabilityBatch, "durability-batch", o.DurabilityBatch, "e2e-durability: intents per producer transaction (1, one intent per request, is the shape users run; more labels every row with it)")
	fs.IntVar(&o.HTTPClients, "http-clients", o.HTTPClients, "plain-http, e2e-http, watermill-http: keep-alive clients in the max phase")
	fs.IntVar(&o.HTTPRate, "http-rate", o.HTTPRate, "plain-http, e2e-http, watermill-http: offered requests/s in the latency phase")
	fs.IntVar(&o.HTTPRateN, "http-rate-n", o.HTTPRateN, "plain-http, e2e-http, watermill-http: requests in the latency phase (at most -n)")
	fs.StringVar(&o.WatermillDir, "watermill-dir", o.WatermillDir, "watermill-http: the peer's package directory, relative to where the bench runs (built with go build, then run)")
	fs.Float64Var(&o.DupDrop, "dup-drop", o.DupDrop, "e2e-dup: fraction of committed batches whose acks are dropped")
	fs.DurationVar(&o.DupAckWait, "dup-ack-wait", o.DupAckWait, "e2e-dup: consumer AckWait (how soon a dropped ack is redelivered)")
	fs.StringVar(&o.Relay, "relay", "", "idem's relay in relay, e2e, e2e-dup, e2e-durability and e2e-http: log, poll, or empty for what the worker chooses (log where wal_level = logical and the role may replicate); atomic publish and ordered subjects always poll")
	fs.StringVar(&c.child, "child", "", "internal: run one scenario and print its results as JSON on stdout")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	switch o.Relay {
	case "", "log", "poll":
	default:
		return c, fmt.Errorf("-relay %q: want log, poll or empty", o.Relay)
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected argument %q (flags only; see -h)", fs.Arg(0))
	}
	var err error
	if c.Scenarios, err = scenario.Parse(scenarios); err != nil {
		return c, fmt.Errorf("-scenarios: %w", err)
	}
	if c.child != "" {
		if _, err := scenario.Lookup(c.child); err != nil {
			return c, fmt.Errorf("-child: %w", err)
		}
	}
	return c, c.Options.Validate()
}

// usage writes the command's help: what it does, the scenarios from the
// registry, and the flags.
func usage(fs *flag.FlagSet) {
	w := fs.Output()
	fmt.Fprint(w, `Usage: go run ./cmd/bench [flags]   (from the repository root; make bench)

Measures idem against baselines in one run: each scenario in a child process,
each phase on a fresh database and embedded JetStream server. Prints a table on
stdout, writes the JSON to -json, progress on stderr.

Scenarios (-scenarios; all of them by default, in this order):
`)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, s := range scenario.All() {
		fmt.Fprintf(tw, "  %s\t%s\n", s.Name(), s.Summary())
	}
	tw.Flush()
	fmt.Fprint(w, "\nFlags:\n")
	fs.PrintDefaults()
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
