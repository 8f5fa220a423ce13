package report

import (
	"bytes"
	"encoding/json"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/cmd/bench/internal/measure"
)

func TestRowMatch(t *testing.T) {
	for _, tc := range []struct {
		m    RowMatch
		row  string
		want bool
	}{
		{RowMatch{Label: "e2e (max)"}, "e2e (max)", true},
		{RowMatch{Label: "e2e"}, "e2e (max)", false},
		{RowMatch{Label: "e2e, fsync always", Kind: Suffixed}, "e2e, fsync always", true},
		{RowMatch{Label: "e2e, fsync always", Kind: Suffixed}, "e2e, fsync always (100 intents per transaction)", true},
		// A longer label that starts with this one is another row.
		{RowMatch{Label: "e2e, fsync always", Kind: Suffixed}, "e2e, fsync always + reconciler", false},
		{RowMatch{Label: "e2e, fsync always", Kind: Suffixed}, "e2e, fsync always, atomic batch publish", false},
		{RowMatch{Label: "e2e @", Kind: Prefix}, "e2e @2000/s", true},
		{RowMatch{Label: "e2e @", Kind: Prefix}, "e2e-http @1000/s", false},
	} {
		if got := tc.m.Matches(tc.row); got != tc.want {
			t.Errorf("%+v.Matches(%q) = %v, want %v", tc.m, tc.row, got, tc.want)
		}
	}
}

func rows(kv ...any) []Result {
	var out []Result
	for i := 0; i < len(kv); i += 2 {
		out = append(out, Result{Row: kv[i].(string), Rate: float64(kv[i+1].(int))})
	}
	return out
}

func TestRatios(t *testing.T) {
	for _, tc := range []struct {
		name string
		rs   []Result
		want map[string]float64
	}{
		{"none", nil, map[string]float64{}},
		{"a row without its partner gives no ratio", rows("idem-consumer", 3000), map[string]float64{}},
		{"consumer against both baselines", rows("naive", 1000, "idem-consumer", 6000, "handwritten-inbox", 500),
			map[string]float64{"idem-consumer/naive": 6, "idem-consumer/handwritten-inbox": 12}},
		{"http max rows, not the rate rows", rows("plain-http (max)", 4000, "plain-http @1000/s", 999, "e2e-http @1000/s", 998, "e2e-http (max)", 2000, "watermill-http (max)", 1000),
			map[string]float64{"e2e-http/plain-http": 0.5, "e2e-http/watermill-http": 2}},
		{"durability rows, with the batch suffix", rows(
			"e2e, fsync always (100 intents per transaction)", 1000,
			"e2e, fsync always, atomic batch publish (100 intents per transaction)", 1500,
			"e2e, fsync always + reconciler (100 intents per transaction)", 800,
			"e2e, default fsync + reconciler (100 intents per transaction)", 4000,
			"e2e, default fsync, no reconciler (not shipped: loses what a broker crash loses) (100 intents per transaction)", 5000),
			map[string]float64{
				"e2e default fsync + reconciler/fsync always":              4,
				"e2e fsync always, atomic batch publish/fsync always":      1.5,
				"e2e default fsync + reconciler/fsync always + reconciler": 5,
				"e2e default fsync + reconciler/no reconciler":             0.8,
			}},
		{"the first matching row counts", rows("naive", 1000, "naive", 10, "idem-consumer", 2000), map[string]float64{"idem-consumer/naive": 2}},
		{"a zero denominator gives no ratio", rows("naive", 0, "idem-consumer", 2000), map[string]float64{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Ratios(tc.rs)
			if len(got) != len(tc.want) {
				t.Fatalf("Ratios = %v, want %v", got, tc.want)
			}
			for k, v := range tc.want {
				if math.Abs(got[k]-v) > 1e-9 {
					t.Errorf("ratio %q = %v, want %v", k, got[k], v)
				}
			}
		})
	}
}

