package report

import (
	"fmt"
	"slices"
	"strings"
)

// RowMatch selects a row of the results by its label.
type RowMatch struct {
	Label string
	Kind  MatchKind
}

// MatchKind is how a RowMatch compares labels.
type MatchKind int

const (
	// Exact matches the label alone.
	Exact MatchKind = iota
	// Suffixed matches the label, or the label followed by a parenthesised suffix
	// such as " (100 intents per transaction)".
	Suffixed
	// Prefix matches every label that starts with Label (the rate phases, whose
	// label carries the offered load: "e2e @2000/s").
	Prefix
)

// Matches reports whether row is selected.
func (m RowMatch) Matches(row string) bool {
	switch m.Kind {
	case Suffixed:
		return row == m.Label || strings.HasPrefix(row, m.Label+" (")
	case Prefix:
		return strings.HasPrefix(row, m.Label)
	default:
		return row == m.Label
	}
}

// Find returns the first result m selects, or nil.
func (m RowMatch) Find(rs []Result) *Result {
	i := slices.IndexFunc(rs, func(r Result) bool { return m.Matches(r.Row) })
	if i < 0 {
		return nil
	}
	return &rs[i]
}

// Row labels the ratios and targets read. The scenarios produce them; the
// scenario package's tests check that every one is produced by a registered
// scenario, so a renamed row cannot silently drop a ratio.
const (
	rowConsumer         = "idem-consumer"
	rowNaive            = "naive"
	rowInbox            = "handwritten-inbox"
	rowE2EMax           = "e2e (max)"
	rowE2ERate          = "e2e @"
	rowFsyncAlways      = "e2e, fsync always"
	rowFsyncAtomic      = "e2e, fsync always, atomic batch publish"
	rowFsyncReconciled  = "e2e, fsync always + reconciler"
	rowReconciled       = "e2e, default fsync + reconciler"
	rowUnproven         = "e2e, default fsync, no reconciler (not shipped: loses what a broker crash loses)"
	rowE2EHTTPMax       = "e2e-http (max)"
	rowE2EHTTPRate      = "e2e-http @"
	rowPlainHTTPMax     = "plain-http (max)"
	rowPlainHTTPRate    = "plain-http @"
	rowWatermillHTTPMax = "watermill-http (max)"
)

// ratio divides the rate of one row by the rate of another.
type ratio struct {
	name     string
	num, den RowMatch
}

// ratios lists the ratios in the order the table prints them.
func ratios() []ratio {
	exact := func(l string) RowMatch { return RowMatch{Label: l} }
	suffixed := func(l string) RowMatch { return RowMatch{Label: l, Kind: Suffixed} }
	return []ratio{
		{"e2e-http/plain-http", exact(rowE2EHTTPMax), exact(rowPlainHTTPMax)},
		{"e2e-http/watermill-http", exact(rowE2EHTTPMax), exact(rowWatermillHTTPMax)},
		{"idem-consumer/naive", exact(rowConsumer), exact(rowNaive)},
		{"idem-consumer/handwritten-inbox", exact(rowConsumer), exact(rowInbox)},
		{"e2e default fsync + reconciler/fsync always", suffixed(rowReconciled), suffixed(rowFsyncAlways)},
		{"e2e default fsync + reconciler/fsync always + reconciler", suffixed(rowReconciled), suffixed(rowFsyncReconciled)},
		{"e2e default fsync + reconciler/no reconciler", suffixed(rowReconciled), suffixed(rowUnproven)},
		{"e2e fsync always, atomic batch publish/fsync always", suffixed(rowFsyncAtomic), suffixed(rowFsyncAlways)},
	}
}

// RatioNames lists the ratios' names in the order the table prints them.
func RatioNames() []string {
	var out []string
	for _, r := range ratios() {
		out = append(out, r.name)
	}
	return out
}

// Ratios computes every ratio whose two rows are in rs (the first row each
// selects) and whose denominator's rate is positive.
func Ratios(rs []Result) map[string]float64 {
	out := map[string]float64{}
	for _, r := range ratios() {
		num, den := r.num.Find(rs), r.den.Find(rs)
		if num == nil || den == nil || den.Rate <= 0 {
			continue
		}
		out[r.name] = num.Rate / den.Rate
	}
	return out
}

// Target is one of the goals, checked.
type Target struct {
	Name     string  `json:"name"`
	Want     string  `json:"want"`
	Got      float64 `json:"got"`
	Met      bool    `json:"met"`
	Measured bool    `json:"measured"`
}

// goal is a target before it is checked: a ratio, a field of a row, or a
// comparison of two rows (relative), against a limit.
type goal struct {
	name  string
	ratio string   // a ratio's name, or
	row   RowMatch // the row whose field is read, or
	field func(Result) float64
	// relative reads a value and its limit from rows of the run (reads): a limit
	// that follows the run's own baseline.
	relative func(rs []Result) (got, limit float64, ok bool)
	reads    []RowMatch
	atMost   bool // the value must be <= limit; otherwise >= limit
	limit    float64
	unit     string
	// wantText says what relative compares with, for the table.
	wantText string
}

