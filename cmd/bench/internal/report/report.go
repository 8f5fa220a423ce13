package report

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"text/tabwriter"

	"github.com/idemkit/idem/cmd/bench/internal/measure"
)

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

// New assembles the report of results, with their ratios and targets.
func New(date, command string, m Machine, options map[string]any, results []Result, failures []string) Report {
	ratios := Ratios(results)
	return Report{
		Date: date, Command: command, Machine: m, Options: options, Results: results,
		Ratios: ratios, Targets: Targets(results, ratios), Failures: failures,
	}
}

// WriteJSON writes rep, indented, to path.
func WriteJSON(path string, rep Report) error {
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return fmt.Errorf("encode results: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("write results: %w", err)
	}
	return nil
}

// PrintTable writes the human-readable form of rep: the rows, the ratios, the
// targets, every row's notes and the failures.
func PrintTable(w io.Writer, rep Report) {
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
			measure.PerIntentMicros(r.ProcCPUSec, r.N), measure.PerIntentMicros(r.PGCPUSec, r.N),
			float64(r.PeakRSS)/(1<<20), ledger, r.Verified)
	}
	tw.Flush()
	fmt.Fprintln(w)
	for _, name := range RatioNames() {
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
