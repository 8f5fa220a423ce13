package partition_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

type bundle struct {
	db  *pgtest.DB
	ctx context.Context
	cfg partition.Config
}

// setup gives each test a migrated database of its own, still plain.
func setup(t *testing.T, schema string) bundle {
	t.Helper()
	return bundle{db: pgtest.NewWith(t, pgtest.Options{Schema: schema}), ctx: context.Background(), cfg: partition.Config{Schema: schema}}
}

func (b bundle) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if _, err := b.db.Pool.Exec(b.ctx, sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func (b bundle) partitions(t *testing.T, table partition.Table) []partition.Partition {
	t.Helper()
	tx, err := b.db.Pool.Begin(b.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(b.ctx) //nolint:errcheck
	if _, err := tx.Exec(b.ctx, `SET LOCAL TimeZone = 'UTC'`); err != nil {
		t.Fatal(err)
	}
	parts, err := partition.List(b.ctx, tx, b.cfg, table)
	if err != nil {
		t.Fatal(err)
	}
	return parts
}

// Converting keeps every row where it was (in the default partition), keeps every
// statement of the protocol working, and is idempotent; Maintain then gives new
// rows day partitions out to the key lifetime plus Ahead.
func TestConvertInPlace(t *testing.T) {
	t.Parallel()
	for _, schema := range []string{"", "orders"} {
		t.Run("schema="+schema, func(t *testing.T) {
			t.Parallel()
			b := setup(t, schema)
			q := func(table string) string { return pgx.Identifier{pgtestSchema(schema), table}.Sanitize() }
			b.exec(t, `INSERT INTO `+q("idem_inbox")+` (consumer, key, message, fingerprint, status, expires_at)
			           SELECT 'c', 'old-' || g, 'test.x', '\x00', 'done', now() + interval '1 hour' FROM generate_series(1, 50) g`)
			b.exec(t, `INSERT INTO `+q("idem_outbox")+` (key, subject, msg_id, payload)
			           SELECT 'k' || g, 'test.x', 'm' || g, '\x00' FROM generate_series(1, 20) g`)

			r, err := partition.Convert(b.ctx, b.db.Pool, b.cfg)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(r.Converted, partition.Tables()) {
				t.Fatalf("Converted = %v, want %v", r.Converted, partition.Tables())
			}
			for _, table := range partition.Tables() {
				ok, err := partition.IsPartitioned(b.ctx, b.db.Pool, schema, table)
				if err != nil || !ok {
					t.Fatalf("%s partitioned = %v, %v", table, ok, err)
				}
			}
			if got := b.db.Count(t, `SELECT count(*) FROM `+q("idem_inbox_default")); got != 50 {
				t.Fatalf("default partition holds %d inbox rows, want the 50 from before", got)
			}
			// The serial id goes on from where it was, from the sequence the
			// partitioned table now owns.
			var id int64
			if err := b.db.Pool.QueryRow(b.ctx, `INSERT INTO `+q("idem_outbox")+` (key, subject, msg_id, payload) VALUES ('n', 'test.x', 'n', '\x00') RETURNING id`).Scan(&id); err != nil {
				t.Fatal(err)
			}
			if id != 21 {
				t.Fatalf("next outbox id = %d, want 21", id)
			}
			var owner string
			if err := b.db.Pool.QueryRow(b.ctx, `SELECT pg_get_serial_sequence($1, 'id')`, q("idem_outbox")).Scan(&owner); err != nil || owner == "" {
				t.Fatalf("idem_outbox.id owns no sequence (%q, %v)", owner, err)
			}
			// The index names the migrations created belong to the partitioned table.
			if got := b.db.Count(t, `SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = 'idem_outbox' AND indexname = 'idem_outbox_pending'`, pgtestSchema(schema)); got != 1 {
				t.Fatal("idem_outbox_pending is not an index of the partitioned idem_outbox")
			}

			again, err := partition.Convert(b.ctx, b.db.Pool, b.cfg)
			if err != nil || len(again.Converted) != 0 || len(again.Already) != 2 {
				t.Fatalf("second Convert = %+v, %v; want both already partitioned", again, err)
			}

			m, err := partition.Maintain(b.ctx, b.db.Pool, b.cfg)
			if err != nil {
				t.Fatal(err)
			}
			// The inbox's default holds rows expiring within the hour, so its
			// ranged partitions start tomorrow, or the day after in the last hour
			// of a day; the outbox's today's rows sit in the default too.
			inbox := b.partitions(t, partition.Inbox)
			if len(inbox) < 1+4 || !inbox[0].Default {
				t.Fatalf("inbox partitions = %v; want the default and the days out to 72h + 48h", inbox)
			}
			last := inbox[len(inbox)-1]
			var now time.Time
			if err := b.db.Pool.QueryRow(b.ctx, `SELECT now()`).Scan(&now); err != nil {
				t.Fatal(err)
			}
			if want := now.Add(partition.DefaultKeyLifetime + partition.DefaultAhead); last.To.Before(want) {
				t.Fatalf("last inbox partition ends %s, before now + lifetime + ahead (%s)", last.To, want)
			}
			if len(m.Created) == 0 {
				t.Fatal("Maintain created nothing")
			}
			// A new claim, expiring in 72h, lands in its day's partition.
			var where string
			if err := b.db.Pool.QueryRow(b.ctx, `INSERT INTO `+q("idem_inbox")+` (consumer, key, message, fingerprint, status, expires_at)
			    VALUES ('c', 'new', 'test.x', '\x00', 'done', now() + interval '72 hours') RETURNING tableoid::regclass::text`).Scan(&where); err != nil {
				t.Fatal(err)
			}
			if want := "idem_inbox_p" + now.UTC().Add(72*time.Hour).Format("20060102"); !containsName(where, want) {
				t.Fatalf("a key expiring in 72h went to %s, want %s", where, want)
			}
			// A second round has nothing to do.
			m2, err := partition.Maintain(b.ctx, b.db.Pool, b.cfg)
			if err != nil || len(m2.Created)+len(m2.Dropped) != 0 {
				t.Fatalf("second Maintain = %+v, %v; want nothing to do", m2, err)
			}
		})
	}
}

func pgtestSchema(s string) string {
	if s == "" {
		return "public"
	}
	return s
}

func containsName(regclass, name string) bool {
	return regclass == name || regclass == `public.`+name || len(regclass) > len(name) && regclass[len(regclass)-len(name):] == name
}

// A partition is dropped exactly when the collector would have deleted every row
// in it: an inbox day whose range has passed; an outbox day once none of its rows
// is pending, unproven or within its retention. Nothing live is ever dropped.
func TestMaintainDropsWhatHasExpiredAndNothingElse(t *testing.T) {
	t.Parallel()
	b := setup(t, "")
	if _, err := partition.Convert(b.ctx, b.db.Pool, b.cfg); err != nil {
		t.Fatal(err)
	}
	// Past days, as a database converted long ago would have them.
	day := func(n int) time.Time { return time.Now().UTC().Truncate(partition.Day).AddDate(0, 0, n) }
	past := func(table partition.Table, n int) string {
		name := fmt.Sprintf("%s_p%s", table, day(n).Format("20060102"))
		b.exec(t, fmt.Sprintf(`CREATE TABLE %s PARTITION OF %s FOR VALUES FROM ('%s') TO ('%s')`,
			name, table, day(n).Format(time.RFC3339), day(n+1).Format(time.RFC3339)))
		return name
	}
	inboxOld := past(partition.Inbox, -3)
	b.exec(t, `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
	           SELECT 'c', 'k' || g, 'test.x', '\x00', 'done', $1::timestamptz + g * interval '1 minute' FROM generate_series(1, 100) g`, day(-3))

	outboxDone, outboxPending, outboxUnproven := past(partition.Outbox, -4), past(partition.Outbox, -3), past(partition.Outbox, -2)
	// Published and past retention: collectable.
	b.exec(t, `INSERT INTO idem_outbox (key, subject, msg_id, payload, created_at, published_at, expires_at)
	           SELECT 'd' || g, 'test.x', 'd' || g, '\x00', $1::timestamptz + interval '1 hour', now(), now() - interval '1 minute' FROM generate_series(1, 10) g`, day(-4))
	// One row still pending among collectable ones: the day stays.
	b.exec(t, `INSERT INTO idem_outbox (key, subject, msg_id, payload, created_at, published_at, expires_at)
	           SELECT 'p' || g, 'test.x', 'p' || g, '\x00', $1::timestamptz + interval '1 hour', now(), now() - interval '1 minute' FROM generate_series(1, 10) g`, day(-3))
	b.exec(t, `INSERT INTO idem_outbox (key, subject, msg_id, payload, created_at) VALUES ('pending', 'test.x', 'pending', '\x00', $1::timestamptz + interval '2 hours')`, day(-3))
	// Published, awaiting the reconciler's proof (no expiry yet): the day stays.
	b.exec(t, `INSERT INTO idem_outbox (key, subject, msg_id, payload, created_at, published_at) VALUES ('unproven', 'test.x', 'unproven', '\x00', $1::timestamptz + interval '1 hour', now())`, day(-2))

	r, err := partition.Maintain(b.ctx, b.db.Pool, b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	dropped := map[string]bool{}
	for _, p := range r.Dropped {
		dropped[p.Name] = true
	}
	kept := map[string]bool{}
	for _, p := range r.Kept {
		kept[p.Name] = true
	}
	if !dropped[inboxOld] || !dropped[outboxDone] {
		t.Fatalf("dropped %v; want %s and %s", r.Dropped, inboxOld, outboxDone)
	}
	if dropped[outboxPending] || dropped[outboxUnproven] || !kept[outboxPending] || !kept[outboxUnproven] {
		t.Fatalf("dropped %v, kept %v; want %s and %s kept", r.Dropped, r.Kept, outboxPending, outboxUnproven)
	}
	if got := b.db.Count(t, `SELECT count(*) FROM idem_outbox WHERE key IN ('pending', 'unproven')`); got != 2 {
		t.Fatalf("%d of the live outbox rows are left, want 2", got)
	}

	// Once published and proven, their retention passes and the days go too.
	b.exec(t, `UPDATE idem_outbox SET published_at = now(), completed_at = now(), expires_at = now() - interval '1 second' WHERE key IN ('pending', 'unproven')`)
	r, err = partition.Maintain(b.ctx, b.db.Pool, b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Dropped) != 2 {
		t.Fatalf("second round dropped %v, want the two outbox days", r.Dropped)
	}
	for _, p := range b.partitions(t, partition.Outbox) {
		if !p.Default && !p.To.After(time.Now()) {
			t.Fatalf("partition %s is past and still there", p)
		}
	}
}

// A key whose lifetime ends today and one whose lifetime ends in a week land in
// different partitions, which no unique index spans: only the claim's key lock
// stops the second from being claimed afresh while the first is uncommitted.
// The dedupe package's tests cover the claim itself (IDEM_TEST_PARTITIONED=1 runs
// them on this layout); this one shows the table alone does not enforce it.
func TestTheTableAloneDoesNotEnforceOneRowPerKey(t *testing.T) {
	t.Parallel()
	b := setup(t, "")
	if _, err := partition.Convert(b.ctx, b.db.Pool, b.cfg); err != nil {
		t.Fatal(err)
	}
	if _, err := partition.Maintain(b.ctx, b.db.Pool, partition.Config{KeyLifetime: 8 * partition.Day}); err != nil {
		t.Fatal(err)
	}
	b.exec(t, `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at) VALUES ('c', 'k', 'test.x', '\x00', 'done', now() + interval '1 hour')`)
	b.exec(t, `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at) VALUES ('c', 'k', 'test.x', '\x00', 'done', now() + interval '7 days')`)
	if got := b.db.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'c' AND key = 'k'`); got != 2 {
		t.Fatalf("%d rows for one key; the premise of the key lock is that the table allows 2", got)
	}
}

// Converting an inbox in use leaves its live keys in the default partition, so the
// days they cover cannot have partitions of their own until they have expired.
// Maintain reports it once per table, naming until when and from which day on.
func TestMaintainReportsDaysWaitingForTheDefaultPartition(t *testing.T) {
	t.Parallel()
	b := setup(t, "")
	b.exec(t, `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
	           SELECT 'c', 'live-' || g, 'test.x', '\x00', 'done', now() + g * interval '1 hour' FROM generate_series(1, 72) g`)
	if _, err := partition.Convert(b.ctx, b.db.Pool, b.cfg); err != nil {
		t.Fatal(err)
	}
	r, err := partition.Maintain(b.ctx, b.db.Pool, b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	var until time.Time
	if err := b.db.Pool.QueryRow(b.ctx, `SELECT max(expires_at) FROM idem_inbox`).Scan(&until); err != nil {
		t.Fatal(err)
	}
	var inbox *partition.Waiting
	for i, w := range r.Waiting {
		if w.Table == partition.Inbox {
			inbox = &r.Waiting[i]
		}
	}
	if inbox == nil {
		t.Fatalf("Waiting = %+v, want the inbox's", r.Waiting)
	}
	from := until.UTC().Truncate(partition.Day).Add(partition.Day)
	if !inbox.Until.Equal(until) || !inbox.From.Equal(from) {
		t.Errorf("inbox waits until %s, partitions from %s; want %s and %s", inbox.Until, inbox.From, until, from)
	}
	today := time.Now().UTC().Truncate(partition.Day)
	if want := int(from.Sub(today) / partition.Day); len(inbox.Days) != want {
		t.Errorf("days without a partition: %v, want the %d from today to %s", inbox.Days, want, until)
	}
	for _, s := range []string{"idem_inbox: the default partition holds rows up to", "converted while in use", "day partitions can be attached from " + from.Format(time.DateOnly)} {
		if !strings.Contains(inbox.String(), s) {
			t.Errorf("%q lacks %q", inbox.String(), s)
		}
	}
	// The day it names has its partition.
	for _, p := range b.partitions(t, partition.Inbox) {
		if !p.Default && p.From.Before(from) {
			t.Errorf("partition %s was attached over the default partition's days", p)
		}
	}
	created := false
	for _, p := range r.Created {
		created = created || p.Table == partition.Inbox && p.From.Equal(from)
	}
	if !created {
		t.Errorf("created %v, want the inbox's partition of %s", r.Created, from.Format(time.DateOnly))
	}
}
