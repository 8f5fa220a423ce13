package worker_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/worker"
)

// Dead letters are kept for worker.DefaultDeadLetterRetention after they were
// filed, replayed or not, and in any case until their consumer's inbox may have
// forgotten the key: the evidence of a message that can no longer be replayed
// safely must not vanish while a replay would still be allowed. The collector
// deletes the rest in bounded batches.
func TestCollectOnceDeletesExpiredDeadLetters(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	db := env.DB
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	insert := func(key, createdAgo, inboxExpires, replayed string, n int) {
		t.Helper()
		exec(`INSERT INTO idem_dead_letters (consumer, key, subject, message, payload, reason, created_at, inbox_expires_at, replayed_at)
		      SELECT 'c', $1 || '-' || g, 'test.x', 'test.x', '\x00', 'test', now() - $2::interval, `+inboxExpires+`, `+replayed+`
		      FROM generate_series(1, $3::int) g`, key, createdAgo, n)
	}
	retention := "720 hours" // DefaultDeadLetterRetention
	if worker.DefaultDeadLetterRetention.Hours() != 720 {
		t.Fatalf("DefaultDeadLetterRetention = %s; the test assumes 720h", worker.DefaultDeadLetterRetention)
	}
	// Past retention and past the inbox horizon: go, in several batches.
	insert("old", retention+" 1 minute", `now() - interval '1 hour'`, `NULL`, 2100)
	insert("old-replayed", retention+" 1 minute", `now() - interval '1 hour'`, `now()`, 3)
	// Filed before schema v3, no horizon recorded: retention alone decides.
	insert("old-pre-v3", retention+" 1 minute", `NULL`, `NULL`, 2)
	// Past retention but the inbox may still remember the key: stays.
	insert("old-inbox-live", retention+" 1 minute", `now() + interval '1 hour'`, `NULL`, 4)
	// Within retention: stays, whatever its horizon.
	insert("recent", "1 hour", `now() - interval '1 minute'`, `now()`, 5)
	insert("recent-pre-v3", "1 hour", `NULL`, `NULL`, 1)

	var mu sync.Mutex
	var batches []int // rows per DELETE of idem_dead_letters
	w, err := worker.New(env.Observed(t, func(e idem.Event) {
		if e.Component == idem.ComponentCollector && e.Name == "idem_dead_letters" && e.Outcome == idem.OutcomeDeleted {
			mu.Lock()
			batches = append(batches, e.Count)
			mu.Unlock()
		}
	}), worker.Config{Retention: worker.RetentionConfig{BatchSize: 1000}})
	if err != nil {
		t.Fatal(err)
	}
	n, err := w.CollectOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 2100+3+2 {
		t.Errorf("deleted %d rows, want %d", n, 2100+3+2)
	}
	mu.Lock()
	if !slices.Equal(batches, []int{1000, 1000, 105}) {
		t.Errorf("dead letters deleted in batches of %v, want 1000, 1000, 105", batches)
	}
	mu.Unlock()
	var kept string
	if err := db.Pool.QueryRow(ctx, `SELECT string_agg(DISTINCT k, ',' ORDER BY k) FROM (SELECT regexp_replace(key, '-[0-9]+$', '') AS k FROM idem_dead_letters) AS t`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	if kept != "old-inbox-live,recent,recent-pre-v3" {
		t.Errorf("dead letters kept: %q, want old-inbox-live, recent and recent-pre-v3", kept)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_dead_letters`); got != 4+5+1 {
		t.Errorf("dead letters left = %d, want 10", got)
	}
}

// On partitioned tables the collector drops whole partitions whose rows have all
// expired, and deletes row by row only in the default partition (the rows from
// before the conversion). It never deletes through the parent by ctid: a ctid is
// unique within one partition only, and the live row at the same ctid in another
// partition would go too.
func TestCollectorOnPartitionedTables(t *testing.T) {
	t.Parallel()
	// Migrated here, not by pgtest: the test needs the tables plain at first, even
	// under IDEM_TEST_PARTITIONED=1.
	env := testenv.NewWith(t, pgtest.Options{NoMigrate: true})
	db := env.DB
	ctx := context.Background()
	if _, err := migrations.Apply(ctx, db.Pool, migrations.Config{}); err != nil {
		t.Fatal(err)
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// Rows from before the conversion: expired, and one live.
	exec(`INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
	      SELECT 'c', 'legacy-' || g, 'test.x', '\x00', 'done', now() - interval '1 second' FROM generate_series(1, 5) g`)
	exec(`INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at) VALUES ('c', 'legacy-live', 'test.x', '\x00', 'done', now() + interval '1 hour')`)
	if _, err := partition.Convert(ctx, db.Pool, partition.Config{}); err != nil {
		t.Fatal(err)
	}
	// Live keys in today's partitions, at the same ctids as the default's rows.
	if _, err := partition.Maintain(ctx, db.Pool, partition.Config{}); err != nil {
		t.Fatal(err)
	}
	exec(`INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
	      SELECT 'c', 'new-' || g, 'test.x', '\x00', 'done', now() + interval '72 hours' FROM generate_series(1, 5) g`)

	// A past day, as a database converted long ago has it, holding expired keys;
	// the first row of each partition sits at ctid (0,1), like the default's first.
	day := time.Now().UTC().Truncate(partition.Day).AddDate(0, 0, -2)
	exec(fmt.Sprintf(`CREATE TABLE idem_inbox_p%s PARTITION OF idem_inbox FOR VALUES FROM ('%s') TO ('%s')`,
		day.Format("20060102"), day.Format(time.RFC3339), day.AddDate(0, 0, 1).Format(time.RFC3339)))
	exec(`INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
	      SELECT 'c', 'past-' || g, 'test.x', '\x00', 'done', $1::timestamptz + interval '1 hour' FROM generate_series(1, 7) g`, day)

	var mu sync.Mutex
	dropped := 0
	w, err := worker.New(env.Observed(t, func(e idem.Event) {
		if e.Component == idem.ComponentCollector && e.Outcome == idem.OutcomeDropped {
			mu.Lock()
			dropped += e.Count
			mu.Unlock()
		}
	}), worker.Config{})
	if err != nil {
		t.Fatal(err)
	}
	n, err := w.CollectOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 5 {
		t.Errorf("deleted %d rows, want the 5 expired ones of the default partition", n)
	}
	mu.Lock()
	if dropped != 1 {
		t.Errorf("dropped %d partitions, want the past day", dropped)
	}
	mu.Unlock()
	var left string
	if err := db.Pool.QueryRow(ctx, `SELECT string_agg(key, ',' ORDER BY key) FROM idem_inbox`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if want := "legacy-live,new-1,new-2,new-3,new-4,new-5"; left != want {
		t.Errorf("inbox keeps %q, want %q", left, want)
	}
}

// A collection round that straddles the conversion of the inbox (partition.Convert
// run between two of its batches) must not delete live keys. The round looked at
// the layout once, while the table was plain; its next batch runs the plain
// statement against the new partitioned parent, whose ctids repeat in every
// partition: a ctid of an expired row of the default partition is also a live
// key's in a day partition.
func TestCollectorRoundStraddlingConversionKeepsLiveKeys(t *testing.T) {
	t.Parallel()
	env := testenv.NewWith(t, pgtest.Options{NoMigrate: true}) // plain, even under IDEM_TEST_PARTITIONED=1
	db := env.DB
	ctx := context.Background()
	if _, err := migrations.Apply(ctx, db.Pool, migrations.Config{}); err != nil {
		t.Fatal(err)
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// Expired two days ago, so the conversion's default partition holds no row
	// of today or later and today's partitions can be attached.
	const expired, batch, live = 12, 5, 30
	exec(`INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
	      SELECT 'c', 'expired-' || g, 'test.x', '\x00', 'done', now() - interval '2 days' FROM generate_series(1, $1::int) g`, expired)

	converted := false
	var convErr error
	w, err := worker.New(env.Observed(t, func(e idem.Event) {
		// After the round's first batch of the inbox: convert, make the days,
		// and claim live keys in them, at the same ctids as the default's rows.
		if converted || e.Component != idem.ComponentCollector || e.Name != "idem_inbox" || e.Outcome != idem.OutcomeDeleted {
			return
		}
		converted = true
		if _, convErr = partition.Convert(ctx, db.Pool, partition.Config{}); convErr != nil {
			return
		}
		if _, convErr = partition.Maintain(ctx, db.Pool, partition.Config{}); convErr != nil {
			return
		}
		_, convErr = db.Pool.Exec(ctx, `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
		      SELECT 'c', 'live-' || g, 'test.x', '\x00', 'done', now() + interval '72 hours' FROM generate_series(1, $1::int) g`, live)
	}), worker.Config{Retention: worker.RetentionConfig{BatchSize: batch}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.CollectOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if !converted || convErr != nil {
		t.Fatalf("the conversion within the round: ran %v, err %v", converted, convErr)
	}
	var where string
	if err := db.Pool.QueryRow(ctx, `SELECT tableoid::regclass::text FROM idem_inbox WHERE key = 'live-1'`).Scan(&where); err != nil {
		t.Fatal(err)
	}
	if where == "idem_inbox_default" {
		t.Fatalf("the live keys went to the default partition: the test needs them in a day partition")
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key LIKE 'live-%'`); got != live {
		t.Fatalf("%d of %d live keys are left after a round that straddled the conversion", got, live)
	}
	// The next round sees the partitioned layout and collects the default partition.
	if _, err := w.CollectOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key LIKE 'expired-%'`); got != 0 {
		t.Errorf("%d expired keys left after the next round, want 0", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key LIKE 'live-%'`); got != live {
		t.Errorf("%d of %d live keys are left after the next round", got, live)
	}
}

