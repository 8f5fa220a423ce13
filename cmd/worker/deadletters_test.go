package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

// cliDeadLetter files a dead letter createdAgo ago with its replay horizon at
// now() + horizon (nil: unknown) and returns its id.
func cliDeadLetter(t *testing.T, db *pgtest.DB, consumerName, key, reason, createdAgo string, horizon *string) int64 {
	t.Helper()
	var id int64
	err := db.Pool.QueryRow(context.Background(), `
INSERT INTO idem_dead_letters (consumer, key, subject, payload, reason, deliveries, created_at, inbox_expires_at)
VALUES ($1, $2, 'test.effects', '{"n":1}', $3, 1, now() - $4::interval, now() + $5::interval)
RETURNING id`, consumerName, key, reason, createdAgo, horizon).Scan(&id)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

type replayLine struct {
	ID       int64  `json:"id"`
	Consumer string `json:"consumer"`
	Key      string `json:"key"`
	Action   string `json:"action"`
	Reason   string `json:"reason"`
}

// jsonLines decodes every line of out into a T.
func jsonLines[T any](t *testing.T, out string) []T {
	t.Helper()
	var got []T
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		var v T
		if err := json.Unmarshal(sc.Bytes(), &v); err != nil {
			t.Fatalf("not a JSON line: %q: %v", sc.Text(), err)
		}
		got = append(got, v)
	}
	return got
}

func actionsOf(lines []replayLine) string {
	parts := make([]string, len(lines))
	for i, l := range lines {
		parts[i] = fmt.Sprintf("%d:%s", l.ID, l.Action)
	}
	return strings.Join(parts, " ")
}

