// Package report holds the benchmark's results: the rows scenarios produce, the
// ratios and targets computed from them, the table printed on stdout and the JSON
// document. Everything here is pure: no database, no broker.
//
// The JSON names are a contract (scripts read scenario, rate_per_s and the
// ratios): TestReportJSONShape pins them.
package report

import (
	"github.com/idemkit/idem/cmd/bench/internal/measure"
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

// Ledger is what ledger_entries holds at the end of a scenario.
type Ledger struct {
	Rows int `json:"rows"`
	Keys int `json:"distinct_keys"`
}

// SetMeasurement fills the row's time, rate (intents over the measured phase) and
// CPU from m.
func (r *Result) SetMeasurement(m measure.Measurement, intents int) {
	r.Seconds = m.Elapsed.Seconds()
	r.Rate = measure.Rate(intents, m.Elapsed)
	r.ProcCPUSec = m.ProcCPU.Seconds()
	r.PGCPUSec = m.PGCPU.Seconds()
}

// SetLatency fills the row's latency columns.
func (r *Result) SetLatency(l measure.Latency) {
	r.P50ms, r.P99ms, r.MaxMs = measure.Ms(l.P50), measure.Ms(l.P99), measure.Ms(l.Max)
}