// logBuffer collects log lines from any goroutine.
type logBuffer struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// After an inbox in use is converted, its live keys keep the days they cover
// from having partitions. The collector warns, once, naming until when the
// default partition holds them and from which day on partitions are attached.
func TestCollectorWarnsOfDaysWaitingForTheDefaultPartition(t *testing.T) {
	t.Parallel()
	env := testenv.NewWith(t, pgtest.Options{NoMigrate: true})
	db := env.DB
	ctx := context.Background()
	if _, err := migrations.Apply(ctx, db.Pool, migrations.Config{}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
	      VALUES ('c', 'live', 'test.x', '\x00', 'done', now() + interval '72 hours')`); err != nil {
		t.Fatal(err)
	}
	if _, err := partition.Convert(ctx, db.Pool, partition.Config{}); err != nil {
		t.Fatal(err)
	}
	logs := &logBuffer{}
	w, err := worker.New(env.Install(t, func(c *install.Config) { c.Logger = slog.New(slog.NewTextHandler(logs, nil)) }), worker.Config{})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := w.CollectOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var lines []string
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, "level=WARN") && strings.Contains(l, "table=idem_inbox") && strings.Contains(l, "wait for the default partition") {
			lines = append(lines, l)
		}
	}
	if len(lines) != 1 {
		t.Fatalf("%d warnings of the inbox's days waiting, want 1 in two rounds:\n%s", len(lines), logs.String())
	}
	for _, want := range []string{"default_holds_until=", "partitions_from=", "day partitions can be attached from"} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("the warning lacks %q: %s", want, lines[0])
		}
	}
}