// worker dead-letters list filters and prints a table or JSON lines; replay takes
// an ID or a selection, prints one JSON line per dead letter and a summary, exits
// 1 when any was refused, writes nothing on a dry run, and replays past the
// horizon only with --force. Flags go before or after the arguments.
func TestDeadLettersCLI(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	within := "2 days" // past the time a replay may spend in the stream
	past := "-1 minute"
	d1 := cliDeadLetter(t, db, "billing", "k1", "permanent handler error: x", "3 hours", &within)
	d2 := cliDeadLetter(t, db, "billing", "k2", "permanent handler error: y", "2 hours", &past)
	d3 := cliDeadLetter(t, db, "audit", "k3", "max deliveries exceeded: z", "10 minutes", &within)
	d4 := cliDeadLetter(t, db, "billing", "", "missing Idempotency-Key header", "5 minutes", &within)
	dbFlag := []string{"--database-url", db.URL}
	run := func(args ...string) (string, string, int) {
		t.Helper()
		return worker(t, append(args, dbFlag...)...)
	}
	outboxRows := func() int { return db.Count(t, `SELECT count(*) FROM idem_outbox`) }

	// list: a table by default.
	out, errs, code := run("dead-letters", "list")
	if code != 0 {
		t.Fatalf("list: exit %d: %s", code, errs)
	}
	mustContain(t, "list", out, "ID", "CONSUMER", "REPLAY", "billing", "audit", `"k1"`, "past horizon (--force)", "never (no valid key)", "max deliveries exceeded: z")
	mustContain(t, "list stderr", errs, "4 dead letters")

	type listed struct {
		ID  int64  `json:"id"`
		Key string `json:"key"`
	}
	listIDs := func(args ...string) []int64 {
		t.Helper()
		out, errs, code := run(append([]string{"dead-letters"}, args...)...)
		if code != 0 {
			t.Fatalf("%q: exit %d: %s", args, code, errs)
		}
		var ids []int64
		for _, l := range jsonLines[listed](t, out) {
			ids = append(ids, l.ID)
		}
		return ids
	}
	for _, tc := range []struct {
		args []string
		want []int64
	}{
		{[]string{"list", "--json"}, []int64{d4, d3, d2, d1}},
		{[]string{"list", "--consumer", "billing", "--json"}, []int64{d4, d2, d1}},
		{[]string{"list", "--reason", "max deliveries", "--json"}, []int64{d3}},
		{[]string{"list", "--json", "--since", "90m"}, []int64{d4, d3}},
		{[]string{"list", "--json", "--until", time.Now().Add(-90 * time.Minute).Format(time.RFC3339)}, []int64{d2, d1}},
		{[]string{"list", "--json", "--limit", "1"}, []int64{d4}},
	} {
		if got := listIDs(tc.args...); !slices.Equal(got, tc.want) {
			t.Errorf("%q: ids %v, want %v", tc.args, got, tc.want)
		}
	}
	if _, errs, _ := run("dead-letters", "list", "--limit", "1"); !strings.Contains(errs, "--limit reached") {
		t.Errorf("list --limit 1 does not say there may be more: %s", errs)
	}

	// Bad invocations: exit 2 (usage) or 1 (an ID that does not exist) with the
	// reason, nothing written.
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"dead-letters", "replay"}, 2, "want an ID, a filter"},
		{[]string{"dead-letters", "replay", "--all", "--consumer", "billing"}, 2, "--all selects every dead letter"},
		{[]string{"dead-letters", "replay", fmt.Sprint(d1), "--consumer", "billing"}, 2, "not both"},
		{[]string{"dead-letters", "replay", "1", "2"}, 2, "at most one ID"},
		{[]string{"dead-letters", "replay", "x"}, 2, "bad ID"},
		{[]string{"dead-letters", "list", "--since", "yesterday"}, 2, "RFC 3339"},
		{[]string{"dead-letters", "list", "extra"}, 2, "unexpected arguments"},
		{[]string{"dead-letters", "replay", "9999"}, 1, "not found"},
	} {
		_, errs, code := run(tc.args...)
		if code != tc.code || !strings.Contains(errs, tc.want) {
			t.Errorf("%q: exit %d, stderr %q; want %d and %q", tc.args, code, errs, tc.code, tc.want)
		}
	}
	if n := outboxRows(); n != 0 {
		t.Fatalf("bad invocations wrote %d outbox rows", n)
	}

	// A dry run of a selection: one would replay, one would be refused; exit 1.
	out, errs, code = run("dead-letters", "replay", "--consumer", "billing", "--reason", "permanent", "--dry-run")
	lines := jsonLines[replayLine](t, out)
	if code != 1 || actionsOf(lines) != fmt.Sprintf("%d:would-replay %d:refused", d1, d2) {
		t.Fatalf("dry run: exit %d, lines %q, stderr %s", code, actionsOf(lines), errs)
	}
	if lines[0].Consumer != "billing" || lines[0].Key != "k1" || lines[0].Reason != "" || !strings.Contains(lines[1].Reason, "past its replay horizon") {
		t.Errorf("dry run lines = %+v", lines)
	}
	mustContain(t, "dry run stderr", errs, "dry run: would replay 1, would refuse 1; nothing was written", "1 dead letter refused", "--force")
	if n := outboxRows(); n != 0 {
		t.Fatalf("a dry run wrote %d outbox rows", n)
	}

	// The replay itself.
	out, errs, code = run("dead-letters", "replay", "--reason", "permanent", "--consumer", "billing")
	if lines := jsonLines[replayLine](t, out); code != 1 || actionsOf(lines) != fmt.Sprintf("%d:replayed %d:refused", d1, d2) {
		t.Fatalf("replay: exit %d, lines %q, stderr %s", code, actionsOf(lines), errs)
	}
	mustContain(t, "replay stderr", errs, "replayed 1, refused 1")
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'k1' AND headers->>$1 = 'billing'`, idem.HeaderReplayFor); n != 1 {
		t.Errorf("outbox rows of k1 addressed to billing = %d, want 1", n)
	}

	// One ID: refused past its horizon, replayed with --force (before or after the ID).
	out, errs, code = run("dead-letters", "replay", fmt.Sprint(d2))
	if lines := jsonLines[replayLine](t, out); code != 1 || actionsOf(lines) != fmt.Sprintf("%d:refused", d2) || !strings.Contains(lines[0].Reason, "past its replay horizon") {
		t.Fatalf("replay %d: exit %d, out %s, stderr %s", d2, code, out, errs)
	}
	out, errs, code = run("dead-letters", "replay", fmt.Sprint(d2), "--force")
	if lines := jsonLines[replayLine](t, out); code != 0 || actionsOf(lines) != fmt.Sprintf("%d:replayed", d2) {
		t.Fatalf("replay %d --force: exit %d, out %s, stderr %s", d2, code, out, errs)
	}
	out, errs, code = run("dead-letters", "replay", "--force", "--dry-run", fmt.Sprint(d2))
	if lines := jsonLines[replayLine](t, out); code != 0 || actionsOf(lines) != fmt.Sprintf("%d:would-replay", d2) {
		t.Fatalf("replay --force --dry-run %d: exit %d, out %s, stderr %s", d2, code, out, errs)
	}
	// Keyless: refused even forced.
	out, _, code = run("dead-letters", "replay", "--force", fmt.Sprint(d4))
	if lines := jsonLines[replayLine](t, out); code != 1 || actionsOf(lines) != fmt.Sprintf("%d:refused", d4) || !strings.Contains(lines[0].Reason, idem.HeaderKey) {
		t.Fatalf("replay of a keyless dead letter: exit %d, out %s", code, out)
	}

	// --all: what is left (replayed ones are not selected again).
	out, errs, code = run("dead-letters", "replay", "--all")
	if lines := jsonLines[replayLine](t, out); code != 1 || actionsOf(lines) != fmt.Sprintf("%d:replayed %d:refused", d3, d4) {
		t.Fatalf("replay --all: exit %d, lines %q, stderr %s", code, actionsOf(lines), errs)
	}
	if n := outboxRows(); n != 3 {
		t.Errorf("outbox rows = %d, want 3 (k1, k2, k3)", n)
	}
	out, errs, code = run("dead-letters", "replay", "--all")
	if code != 1 || actionsOf(jsonLines[replayLine](t, out)) != fmt.Sprintf("%d:refused", d4) {
		t.Errorf("second replay --all: exit %d, out %s, stderr %s; want only the keyless one, refused", code, out, errs)
	}
	out, _, code = run("dead-letters", "list", "--include-replayed")
	if code != 0 || !strings.Contains(out, "replayed ") {
		t.Errorf("list --include-replayed: exit %d, no replayed dead letter shown:\n%s", code, out)
	}
}

func TestDeadLetterTimeFlags(t *testing.T) {
	t.Parallel()
	now := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		in   string
		want time.Time
		ok   bool
	}{
		{"24h", now.Add(-24 * time.Hour), true},
		{"90m", now.Add(-90 * time.Minute), true},
		{"2025-02-28T08:30:00Z", time.Date(2025, 2, 28, 8, 30, 0, 0, time.UTC), true},
		{"-1h", time.Time{}, false},
		{"yesterday", time.Time{}, false},
	} {
		got, err := parseSince(tc.in, now)
		if (err == nil) != tc.ok || (tc.ok && !got.Equal(tc.want)) {
			t.Errorf("parseSince(%q) = %v, %v; want %v (ok %v)", tc.in, got, err, tc.want, tc.ok)
		}
	}
}
