package scenario

import (
	"context"
	"encoding/binary"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/cmd/bench/internal/report"
	"github.com/idemkit/idem/outbox"
)

// variedOptions change every option a row label depends on.
func variedOptions() Options {
	o := DefaultOptions()
	o.Rate, o.HTTPRate, o.DurabilityBatch = 500, 300, 100
	return o
}

func TestRegistryNamesAreUniqueAndKeepTheContract(t *testing.T) {
	names := Names()
	seen := map[string]bool{}
	for _, n := range names {
		if seen[n] {
			t.Errorf("scenario %q registered twice", n)
		}
		seen[n] = true
		if s, err := Lookup(n); err != nil || s.Name() != n {
			t.Errorf("Lookup(%q) = %v, %v", n, s, err)
		}
		if s, _ := Lookup(n); s.Summary() == "" {
			t.Errorf("scenario %q has no summary for -h", n)
		}
	}
	// The names the design's benchmark contract lists.
	for _, n := range []string{"naive", "handwritten-inbox", "idem-consumer", "relay", "e2e", "e2e-http", "plain-http", "watermill-http"} {
		if !seen[n] {
			t.Errorf("the contract's scenario %q is not registered", n)
		}
	}
}

func TestLookupUnknownNamesTheScenarios(t *testing.T) {
	_, err := Lookup("e2e-htp")
	if err == nil || !strings.Contains(err.Error(), "e2e-http") || !strings.Contains(err.Error(), `"e2e-htp"`) {
		t.Fatalf("Lookup of a typo: %v", err)
	}
}

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		list string
		want []string
		err  string
	}{
		{"naive", []string{"naive"}, ""},
		{" e2e , idem-consumer,", []string{"e2e", "idem-consumer"}, ""},
		{"e2e,e2e", []string{"e2e", "e2e"}, ""},
		{"naive,nope", nil, `unknown scenario "nope"`},
		{"", nil, "no scenario named"},
		{" , ", nil, "no scenario named"},
	} {
		got, err := Parse(tc.list)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("Parse(%q) error = %v, want %q", tc.list, err, tc.err)
			}
			continue
		}
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("Parse(%q) = %q, %v; want %q", tc.list, got, err, tc.want)
		}
	}
}

func TestRowsAreUniqueAcrossScenarios(t *testing.T) {
	for _, o := range []Options{DefaultOptions(), variedOptions()} {
		owner := map[string]string{}
		for _, s := range All() {
			rows := s.Rows(o)
			if len(rows) == 0 {
				t.Errorf("%s declares no rows", s.Name())
			}
			for _, r := range rows {
				if prev, ok := owner[r]; ok {
					t.Errorf("row %q is declared by %s and %s", r, prev, s.Name())
				}
				owner[r] = s.Name()
			}
		}
	}
}

// TestEveryRowTheReportReadsIsDeclared guards the ratios and targets against a
// renamed row: each row they read must be one a scenario declares.
func TestEveryRowTheReportReadsIsDeclared(t *testing.T) {
	for _, o := range []Options{DefaultOptions(), variedOptions()} {
		var rows []string
		for _, s := range All() {
			rows = append(rows, s.Rows(o)...)
		}
		for _, m := range report.ReadRows() {
			if !slices.ContainsFunc(rows, m.Matches) {
				t.Errorf("the report reads row %+v, which no scenario declares (rate %d, durability batch %d)", m, o.Rate, o.DurabilityBatch)
			}
		}
	}
}