func TestTargets(t *testing.T) {
	rs := []Result{
		{Row: "e2e (max)", Rate: 25000},
		{Row: "e2e @2000/s", Rate: 2000, P99ms: 60},
		{Row: "plain-http (max)", N: 1000, ProcCPUSec: 0.2, PGCPUSec: 0.2},            // 400 µs an intent
		{Row: "e2e-http (max)", N: 1000, ProcCPUSec: 0.4, PGCPUSec: 0.28},             // 680: 1.7x
		{Row: "plain-http @500/s", N: 500, ProcCPUSec: 0.3, PGCPUSec: 0.2, P99ms: 3},  // 1000
		{Row: "e2e-http @500/s", N: 500, ProcCPUSec: 0.7, PGCPUSec: 0.4, P99ms: 10.5}, // 2200: 2.2x
	}
	ratios := map[string]float64{"e2e-http/plain-http": 0.59, "idem-consumer/naive": 3}
	got := Targets(rs, ratios)
	want := []Target{
		{Name: "e2e-http/plain-http", Want: ">= 0.6x", Got: 0.59, Met: false, Measured: true},
		{Name: "e2e-http/watermill-http", Want: ">= 2x"},
		{Name: "e2e-http/plain-http CPU per intent (max)", Want: "<= 1.7x", Got: 0.68 / 0.4, Met: true, Measured: true},
		{Name: "e2e-http/plain-http CPU per intent at the offered load", Want: "<= 2x", Got: (1.1 / 500) / (0.5 / 500), Met: false, Measured: true},
		// plain-http's p99 is 3 ms: the limit is the floor, 10 ms.
		{Name: "e2e-http p99 ms (request -> ledger row) at the offered load", Want: "<= max(2x plain-http p99, 10)", Got: 10.5, Met: false, Measured: true},
		{Name: "idem-consumer/naive", Want: ">= 3x", Got: 3, Met: true, Measured: true},
		{Name: "idem-consumer/handwritten-inbox", Want: ">= 5x"},
		{Name: "e2e batched intents/s (default durability)", Want: ">= 20000", Got: 25000, Met: true, Measured: true},
		{Name: "e2e p99 latency ms at the offered load", Want: "<= 50", Got: 60, Met: false, Measured: true},
	}
	if len(got) != len(want) {
		t.Fatalf("Targets: got %d, want %d:\n%+v", len(got), len(want), got)
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.Name != w.Name || g.Want != w.Want || g.Met != w.Met || g.Measured != w.Measured || math.Abs(g.Got-w.Got) > 1e-9 {
			t.Errorf("target %d:\n got %+v\nwant %+v", i, g, w)
		}
	}
	// plain-http's p99 above 5 ms makes the limit twice it.
	rs[4].P99ms = 6
	if g := Targets(rs, ratios)[4]; !g.Met {
		t.Errorf("p99 10.5 ms against plain-http's 6 ms (limit 12): %+v, want met", g)
	}
}

func TestEveryRatioGoalNamesARatio(t *testing.T) {
	names := RatioNames()
	for _, g := range goals() {
		if g.ratio != "" && !slices.Contains(names, g.ratio) {
			t.Errorf("target %q reads ratio %q, which is never computed", g.name, g.ratio)
		}
		if g.ratio == "" && g.relative == nil && (g.row.Label == "" || g.field == nil) {
			t.Errorf("target %q reads neither a ratio nor a row", g.name)
		}
		if g.relative != nil && len(g.reads) == 0 {
			t.Errorf("target %q compares rows but names none", g.name)
		}
	}
}

func TestSetMeasurement(t *testing.T) {
	var r Result
	r.SetMeasurement(measure.Measurement{Elapsed: 2 * time.Second, ProcCPU: 1500 * time.Millisecond, PGCPU: 250 * time.Millisecond}, 5000)
	if r.Seconds != 2 || r.Rate != 2500 || r.ProcCPUSec != 1.5 || r.PGCPUSec != 0.25 {
		t.Errorf("SetMeasurement gave %+v", r)
	}
	r.SetLatency(measure.Latency{P50: time.Millisecond, P99: 9 * time.Millisecond, Max: 12 * time.Millisecond})
	if r.P50ms != 1 || r.P99ms != 9 || r.MaxMs != 12 {
		t.Errorf("SetLatency gave %+v", r)
	}
}

// keyPaths lists the paths of every value in a decoded JSON document, array
// indexes written as #.
func keyPaths(prefix string, v any, out map[string]bool) {
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			keyPaths(prefix+"."+k, x, out)
		}
	case []any:
		for _, x := range v {
			keyPaths(prefix+".#", x, out)
		}
	default:
		out[strings.TrimPrefix(prefix, ".")] = true
	}
}

