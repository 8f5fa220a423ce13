package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Result is one row of the table.
type Result struct {
	Scenario string `json:"scenario"`
	// Row is the table label (a scenario may report several rows).
	Row string `json:"row"`
	N   int    `json:"n"`
	// Messages is how many messages went through the broker (2N for e2e-dup).
	Messages int     `json:"messages"`
	Seconds  float64 `json:"seconds"`
	// Rate is intents per second (messages per second for relay).
	Rate float64 `json:"rate_per_s"`
	// Latencies (ms), for rows that measure them.
	P50ms float64 `json:"p50_ms,omitempty"`
	P99ms float64 `json:"p99_ms,omitempty"`
	MaxMs float64 `json:"max_ms,omitempty"`
	// CPU seconds during the timed phase: this process (Go and the embedded broker)
	// and the Postgres backends of the scenario's database.
	ProcCPUSec float64 `json:"proc_cpu_s"`
	PGCPUSec   float64 `json:"pg_cpu_s"`
	// PeakRSS is the VmHWM of the process that ran the scenario, in bytes.
	PeakRSS  int64          `json:"peak_rss_bytes"`
	Ledger   *Ledger        `json:"ledger,omitempty"`
	Verified string         `json:"verified"`
	Config   map[string]any `json:"config,omitempty"`
	Notes    []string       `json:"notes,omitempty"`
}

func (r *Result) setMeasurement(m Measurement, intents int) {
	r.Seconds = m.Elapsed.Seconds()
	r.Rate = float64(intents) / m.Elapsed.Seconds()
	r.ProcCPUSec = m.ProcCPU.Seconds()
	r.PGCPUSec = m.PGCPU.Seconds()
}

// Report is the JSON document.
type Report struct {
	Date     string             `json:"date"`
	Command  string             `json:"command"`
	Machine  Machine            `json:"machine"`
	Options  map[string]any     `json:"options"`
	Results  []Result           `json:"results"`
	Ratios   map[string]float64 `json:"ratios"`
	Targets  []Target           `json:"targets"`
	Failures []string           `json:"failures,omitempty"`
}

// Target is one of the goals, checked.
type Target struct {
	Name     string  `json:"name"`
	Want     string  `json:"want"`
	Got      float64 `json:"got"`
	Met      bool    `json:"met"`
	Measured bool    `json:"measured"`
}

func find(rs []Result, row string) *Result {
	return findFunc(rs, func(r Result) bool { return r.Row == row })
}

// rowIs matches a row by its label, with or without a parenthesised suffix such as
// " (100 intents per transaction)".
func rowIs(label string) func(Result) bool {
	return func(r Result) bool { return r.Row == label || strings.HasPrefix(r.Row, label+" (") }
}

func findFunc(rs []Result, f func(Result) bool) *Result {
	i := slices.IndexFunc(rs, f)
	if i < 0 {
		return nil
	}
	return &rs[i]
}

func ratiosAndTargets(rs []Result) (map[string]float64, []Target) {
	ratios := map[string]float64{}
	idemR, naive, inbox := find(rs, scConsumer), find(rs, scNaive), find(rs, scInbox)
	if idemR != nil && naive != nil {
		ratios["idem-consumer/naive"] = idemR.Rate / naive.Rate
	}
	if idemR != nil && inbox != nil {
		ratios["idem-consumer/handwritten-inbox"] = idemR.Rate / inbox.Rate
	}
	if rec, fsync := findFunc(rs, rowIs(rowReconciled)), findFunc(rs, rowIs(rowFsyncAlways)); rec != nil && fsync != nil {
		ratios["e2e default fsync + reconciler/fsync always"] = rec.Rate / fsync.Rate
	}
	if atomic, fsync := findFunc(rs, rowIs(rowFsyncAtomic)), findFunc(rs, rowIs(rowFsyncAlways)); atomic != nil && fsync != nil {
		ratios["e2e fsync always, atomic batch publish/fsync always"] = atomic.Rate / fsync.Rate
	}
	if rec, fsync := findFunc(rs, rowIs(rowReconciled)), findFunc(rs, rowIs(rowFsyncReconciled)); rec != nil && fsync != nil {
		ratios["e2e default fsync + reconciler/fsync always + reconciler"] = rec.Rate / fsync.Rate
	}
	if rec, unproven := findFunc(rs, rowIs(rowReconciled)), findFunc(rs, rowIs(rowUnproven)); rec != nil && unproven != nil {
		ratios["e2e default fsync + reconciler/no reconciler"] = rec.Rate / unproven.Rate
	}
	if e, p := find(rs, scE2EHTTP+" (max)"), find(rs, scPlainHTTP+" (max)"); e != nil && p != nil {
		ratios["e2e-http/plain-http"] = e.Rate / p.Rate
	}
	if e, w := find(rs, scE2EHTTP+" (max)"), find(rs, scWatermillHTTP+" (max)"); e != nil && w != nil {
		ratios["e2e-http/watermill-http"] = e.Rate / w.Rate
	}
	var ts []Target
	ratio := func(name string, want float64) {
		got, ok := ratios[name]
		ts = append(ts, Target{Name: name, Want: fmt.Sprintf(">= %gx", want), Got: got, Met: ok && got >= want, Measured: ok})
	}
	ratio("e2e-http/plain-http", 0.8)
	ratio("e2e-http/watermill-http", 3)
	t := Target{Name: "e2e-http p99 latency ms at the offered load", Want: "<= 10"}
	if lat := findFunc(rs, func(r Result) bool { return strings.HasPrefix(r.Row, scE2EHTTP+" @") }); lat != nil {
		t.Got, t.Met, t.Measured = lat.P99ms, lat.P99ms <= 10, true
	}
	ts = append(ts, t)
	ratio("idem-consumer/naive", 3)
	ratio("idem-consumer/handwritten-inbox", 5)
	e2e := find(rs, rowE2EMax)
	lat := findFunc(rs, func(r Result) bool { return strings.HasPrefix(r.Row, rowE2ERatePref) })
	t = Target{Name: "e2e batched intents/s (default durability)", Want: ">= 20000"}
	if e2e != nil {
		t.Got, t.Met, t.Measured = e2e.Rate, e2e.Rate >= 20000, true
	}
	ts = append(ts, t)
	t = Target{Name: "e2e p99 latency ms at the offered load", Want: "<= 50"}
	if lat != nil {
		t.Got, t.Met, t.Measured = lat.P99ms, lat.P99ms <= 50, true
	}
	ts = append(ts, t)
	return ratios, ts
}