func TestRowLabels(t *testing.T) {
	o := variedOptions()
	for _, tc := range []struct {
		s    Scenario
		want []string
	}{
		{e2e{}, []string{"e2e (max)", "e2e @500/s"}},
		{e2eHTTP{}, []string{"e2e-http (max)", "e2e-http @300/s"}},
		{watermillHTTP{}, []string{"watermill-http (max)", "watermill-http @300/s"}},
		{e2eOrdered{}, []string{"e2e-ordered, unordered", "e2e-ordered, ordered, 4 partitions", "e2e-ordered, ordered, 16 partitions"}},
		{publishBatch{}, []string{"publish, async + PubAck each, default sync", "publish, atomic batch, one PubAck, default sync",
			"publish, async + PubAck each, fsync always", "publish, atomic batch, one PubAck, fsync always"}},
	} {
		if got := tc.s.Rows(o); !slices.Equal(got, tc.want) {
			t.Errorf("%s rows = %q, want %q", tc.s.Name(), got, tc.want)
		}
	}
	// The durability rows carry the batch when it is not the shape users run.
	for _, r := range (e2eDurability{}).Rows(o) {
		if !strings.HasSuffix(r, " (100 intents per transaction)") {
			t.Errorf("durability row %q lacks its batch", r)
		}
	}
	for _, r := range (e2eDurability{}).Rows(DefaultOptions()) {
		if strings.Contains(r, "intents per transaction") {
			t.Errorf("durability row %q is labelled at the default batch", r)
		}
	}
}

// fake is a scenario whose Run returns what it is given.
type fake struct {
	rows []report.Result
}

func (fake) Name() string          { return "fake" }
func (fake) Summary() string       { return "a fake" }
func (fake) Rows(Options) []string { return []string{"fake (max)", "fake @1/s"} }
func (f fake) Run(context.Context, *Harness) ([]report.Result, error) {
	return f.rows, nil
}