// TestReportJSONShape pins the document's names: scripts read them.
func TestReportJSONShape(t *testing.T) {
	results := []Result{
		{Scenario: "e2e", Row: "e2e @2000/s", N: 10, Messages: 10, Seconds: 1, Rate: 10, P50ms: 1, P99ms: 2, MaxMs: 3,
			ProcCPUSec: 0.1, PGCPUSec: 0.2, PeakRSS: 1 << 20, Ledger: &Ledger{Rows: 10, Keys: 10}, Verified: "ok",
			Config: map[string]any{"rate": 2000}, Notes: []string{"a note"}},
		{Scenario: "naive", Row: "naive", Rate: 5},
		{Scenario: "idem-consumer", Row: "idem-consumer", Rate: 20},
	}
	rep := New("2026-12-02T00:00:00Z", "bench -n 10", Machine{NumCPU: 2}, map[string]any{"n": 10}, results, []string{"relay: boom"})
	b, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	var doc any
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	keyPaths("", doc, got)
	want := []string{
		"date", "command",
		"machine.num_cpu", "machine.cpu_model", "machine.memory", "machine.go", "machine.postgres",
		"machine.postgres_settings", "machine.nats_server", "machine.jetstream_sync_always",
		"options.n",
		"results.#.scenario", "results.#.row", "results.#.n", "results.#.messages", "results.#.seconds",
		"results.#.rate_per_s", "results.#.p50_ms", "results.#.p99_ms", "results.#.max_ms",
		"results.#.proc_cpu_s", "results.#.pg_cpu_s", "results.#.peak_rss_bytes",
		"results.#.ledger.rows", "results.#.ledger.distinct_keys", "results.#.verified",
		"results.#.config.rate", "results.#.notes.#",
		"ratios.idem-consumer/naive",
		"targets.#.name", "targets.#.want", "targets.#.got", "targets.#.met", "targets.#.measured",
		"failures.#",
	}
	for _, k := range want {
		if !got[k] {
			t.Errorf("the JSON has no %s", k)
		}
		delete(got, k)
	}
	for k := range got {
		t.Errorf("the JSON has %s, which the contract does not name", k)
	}

	// A row without latencies, ledger, config or notes leaves them out.
	b, err = json.Marshal(Result{Scenario: "relay", Row: "relay"})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"p50_ms", "p99_ms", "max_ms", "ledger", "config", "notes"} {
		if bytes.Contains(b, []byte(`"`+k+`"`)) {
			t.Errorf("an empty row carries %q: %s", k, b)
		}
	}
}

// TestPeerRowDecodes reads a row as the watermill-http peer prints it (its own
// type, every field always present) into Result.
func TestPeerRowDecodes(t *testing.T) {
	line := `[{"scenario":"watermill-http","row":"watermill-http (max)","n":100,"messages":100,"seconds":0.5,"rate_per_s":200,"p50_ms":1.5,"p99_ms":4,"max_ms":5,"proc_cpu_s":0.2,"pg_cpu_s":0.1,"peak_rss_bytes":1048576,"ledger":{"rows":100,"distinct_keys":100},"verified":"ok","config":{"clients":32},"notes":null}]`
	var rs []Result
	if err := json.Unmarshal([]byte(line), &rs); err != nil {
		t.Fatal(err)
	}
	r := rs[0]
	if r.Scenario != "watermill-http" || r.Rate != 200 || r.P99ms != 4 || r.Ledger == nil || r.Ledger.Keys != 100 || r.PeakRSS != 1<<20 {
		t.Errorf("decoded %+v", r)
	}
}

func TestWriteJSONRoundTrips(t *testing.T) {
	rep := New("d", "c", Machine{}, map[string]any{}, []Result{{Scenario: "naive", Row: "naive", Rate: 1}}, nil)
	path := filepath.Join(t.TempDir(), "r.json")
	if err := WriteJSON(path, rep); err != nil {
		t.Fatal(err)
	}
	if err := WriteJSON(filepath.Join(t.TempDir(), "no", "such", "dir.json"), rep); err == nil {
		t.Error("WriteJSON into a missing directory succeeded")
	}
}

func TestPrintTable(t *testing.T) {
	rs := []Result{
		{Scenario: "naive", Row: "naive", N: 2000, Messages: 2000, Seconds: 1, Rate: 2000, ProcCPUSec: 0.3, PGCPUSec: 0.1,
			PeakRSS: 40 << 20, Ledger: &Ledger{Rows: 2001, Keys: 2000}, Verified: "at-least-once: 1 double charges"},
		{Scenario: "idem-consumer", Row: "idem-consumer", N: 2000, Rate: 8000, Verified: "ok", Notes: []string{"drained"}},
		{Scenario: "e2e", Row: "e2e @2000/s", N: 2000, Rate: 2000, P50ms: 8.6, P99ms: 13.3, Verified: "ok"},
	}
	var buf bytes.Buffer
	PrintTable(&buf, New("2026-12-02T00:00:00Z", "bench", Machine{NumCPU: 2}, nil, rs, []string{"relay: boom"}))
	out := buf.String()
	for _, want := range []string{
		"machine: 2 CPUs",
		"2001/2000",   // ledger rows/keys
		"150",         // 0.3 s of CPU over 2000 intents: 150 µs each
		"8.6", "13.3", // the latency row's percentiles
		"ratio idem-consumer/naive", // 4.00x
		"4.00x",
		"target e2e p99 latency ms at the offered load   <= 50     got 13.30      met",
		"met",
		"not measured",
		"note [idem-consumer] drained",
		"FAILED relay: boom",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the table lacks %q:\n%s", want, out)
		}
	}
}
