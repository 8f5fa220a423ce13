package deadletter_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/deadletter"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// fileDeadLetter writes a dead letter as a consumer would have filed it createdAgo
// (an interval) ago, with its replay horizon at now() + horizon (NULL: unknown, as
// for rows filed before schema v3), and returns its id.
func fileDeadLetter(t *testing.T, db *pgtest.DB, consumerName, key, reason, createdAgo string, horizon *string) int64 {
	t.Helper()
	var id int64
	err := db.Pool.QueryRow(context.Background(), `
INSERT INTO idem_dead_letters (consumer, key, subject, headers, payload, reason, deliveries, created_at, inbox_expires_at)
VALUES ($1, $2, $3, '{"X-Trace":"t"}', '{"n":1}', $4, 1, now() - $5::interval, now() + $6::interval)
RETURNING id`, consumerName, key, testenv.Subject, reason, createdAgo, horizon).Scan(&id)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func ptr(s string) *string { return &s }

func ids[T any](xs []T, id func(T) int64) []int64 {
	out := make([]int64, len(xs))
	for i, x := range xs {
		out[i] = id(x)
	}
	return out
}

func dlIDs(ds []deadletter.Letter) []int64 {
	return ids(ds, func(d deadletter.Letter) int64 { return d.ID })
}

// actions renders a report as id:action pairs, oldest first.
func actions(rep deadletter.ReplayReport) map[int64]string {
	out := map[int64]string{}
	for _, r := range rep.Results {
		out[r.ID] = r.Action
	}
	return out
}

// Find and a bulk Replay select dead letters by consumer, reason prefix, filing
// time, ids and replayed-or-not; a dry run writes nothing; the refused (past or
// unknown horizon, no key) are reported with their reason while the rest are
// replayed, batch by batch; Force replays past the horizon but never a keyless one.
func TestDeadLetterFilterAndBulkReplay(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	db := env.DB
	ctx := context.Background()
	within := ptr("2 days") // past the time a replay may spend in the stream
	d1 := fileDeadLetter(t, db, "billing", "k1", "permanent handler error: x", "3 hours", within)
	d2 := fileDeadLetter(t, db, "billing", "k2", "max deliveries exceeded: y", "2 hours", within)
	d3 := fileDeadLetter(t, db, "audit", "k3", "permanent handler error: z", "1 hour", within)
	d4 := fileDeadLetter(t, db, "billing", "k4", "permanent handler error: w", "30 minutes", ptr("-1 minute"))
	d5 := fileDeadLetter(t, db, "billing", "k5", "permanent handler error", "10 minutes", nil)
	d6 := fileDeadLetter(t, db, "billing", "", "missing Idempotency-Key header", "5 minutes", within)
	d7 := fileDeadLetter(t, db, "billing", "k7", "permanent handler error", "1 minute", within)
	if _, err := db.Pool.Exec(ctx, `UPDATE idem_dead_letters SET replayed_at = now() WHERE id = $1`, d7); err != nil {
		t.Fatal(err)
	}

	dls := deadletter.New(env.Inst)
	now := time.Now()
	for _, tc := range []struct {
		name string
		f    deadletter.Filter
		want []int64
	}{
		{"zero filter: not replayed", deadletter.Filter{}, []int64{d6, d5, d4, d3, d2, d1}},
		{"include replayed", deadletter.Filter{IncludeReplayed: true}, []int64{d7, d6, d5, d4, d3, d2, d1}},
		{"consumer", deadletter.Filter{Consumer: "billing"}, []int64{d6, d5, d4, d2, d1}},
		{"reason prefix", deadletter.Filter{ReasonPrefix: "permanent"}, []int64{d5, d4, d3, d1}},
		{"since", deadletter.Filter{Since: now.Add(-90 * time.Minute)}, []int64{d6, d5, d4, d3}},
		{"until", deadletter.Filter{Until: now.Add(-90 * time.Minute)}, []int64{d2, d1}},
		{"ids, replayed excluded", deadletter.Filter{IDs: []int64{d1, d3, d7}}, []int64{d3, d1}},
		{"no ids", deadletter.Filter{IDs: []int64{}}, []int64{}},
		{"limit", deadletter.Filter{Limit: 2}, []int64{d6, d5}},
		{"everything at once", deadletter.Filter{Consumer: "billing", ReasonPrefix: "perm", Since: now.Add(-4 * time.Hour), Until: now.Add(-20 * time.Minute)}, []int64{d4, d1}},
	} {
		got, err := dls.Find(ctx, tc.f)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if !slices.Equal(dlIDs(got), tc.want) {
			t.Errorf("%s: Find = %v, want %v", tc.name, dlIDs(got), tc.want)
		}
	}
	if _, err := dls.Find(ctx, deadletter.Filter{Limit: -1}); err == nil {
		t.Error("Find with a negative limit succeeded")
	}
	if got, err := dls.List(ctx, 3); err != nil || !slices.Equal(dlIDs(got), []int64{d7, d6, d5}) {
		t.Errorf("List(3) = %v, %v; want the newest 3, replayed included", dlIDs(got), err)
	}

	outboxRows := func() int { return db.Count(t, `SELECT count(*) FROM idem_outbox`) }
	billingPermanent := deadletter.Filter{Consumer: "billing", ReasonPrefix: "permanent"}

	dry, err := dls.Replay(ctx, billingPermanent, deadletter.ReplayOptions{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := ids(dry.Results, func(r deadletter.ReplayResult) int64 { return r.ID }); !slices.Equal(got, []int64{d1, d4, d5}) {
		t.Errorf("dry run covers %v, want %v oldest first", got, []int64{d1, d4, d5})
	}
	if a := actions(dry); a[d1] != deadletter.ActionWouldReplay || a[d4] != deadletter.ActionRefused || a[d5] != deadletter.ActionRefused {
		t.Errorf("dry run actions = %v", a)
	}
	for _, r := range dry.Results {
		if (r.Action == deadletter.ActionRefused) != (r.Reason != "") {
			t.Errorf("dead letter %d: action %s with reason %q", r.ID, r.Action, r.Reason)
		}
	}
	if n := outboxRows(); n != 0 {
		t.Fatalf("a dry run wrote %d outbox rows", n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NOT NULL`); n != 1 {
		t.Fatalf("a dry run marked dead letters replayed")
	}

	rep, err := dls.Replay(ctx, billingPermanent, deadletter.ReplayOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if a := actions(rep); len(a) != 3 || a[d1] != deadletter.ActionReplayed || a[d4] != deadletter.ActionRefused || a[d5] != deadletter.ActionRefused {
		t.Errorf("replay actions = %v, want d1 replayed, d4 and d5 refused", a)
	}
	if rep.Count(deadletter.ActionReplayed) != 1 || rep.Count(deadletter.ActionRefused) != 2 {
		t.Errorf("counts: replayed %d, refused %d", rep.Count(deadletter.ActionReplayed), rep.Count(deadletter.ActionRefused))
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'k1' AND headers->>$1 = 'billing' AND headers->>'X-Trace' = 't'`, idem.HeaderReplayFor); n != 1 {
		t.Errorf("outbox rows of k1 for billing with its original headers = %d, want 1", n)
	}
	// Replayed ones drop out of the selection; the refused stay refused.
	rep, err = dls.Replay(ctx, billingPermanent, deadletter.ReplayOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if a := actions(rep); len(a) != 2 || a[d4] != deadletter.ActionRefused || a[d5] != deadletter.ActionRefused {
		t.Errorf("second replay actions = %v, want d4 and d5 refused", a)
	}
	// Forced: past and unknown horizons go; a keyless dead letter never does.
	rep, err = dls.Replay(ctx, deadletter.Filter{IDs: []int64{d4, d5, d6}}, deadletter.ReplayOptions{Force: true})
	if err != nil {
		t.Fatal(err)
	}
	if a := actions(rep); a[d4] != deadletter.ActionReplayed || a[d5] != deadletter.ActionReplayed || a[d6] != deadletter.ActionRefused {
		t.Errorf("forced replay actions = %v, want d4, d5 replayed and d6 refused", a)
	}
	// The rest, one per transaction.
	rep, err = dls.Replay(ctx, deadletter.Filter{}, deadletter.ReplayOptions{BatchSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	if a := actions(rep); len(a) != 3 || a[d2] != deadletter.ActionReplayed || a[d3] != deadletter.ActionReplayed || a[d6] != deadletter.ActionRefused {
		t.Errorf("batch-of-one replay actions = %v, want d2, d3 replayed and d6 refused", a)
	}
	if n := outboxRows(); n != 5 {
		t.Errorf("outbox rows = %d, want 5 (d1, d4, d5, d2, d3)", n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NULL`); n != 1 {
		t.Errorf("dead letters not replayed = %d, want only the keyless one", n)
	}
	// A limit counts dead letters selected, replayed ones included on request.
	rep, err = dls.Replay(ctx, deadletter.Filter{IncludeReplayed: true, Limit: 2}, deadletter.ReplayOptions{DryRun: true, BatchSize: 1})
	if err != nil || len(rep.Results) != 2 || rep.Results[0].ID != d1 || rep.Results[1].ID != d2 {
		t.Errorf("limited dry run = %+v, %v; want d1 and d2", rep.Results, err)
	}
	if _, err := dls.Replay(ctx, deadletter.Filter{Limit: -1}, deadletter.ReplayOptions{}); err == nil {
		t.Error("Replay with a negative limit succeeded")
	}
}

// Two dead letters of one subject and key (one per consumer) replayed in one batch
// get a Msg-Id each, so the broker's duplicate window keeps both.
func TestBulkReplayGivesEachDeadLetterItsOwnMsgID(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := context.Background()
	within := ptr("2 days") // past the time a replay may spend in the stream
	fileDeadLetter(t, env.DB, "billing", "k-same", "permanent handler error", "1 minute", within)
	fileDeadLetter(t, env.DB, "audit", "k-same", "permanent handler error", "1 minute", within)
	dls := deadletter.New(env.Inst)
	rep, err := dls.Replay(ctx, deadletter.Filter{}, deadletter.ReplayOptions{})
	if err != nil || rep.Count(deadletter.ActionReplayed) != 2 {
		t.Fatalf("Replay = %+v, %v; want both replayed", rep, err)
	}
	rl, err := relay.New(parts.Of(env.Inst), relay.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := rl.Drain(ctx); err != nil || n != 2 {
		t.Fatalf("relay Drain = %d, %v; want 2", n, err)
	}
	if n := env.StreamMsgs(t, testenv.Stream); n != 2 {
		t.Errorf("stream messages = %d, want 2: one replay per consumer", n)
	}
}

// A bulk replay leaves dead letters another replay holds to it instead of waiting
// (SKIP LOCKED), and two replays of one selection at once replay every dead letter
// exactly once between them.
func TestConcurrentBulkReplaysReplayEachDeadLetterOnce(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	db := env.DB
	ctx := context.Background()
	exec := func(sql string) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	exec(`INSERT INTO idem_dead_letters (consumer, key, subject, payload, reason, inbox_expires_at)
	      SELECT 'c', 'k-' || g, 'test.effects', '{}', 'permanent handler error', now() + interval '2 days' FROM generate_series(1, 40) g`)
	dls := deadletter.New(env.Inst)

	// Another operator's replay holds the first five.
	other, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback(ctx) }()
	var held int
	if err := other.QueryRow(ctx, `WITH l AS (SELECT id FROM idem_dead_letters ORDER BY id LIMIT 5 FOR UPDATE) SELECT count(*) FROM l`).Scan(&held); err != nil || held != 5 {
		t.Fatalf("lock the first five: %d, %v", held, err)
	}
	waitCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	rep, err := dls.Replay(waitCtx, deadletter.Filter{}, deadletter.ReplayOptions{BatchSize: 7})
	cancel()
	if err != nil {
		t.Fatalf("Replay beside a held lock: %v (it must skip the held rows, not wait)", err)
	}
	if n := rep.Count(deadletter.ActionReplayed); n != 35 || len(rep.Results) != 35 {
		t.Fatalf("replayed %d of %d results, want the 35 not held", n, len(rep.Results))
	}
	if err := other.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	// Two replays at once over the five released and 60 more.
	exec(`INSERT INTO idem_dead_letters (consumer, key, subject, payload, reason, inbox_expires_at)
	      SELECT 'c', 'k-' || g, 'test.effects', '{}', 'permanent handler error', now() + interval '2 days' FROM generate_series(41, 100) g`)
	var wg sync.WaitGroup
	reps := make([]deadletter.ReplayReport, 2)
	errs := make([]error, 2)
	for i := range reps {
		wg.Go(func() {
			reps[i], errs[i] = dls.Replay(ctx, deadletter.Filter{}, deadletter.ReplayOptions{BatchSize: 2})
		})
	}
	wg.Wait()
	seen := map[int64]int{}
	for i, r := range reps {
		if errs[i] != nil {
			t.Fatalf("replay %d: %v", i, errs[i])
		}
		for _, res := range r.Results {
			if res.Action != deadletter.ActionReplayed {
				t.Errorf("dead letter %d: %s %s", res.ID, res.Action, res.Reason)
			}
			seen[res.ID]++
		}
	}
	t.Logf("concurrent replays: %d and %d dead letters", len(reps[0].Results), len(reps[1].Results))
	for id, n := range seen {
		if n != 1 {
			t.Errorf("dead letter %d replayed %d times by the two replays", id, n)
		}
	}
	if len(seen) != 65 {
		t.Errorf("the two replays covered %d dead letters, want 65", len(seen))
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 100 {
		t.Errorf("outbox rows = %d, want 100: one per dead letter", n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NULL`); n != 0 {
		t.Errorf("dead letters not replayed = %d, want 0", n)
	}
}

// A dead letter the relay filed never reached the stream: its replay is its first
// publish, for every consumer of the subject (no Idem-Replay-For), and has no
// horizon to refuse it by.
func TestReplayOfARelayDeadLetterIsForEveryConsumer(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := context.Background()
	id := fileDeadLetter(t, env.DB, outbox.RelayConsumer, "k-relay", "relay: maximum payload exceeded", "1 minute", nil)
	dls := deadletter.New(env.Inst)
	if res, err := dls.ReplayID(ctx, id, deadletter.ReplayOptions{}); err != nil || res.Action != deadletter.ActionReplayed {
		t.Fatalf("ReplayID = %+v, %v; want replayed", res, err)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'k-relay' AND NOT headers ? $1`, idem.HeaderReplayFor); n != 1 {
		t.Errorf("outbox rows of k-relay without %s = %d, want 1", idem.HeaderReplayFor, n)
	}
}
