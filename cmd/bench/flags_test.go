package main

import (
	"bytes"
	"errors"
	"flag"
	"slices"
	"strings"
	"testing"

	"github.com/idemkit/idem/cmd/bench/internal/scenario"
)

func TestParseFlagsDefaultsRunEveryScenario(t *testing.T) {
	c, err := parseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.Scenarios, scenario.Names()) {
		t.Errorf("default scenarios %q, want %q", c.Scenarios, scenario.Names())
	}
	if c.N != 20000 || c.JSONPath != "bench-results.json" || c.InProcess || c.child != "" {
		t.Errorf("defaults: %+v", c)
	}
}

func TestParseFlagsRefusesBadInput(t *testing.T) {
	for _, tc := range []struct {
		args []string
		err  string
	}{
		{[]string{"-scenarios", "e2e,bogus"}, `-scenarios: unknown scenario "bogus" (have naive,`},
		{[]string{"-scenarios", ""}, "-scenarios: no scenario named"},
		{[]string{"-n", "0"}, "-n must be positive"},
		{[]string{"-http-clients", "0"}, "-http- flags must be positive"},
		{[]string{"-dup-drop", "1.5"}, "-dup-drop"},
		{[]string{"-child", "bogus"}, `-child: unknown scenario "bogus"`},
		{[]string{"e2e"}, `unexpected argument "e2e"`},
		{[]string{"-no-such-flag"}, "not defined"},
	} {
		_, err := parseFlags(tc.args, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("parseFlags(%q) error = %v, want one containing %q", tc.args, err, tc.err)
		}
	}
}

func TestParseFlagsReadsTheOptions(t *testing.T) {
	c, err := parseFlags([]string{"-scenarios", "plain-http, e2e-http,e2e,idem-consumer", "-n", "2000", "-http-rate-n", "500",
		"-durability-batch", "100", "-watermill-dir", "/x/wm", "-child", "e2e"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.Scenarios, []string{"plain-http", "e2e-http", "e2e", "idem-consumer"}) || c.N != 2000 || c.HTTPRateN != 500 ||
		c.DurabilityBatch != 100 || c.WatermillDir != "/x/wm" || c.child != "e2e" {
		t.Errorf("parsed %+v", c)
	}
}

func TestHelpListsEveryScenario(t *testing.T) {
	var out bytes.Buffer
	if _, err := parseFlags([]string{"-h"}, &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("-h: %v", err)
	}
	for _, s := range scenario.All() {
		if !strings.Contains(out.String(), "  "+s.Name()+" ") || !strings.Contains(out.String(), s.Summary()) {
			t.Errorf("-h does not list %s with its summary", s.Name())
		}
	}
	if !strings.Contains(out.String(), "-http-rate-n") {
		t.Error("-h does not list the flags")
	}
}

// TestOptionsMapKeys pins the JSON's "options" names: scripts read them.
func TestOptionsMapKeys(t *testing.T) {
	c, err := parseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for k := range optionsMap(c) {
		got = append(got, k)
	}
	slices.Sort(got)
	want := []string{"batch", "concurrency", "dup_ack_wait", "dup_drop", "durability_batch", "enqueue_batch", "http_clients",
		"http_rate", "http_rate_n", "inprocess", "n", "pg_plan_cache_mode", "producers", "rate", "rate_batch", "relay_batch",
		"scenarios", "sync_always", "workers"}
	if !slices.Equal(got, want) {
		t.Errorf("options keys\n got %q\nwant %q", got, want)
	}
}