func (g goal) want() string {
	if g.wantText != "" {
		return g.wantText
	}
	op := ">="
	if g.atMost {
		op = "<="
	}
	return fmt.Sprintf("%s %g%s", op, g.limit, g.unit)
}

// cpuPerIntent is a row's CPU (this process and Postgres) per intent.
func cpuPerIntent(r Result) float64 {
	if r.N == 0 {
		return 0
	}
	return (r.ProcCPUSec + r.PGCPUSec) / float64(r.N)
}

// cpuRatio compares e2e-http's CPU per intent with plain-http's, in the rows m
// selects of each, at most limit times it.
func cpuRatio(e2e, plain RowMatch, limit float64) func([]Result) (float64, float64, bool) {
	return func(rs []Result) (float64, float64, bool) {
		a, b := e2e.Find(rs), plain.Find(rs)
		if a == nil || b == nil || cpuPerIntent(*b) <= 0 {
			return 0, 0, false
		}
		return cpuPerIntent(*a) / cpuPerIntent(*b), limit, true
	}
}

// goals lists the targets in the order the table prints them.
func goals() []goal {
	p99 := func(r Result) float64 { return r.P99ms }
	rate := func(r Result) float64 { return r.Rate }
	e2eRate, plainRate := RowMatch{rowE2EHTTPRate, Prefix}, RowMatch{rowPlainHTTPRate, Prefix}
	e2eMax, plainMax := RowMatch{Label: rowE2EHTTPMax}, RowMatch{Label: rowPlainHTTPMax}
	return []goal{
		{name: "e2e-http/plain-http", ratio: "e2e-http/plain-http", limit: 0.6, unit: "x"},
		{name: "e2e-http/watermill-http", ratio: "e2e-http/watermill-http", limit: 2, unit: "x"},
		{name: "e2e-http/plain-http CPU per intent (max)", relative: cpuRatio(e2eMax, plainMax, 1.7), reads: []RowMatch{e2eMax, plainMax},
			atMost: true, limit: 1.7, unit: "x"},
		{name: "e2e-http/plain-http CPU per intent at the offered load", relative: cpuRatio(e2eRate, plainRate, 2), reads: []RowMatch{e2eRate, plainRate},
			atMost: true, limit: 2, unit: "x"},
		{name: "e2e-http p99 ms (request -> ledger row) at the offered load", atMost: true, wantText: "<= max(2x plain-http p99, 10)",
			reads: []RowMatch{e2eRate, plainRate},
			relative: func(rs []Result) (float64, float64, bool) {
				e, p := e2eRate.Find(rs), plainRate.Find(rs)
				if e == nil || p == nil {
					return 0, 0, false
				}
				return e.P99ms, max(2*p.P99ms, 10), true
			}},
		{name: "idem-consumer/naive", ratio: "idem-consumer/naive", limit: 3, unit: "x"},
		{name: "idem-consumer/handwritten-inbox", ratio: "idem-consumer/handwritten-inbox", limit: 5, unit: "x"},
		{name: "e2e batched intents/s (default durability)", row: RowMatch{Label: rowE2EMax}, field: rate, limit: 20000},
		{name: "e2e p99 latency ms at the offered load", row: RowMatch{rowE2ERate, Prefix}, field: p99, atMost: true, limit: 50},
	}
}

// Targets checks every goal against rs and its ratios. A goal whose row or ratio
// is missing is reported as not measured.
func Targets(rs []Result, ratios map[string]float64) []Target {
	var out []Target
	for _, g := range goals() {
		t := Target{Name: g.name, Want: g.want()}
		limit := g.limit
		switch {
		case g.ratio != "":
			t.Got, t.Measured = ratios[g.ratio]
		case g.relative != nil:
			t.Got, limit, t.Measured = g.relative(rs)
		default:
			if r := g.row.Find(rs); r != nil {
				t.Got, t.Measured = g.field(*r), true
			}
		}
		if t.Measured {
			t.Met = t.Got >= limit
			if g.atMost {
				t.Met = t.Got <= limit
			}
		}
		out = append(out, t)
	}
	return out
}

// ReadRows lists every row the ratios and targets read, for the check that some
// scenario produces each of them.
func ReadRows() []RowMatch {
	var out []RowMatch
	for _, r := range ratios() {
		out = append(out, r.num, r.den)
	}
	for _, g := range goals() {
		switch {
		case g.relative != nil:
			out = append(out, g.reads...)
		case g.ratio == "":
			out = append(out, g.row)
		}
	}
	return out
}