func printTable(w io.Writer, rep Report) {
	fmt.Fprintf(w, "\nidem benchmark — %s\n", rep.Date)
	m := rep.Machine
	fmt.Fprintf(w, "machine: %d CPUs, %s memory, %s, %s, nats-server %s (embedded, SyncAlways=%v)\n\n",
		m.NumCPU, m.Memory, m.GoVersion, m.Postgres, m.NATSServer, m.SyncAlways)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\tN\tmessages\tseconds\trate/s\tp50 ms\tp99 ms\tbench CPU µs/intent\tpg CPU µs/intent\tpeak RSS MiB\tledger rows/keys\tverified\t")
	for _, r := range rep.Results {
		lat50, lat99 := "-", "-"
		if r.P99ms > 0 {
			lat50, lat99 = fmt.Sprintf("%.1f", r.P50ms), fmt.Sprintf("%.1f", r.P99ms)
		}
		ledger := "-"
		if r.Ledger != nil {
			ledger = fmt.Sprintf("%d/%d", r.Ledger.Rows, r.Ledger.Keys)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.2f\t%.0f\t%s\t%s\t%.0f\t%.0f\t%.0f\t%s\t%s\t\n",
			r.Row, r.N, r.Messages, r.Seconds, r.Rate, lat50, lat99,
			1e6*r.ProcCPUSec/float64(r.N), 1e6*r.PGCPUSec/float64(r.N),
			float64(r.PeakRSS)/(1<<20), ledger, r.Verified)
	}
	tw.Flush()
	fmt.Fprintln(w)
	for _, name := range []string{"e2e-http/plain-http", "idem-consumer/naive", "idem-consumer/handwritten-inbox", "e2e default fsync + reconciler/fsync always",
		"e2e default fsync + reconciler/fsync always + reconciler", "e2e default fsync + reconciler/no reconciler",
		"e2e fsync always, atomic batch publish/fsync always"} {
		if v, ok := rep.Ratios[name]; ok {
			fmt.Fprintf(w, "ratio %-46s %.2fx\n", name, v)
		}
	}
	fmt.Fprintln(w)
	for _, t := range rep.Targets {
		status := "not measured"
		if t.Measured {
			status = "MISSED"
			if t.Met {
				status = "met"
			}
		}
		fmt.Fprintf(w, "target %-40s %-9s got %-10.2f %s\n", t.Name, t.Want, t.Got, status)
	}
	for _, r := range rep.Results {
		for _, n := range r.Notes {
			fmt.Fprintf(w, "note [%s] %s\n", r.Row, n)
		}
	}
	for _, f := range rep.Failures {
		fmt.Fprintf(w, "FAILED %s\n", f)
	}
}

func writeJSON(path string, rep Report) error {
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return fmt.Errorf("encode results: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("write results: %w", err)
	}
	return nil
}

// percentile returns the p-th percentile (0..100) of sorted durations, nearest rank.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p/100*float64(len(sorted))+0.5) - 1
	i = max(0, min(i, len(sorted)-1))
	return sorted[i]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func commandLine() string { return strings.Join(os.Args, " ") }