func TestRunChecksTheDeclaredRows(t *testing.T) {
	row := func(scenario, label string) report.Result { return report.Result{Scenario: scenario, Row: label} }
	for _, tc := range []struct {
		name string
		rows []report.Result
		err  string
	}{
		{"as declared", []report.Result{row("fake", "fake (max)"), row("fake", "fake @1/s")}, ""},
		{"a row missing", []report.Result{row("fake", "fake (max)")}, "declares"},
		{"a row renamed", []report.Result{row("fake", "fake (max)"), row("fake", "fake @2/s")}, "declares"},
		{"out of order", []report.Result{row("fake", "fake @1/s"), row("fake", "fake (max)")}, "declares"},
		{"an extra row", []report.Result{row("fake", "fake (max)"), row("fake", "fake @1/s"), row("fake", "fake")}, "declares"},
		{"another scenario's name", []report.Result{row("fake", "fake (max)"), row("e2e", "fake @1/s")}, `carries scenario "e2e"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rs, err := Run(context.Background(), fake{tc.rows}, &Harness{Opts: DefaultOptions()})
			if tc.err == "" {
				if err != nil || len(rs) != len(tc.rows) {
					t.Fatalf("Run = %v, %v", rs, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("Run error = %v, want one containing %q", err, tc.err)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	if err := DefaultOptions().Validate(); err != nil {
		t.Fatalf("the defaults do not validate: %v", err)
	}
	for _, tc := range []struct {
		flag string
		set  func(*Options)
	}{
		{"-n", func(o *Options) { o.N = 0 }},
		{"-workers", func(o *Options) { o.Workers = 0 }},
		{"-http-", func(o *Options) { o.HTTPRateN = -1 }},
		{"-durability-batch", func(o *Options) { o.DurabilityBatch = 0 }},
		{"-rate", func(o *Options) { o.Rate = 0 }},
		{"-timeout", func(o *Options) { o.Timeout = 0 }},
		{"-payload-bytes", func(o *Options) { o.PayloadBytes = -1 }},
		{"-dup-drop", func(o *Options) { o.DupDrop = 1 }},
		{"-dup-drop", func(o *Options) { o.DupDrop = -0.1 }},
	} {
		o := DefaultOptions()
		tc.set(&o)
		if err := o.Validate(); err == nil || !strings.Contains(err.Error(), tc.flag) {
			t.Errorf("options with a bad %s: error %v", tc.flag, err)
		}
	}
}

func TestPoolSizeCoversTheLargestScenario(t *testing.T) {
	o := DefaultOptions()
	if got := poolSize(o); got != int32(o.HTTPClients+8+4) {
		t.Errorf("poolSize(defaults) = %d, want the HTTP clients + 12 = %d", got, o.HTTPClients+12)
	}
	o.Workers = 100
	if got := poolSize(o); got != 104 {
		t.Errorf("poolSize with 100 workers = %d, want 104", got)
	}
	o = DefaultOptions()
	o.HTTPClients, o.Workers = 1, 1
	if got := poolSize(o); got != int32(durabilityProducers+o.Concurrency+4+4) {
		t.Errorf("poolSize with few clients = %d, want e2e-durability's %d", got, durabilityProducers+o.Concurrency+8)
	}
}

func TestMakeIntents(t *testing.T) {
	for _, payloadBytes := range []int{0, 10, 500, 4096} {
		intents := makeIntents(50, payloadBytes)
		keys := map[string]bool{}
		for i, in := range intents {
			keys[in.Key] = true
			c, err := refapp.DecodeCharge(in.Payload)
			if err != nil {
				t.Fatalf("payload %d (%d bytes asked) is not a valid charge: %v", i, payloadBytes, err)
			}
			if c.Account != in.Account || c.AmountCents != in.Amount {
				t.Fatalf("payload %d decodes to %+v, intent %+v", i, c, in)
			}
			if payloadBytes > 100 && (len(in.Payload) < payloadBytes-5 || len(in.Payload) > payloadBytes+5) {
				t.Errorf("payload %d is %d bytes, asked about %d", i, len(in.Payload), payloadBytes)
			}
		}
		if len(keys) != len(intents) {
			t.Errorf("%d keys for %d intents", len(keys), len(intents))
		}
		if idx := indexByKey(intents); idx[intents[7].Key] != 7 {
			t.Errorf("indexByKey misplaces intent 7")
		}
	}
}

func TestIntentLatencies(t *testing.T) {
	enq := []int64{0, 10, 20}
	com := []int64{50, 15, 90}
	lat, last := intentLatencies(enq, com)
	if !slices.Equal(lat, []time.Duration{50, 5, 70}) || last != 90 {
		t.Errorf("intentLatencies = %v, %v", lat, last)
	}
}

func TestRequestLatencies(t *testing.T) {
	base := time.Unix(1000, 0)
	at := func(ms int) time.Time { return base.Add(time.Duration(ms) * time.Millisecond) }
	sent := []time.Time{at(0), at(1), at(2)}
	answered := []time.Time{at(5), at(3), at(12)}

	// The response is the commit (plain-http): latency is the response time.
	lat, resp, elapsed := requestLatencies(base, sent, answered, nil)
	want := []time.Duration{2 * time.Millisecond, 5 * time.Millisecond, 10 * time.Millisecond}
	if !slices.Equal(lat, want) || !slices.Equal(resp, want) || elapsed != 12*time.Millisecond {
		t.Errorf("without effects: %v %v %v", lat, resp, elapsed)
	}
	// The effect is behind the broker (e2e-http): latency runs to the effect, and
	// the phase ends with the last effect.
	effects := []time.Time{at(20), at(8), at(15)}
	lat, resp, elapsed = requestLatencies(base, sent, answered, effects)
	if !slices.Equal(lat, []time.Duration{7 * time.Millisecond, 13 * time.Millisecond, 20 * time.Millisecond}) ||
		!slices.Equal(resp, want) || elapsed != 20*time.Millisecond {
		t.Errorf("with effects: %v %v %v", lat, resp, elapsed)
	}
}

func TestHTTPResult(t *testing.T) {
	o := DefaultOptions()
	run := httpRun{
		meas:      measure.Measurement{Elapsed: time.Second, ProcCPU: time.Second},
		elapsed:   2 * time.Second,
		latencies: []time.Duration{time.Millisecond, 2 * time.Millisecond, 4 * time.Millisecond},
		responses: []time.Duration{time.Millisecond, time.Millisecond, time.Millisecond},
		busy:      3, proven: 900,
	}
	plain := httpScenario{name: "plain-http"}.result(o, "plain-http (max)", 1000, 0, run)
	if plain.Messages != 0 || plain.Rate != 500 || plain.Seconds != 2 || plain.P99ms != 4 || plain.MaxMs != 4 || plain.ProcCPUSec != 1 {
		t.Errorf("plain-http row: %+v", plain)
	}
	if strings.Contains(strings.Join(plain.Notes, "|"), "reconciler") {
		t.Errorf("plain-http notes a reconciler: %q", plain.Notes)
	}
	e := httpScenario{name: "e2e-http", throughBroker: true}.result(o, "e2e-http @1000/s", 1000, 1000, run)
	notes := strings.Join(e.Notes, "|")
	if e.Messages != 1000 || !strings.Contains(notes, "900 of 1000 rows proven") || !strings.Contains(notes, "offered 1000 requests/s") ||
		!strings.Contains(notes, "3 requests answered 503") || !strings.HasPrefix(notes, "of which request sent -> response") {
		t.Errorf("e2e-http row: %+v", e)
	}
}

func TestBaselineVerify(t *testing.T) {
	naive := baseline{name: "naive", atLeastOnce: true}
	inbox := baseline{name: "handwritten-inbox"}
	for _, tc := range []struct {
		b    baseline
		l    report.Ledger
		want string
		err  bool
	}{
		{naive, report.Ledger{Rows: 100, Keys: 100}, "ok", false},
		{naive, report.Ledger{Rows: 103, Keys: 100}, "at-least-once: 3 double charges", false},
		{naive, report.Ledger{Rows: 99, Keys: 99}, "", true},
		{inbox, report.Ledger{Rows: 100, Keys: 100}, "ok", false},
		{inbox, report.Ledger{Rows: 101, Keys: 100}, "", true},
	} {
		got, err := tc.b.verify(tc.l, 100)
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("%s.verify(%+v) = %q, %v", tc.b.name, tc.l, got, err)
		}
	}
}

func TestOrderedMessage(t *testing.T) {
	m := orderedMessage(2*orderedKeys+7, 0)
	if m.Subject != orderedSubject || m.Key != "o-7-3" {
		t.Errorf("unordered message: %+v", m)
	}
	if k, s := binary.BigEndian.Uint32(m.Payload), binary.BigEndian.Uint32(m.Payload[4:]); k != 7 || s != 3 {
		t.Errorf("payload holds key %d seq %d, want 7 and 3", k, s)
	}
	// Every message of a key goes to the same partition subject.
	a, b := orderedMessage(7, 16), orderedMessage(orderedKeys+7, 16)
	if a.Subject != b.Subject || a.Subject != outbox.Partition(orderedSubject, "7", 16) {
		t.Errorf("key 7's messages went to %q and %q", a.Subject, b.Subject)
	}
}

func TestWatermillArgs(t *testing.T) {
	o := DefaultOptions()
	o.N, o.HTTPRateN, o.Keep = 2000, 500, true
	got := strings.Join(watermillArgs(o), " ")
	for _, want := range []string{"-n 2000", "-clients 32", "-rate 1000", "-rate-n 500", "-timeout 2m0s", "-keep", "-database-url postgres://"} {
		if !strings.Contains(got, want) {
			t.Errorf("the peer's arguments %q lack %q", got, want)
		}
	}
}

func TestPipelineConfigMapKeys(t *testing.T) {
	got := pipelineConfigFrom(DefaultOptions()).configMap()
	for _, k := range []string{"enqueue_batch", "producers", "rate", "relay_batch", "consumer_batch", "consumer_concurrency", "duplicate", "drop_fraction", "ack_wait", "relay"} {
		if _, ok := got[k]; !ok {
			t.Errorf("the pipeline rows' config lacks %q", k)
		}
	}
	if len(got) != 10 {
		t.Errorf("the pipeline rows' config has %d keys, want 10: %v", len(got), got)
	}
}
