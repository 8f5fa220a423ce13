package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/pgembed"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/runenv"
	"github.com/idemkit/idem/embeddednats"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/ops"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/outbox"
)

// opsDB is a test database with idem's tables in schema and the reference
// application's tables.
func opsDB(t *testing.T, schema string) *pgtest.DB {
	t.Helper()
	db := pgtest.NewWith(t, pgtest.Options{Schema: schema})
	if err := refapp.Migrate(context.Background(), db.Pool); err != nil {
		t.Fatal(err)
	}
	return db
}

// seedKey writes one intent's rows as the ingress, relay and consumer would, with
// idem's tables in schema: the request and the payment under scope and bare key,
// the outbox, inbox and ledger under the scoped key. Its email message is still
// unpublished.
func seedKey(t *testing.T, db *pgtest.DB, schema, scope, key string) {
	t.Helper()
	ctx := context.Background()
	scoped := idem.ScopedKey(scope, idem.Key(key))
	ob := tablesOnlyOutbox(t, db, schema)
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		stmts := []struct {
			sql  string
			args []any
		}{
			{`INSERT INTO idem_requests (scope, key, fingerprint, method, path, status, response_code, response_body, expires_at)
			  VALUES ($1, $2, '\x0102030405060708090a', 'POST', '/v1/payments', 'done', 202, '{"status":"accepted"}', now() + interval '1 day')`, []any{scope, key}},
			{`INSERT INTO payments (scope, idempotency_key, account, amount_cents) VALUES ($1, $2, 'acct_ops', 1250)`, []any{scope, key}},
			{`INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, completed_at, expires_at)
			  VALUES ($2, $1, 'idem.payments.charge', '\x00', 'done', now(), now() + interval '1 day')`, []any{scoped, refapp.ChargeConsumer}},
			{`INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ($1, 'acct_ops', 1250)`, []any{scoped}},
			{`INSERT INTO idem_dead_letters (consumer, key, subject, payload, reason, deliveries)
			  VALUES ($3, $1, $2, '{}', 'fingerprint mismatch: test', 1)`, []any{scoped, refapp.SubjectCharge, refapp.ChargeConsumer}},
			// The registry: charges settled the key, audit (which reads everything)
			// has not yet.
			{`INSERT INTO idem_consumers (name, stream, filter_subject, key_lifetime)
			  VALUES ($1, $3, $2, interval '1 day'), ('audit', $3, 'idem.>', interval '1 day') ON CONFLICT DO NOTHING`,
				[]any{refapp.ChargeConsumer, refapp.SubjectCharge, refapp.StreamName}},
		}
		for _, s := range stmts {
			if _, err := tx.Exec(ctx, pgschema.Qualify(schema, s.sql), s.args...); err != nil {
				return err
			}
		}
		return ob.Enqueue(ctx, tx,
			idem.Message{Key: scoped, Subject: refapp.SubjectCharge, Payload: []byte(`{"account":"acct_ops","amount_cents":1250}`)},
			idem.Message{Key: scoped, Subject: refapp.SubjectEmail, Payload: []byte(`{"to":"a@example.com"}`)},
		)
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, pgschema.Qualify(schema, `UPDATE idem_outbox SET published_at = now(), attempts = 1, stream = $3, stream_seq = 7 WHERE key = $1 AND subject = $2`), scoped, refapp.SubjectCharge, refapp.StreamName); err != nil {
		t.Fatal(err)
	}
}

// worker runs the worker's command line and returns stdout, stderr and the exit code.
func worker(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(args, &out, &errb)
	return out.String(), errb.String(), code
}

func mustContain(t *testing.T, what, text string, wants ...string) {
	t.Helper()
	for _, w := range wants {
		if !strings.Contains(text, w) {
			t.Errorf("%s lacks %q:\n%s", what, w, text)
		}
	}
}

// effectRows returns the rows of the application table name in rep.
func effectRows(rep ops.KeyReport, name string) [][]string {
	for _, t := range rep.Effects.Tables {
		if t.Name == name {
			return t.Rows
		}
	}
	return nil
}

// count returns the application total name in st.
func count(st *ops.Stats, name string) int64 {
	for _, c := range st.Counts {
		if c.Name == name {
			return c.N
		}
	}
	return -1
}

func TestInspectPrintsAKeysWholeLife(t *testing.T) {
	t.Parallel()
	db := opsDB(t, "")
	seedKey(t, db, "", "tenant-a", "k-ops")
	seedKey(t, db, "", "tenant-b", "k-ops") // the same bare key in another scope is another intent

	// Flags may follow the key.
	out, errs, code := worker(t, "inspect", "k-ops", "--scope", "tenant-a", "--database-url", db.URL)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	mustContain(t, "inspect", out,
		`key "k-ops" (scope "tenant-a"; past the ingress the key is "tenant-a\x1fk-ops")`,
		"POST /v1/payments -> 202, done", "fingerprint  0102030405060708...", `{"status":"accepted"}`,
		"outbox (2 messages)", "idem.payments.charge: published; consumed by charges; not yet by audit", "into IDEM at sequence 7",
		"idem.emails.send: pending, not yet published", "not yet settled by audit: is that consumer running?",
		"inbox (1 consumer)", "charges: done",
		"dead letters (1)", "fingerprint mismatch: test",
		"application rows", "payments        id=", "ledger_entries  id=", "account=acct_ops amount_cents=1250 created_at=",
		"attention", "waits to be published", "worker dead-letters replay")
	if strings.Contains(out, "DOUBLE EFFECT") || strings.Count(out, "account=acct_ops") != 2 {
		t.Errorf("want one payment and one ledger row, no double effect:\n%s", out)
	}

	// A scoped key pasted from a log needs no --scope.
	out, errs, code = worker(t, "inspect", "--database-url", db.URL, "tenant-a\x1fk-ops")
	if code != 0 {
		t.Fatalf("scoped key: exit %d: %s", code, errs)
	}
	mustContain(t, "inspect of a scoped key", out, `key "k-ops" (scope "tenant-a"`, "charges: done")
}

func TestInspectFlagsADoubleEffect(t *testing.T) {
	t.Parallel()
	db := opsDB(t, "")
	seedKey(t, db, "", "", "k-twice")
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ('k-twice', 'acct_ops', 1250)`); err != nil {
		t.Fatal(err)
	}
	out, errs, code := worker(t, "inspect", "--database-url", db.URL, "k-twice")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	mustContain(t, "inspect", out, `key "k-twice" (no scope)`, "! DOUBLE EFFECT: 2 ledger entries for one key")
	// idem's notes come first, the application's after them.
	if i, j := strings.Index(out, "waits to be published"), strings.Index(out, "DOUBLE EFFECT"); i < 0 || j < i {
		t.Errorf("attention order:\n%s", out)
	}
}

func TestInspectUnknownKey(t *testing.T) {
	t.Parallel()
	db := opsDB(t, "")
	seedKey(t, db, "", "tenant-a", "k-ops")

	// Unknown is a failure a script can test for; the report still says why.
	out, errs, code := worker(t, "inspect", "k-ops", "--database-url", db.URL)
	if code != 1 {
		t.Fatalf("exit %d, want 1: %s", code, errs)
	}
	mustContain(t, "inspect", out, "Nothing is known about this key", `known in other scopes: "tenant-a". Did you mean --scope?`)
	mustContain(t, "inspect stderr", errs, `nothing is known about key "k-ops" (no scope)`)

	out, errs, code = worker(t, "inspect", "k-ops", "--json", "--database-url", db.URL)
	if code != 1 {
		t.Fatalf("--json: exit %d, want 1: %s", code, errs)
	}
	var r ops.KeyReport
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if r.Known || len(r.OtherScopes) != 1 {
		t.Errorf("json = %+v", r)
	}

	// Known in its scope: exit 0.
	if _, errs, code := worker(t, "inspect", "k-ops", "--scope", "tenant-a", "--database-url", db.URL); code != 0 {
		t.Errorf("known key: exit %d: %s", code, errs)
	}
}

func TestInspectJSON(t *testing.T) {
	t.Parallel()
	db := opsDB(t, "")
	seedKey(t, db, "", "tenant-a", "k-ops")
	out, errs, code := worker(t, "inspect", "--json", "--scope=tenant-a", "--database-url", db.URL, "k-ops")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var r ops.KeyReport
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if !r.Known || r.Request == nil || len(r.Outbox) != 2 || len(r.Inbox) != 1 || len(r.DeadLetters) != 1 ||
		len(effectRows(r, "payments")) != 1 || len(effectRows(r, "ledger_entries")) != 1 || r.ScopedKey != "tenant-a\x1fk-ops" {
		t.Errorf("json = %+v", r)
	}
}

func TestInspectBadArguments(t *testing.T) {
	t.Parallel()
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"inspect"}, "want exactly one KEY, got 0"},
		{[]string{"inspect", "a", "b"}, "want exactly one KEY, got 2"},
		{[]string{"inspect", "bad\tkey"}, "malformed idempotency key"},
		{[]string{"inspect", "--scope", "t-b", "t-a\x1fk"}, `KEY is scoped to "t-a" but --scope says "t-b"`},
		{[]string{"inspect", "--scope", "bad scope\t", "k"}, "--scope: idem: malformed idempotency key"},
		{[]string{"inspect", "--schema", "Bad-Schema", "k"}, `--schema: schema "Bad-Schema"`},
		{[]string{"stats", "--schema", "Bad-Schema"}, `--schema: schema "Bad-Schema"`},
	}
	for _, tc := range cases {
		_, errs, code := worker(t, tc.args...)
		if code != exitUsage || !strings.Contains(errs, tc.want) {
			t.Errorf("%q: exit %d, stderr %q; want 2 (usage) and %q", tc.args, code, errs, tc.want)
		}
	}
}

// --schema: idem's tables in their own schema, the application's where Migrate put
// them.
func TestInspectAndStatsInASchema(t *testing.T) {
	t.Parallel()
	const schema = "ops_cli"
	db := opsDB(t, schema)
	seedKey(t, db, schema, "", "k-schema")

	out, errs, code := worker(t, "inspect", "k-schema", "--schema", schema, "--database-url", db.URL)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	mustContain(t, "inspect --schema", out, "outbox (2 messages)", "charges: done", "dead letters (1)", "ledger_entries  id=")

	// Without --schema there are no idem tables to read.
	if _, errs, code := worker(t, "inspect", "k-schema", "--database-url", db.URL); code != 1 || !strings.Contains(errs, "idem_requests") {
		t.Errorf("no --schema: exit %d, stderr %q", code, errs)
	}

	out, errs, code = worker(t, "stats", "--json", "--schema", schema, "--database-url", db.URL, "--nats-url=", "--data-dir", t.TempDir())
	if code != 0 {
		t.Fatalf("stats: exit %d: %s", code, errs)
	}
	var st statsOutput
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if st.Requests.Total != 1 || st.Outbox.Pending != 1 || st.Outbox.Published != 1 || count(st.Stats, "payments") != 1 {
		t.Errorf("stats --schema = %+v", st.Stats)
	}
}

func TestStatsWithoutJetStream(t *testing.T) {
	t.Parallel()
	db := opsDB(t, "")
	seedKey(t, db, "", "", "k-1")
	seedKey(t, db, "", "", "k-2")
	dataDir := t.TempDir()

	out, errs, code := worker(t, "stats", "--json", "--database-url", db.URL, "--nats-url=", "--data-dir", dataDir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var st statsOutput
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if st.Requests.Total != 2 || st.Outbox.Pending != 2 || st.Outbox.Published != 2 || st.DeadLetters.NotReplayed != 2 ||
		count(st.Stats, "ledger_entries") != 2 || count(st.Stats, "payments") != 2 || count(st.Stats, "emails") != 0 ||
		len(st.Inbox) != 1 || st.Inbox[0].Rows != 2 || st.JetStream != nil ||
		st.Delivery.Unproven != 2 || len(st.Consumers) != 2 {
		t.Errorf("stats = %+v", st.Stats)
	}
	mustContain(t, "stats --json", st.JetStreamError, "no --nats-url and no "+runenv.NATSURLFile)

	out, _, _ = worker(t, "stats", "--database-url", db.URL, "--nats-url=", "--data-dir", dataDir)
	mustContain(t, "stats", out, "requests", "2 total, 0 running", "2 pending (0 failing), 2 published; oldest pending waits",
		"2 total, 2 not replayed", "application rows", "payments 2, emails 0, ledger_entries 2", "charges", "jetstream: no --nats-url",
		"2 published but not yet consumed by every consumer (0 lagging, 0 unrouted); oldest written", "0 re-driven, 0 given up on",
		"registered consumers", "audit     IDEM    idem.>")

	// A URL file left by a worker that has stopped: a note, not a failure.
	if err := os.WriteFile(filepath.Join(dataDir, runenv.NATSURLFile), []byte("nats://127.0.0.1:1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errs, code = worker(t, "stats", "--database-url", db.URL, "--nats-url=", "--data-dir", dataDir)
	if code != 0 {
		t.Fatalf("stale URL file: exit %d: %s", code, errs)
	}
	mustContain(t, "stats", out, "does not answer: is the worker running?")

	// A URL the user gave must work.
	_, errs, code = worker(t, "stats", "--database-url", db.URL, "--nats-url", "nats://127.0.0.1:1")
	if code != 1 || !strings.Contains(errs, "connect to NATS at nats://127.0.0.1:1") {
		t.Errorf("bad --nats-url: exit %d, %s", code, errs)
	}
}

func TestStatsShowsConsumerLag(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := testenv.Ctx(t)
	if err := refapp.Migrate(ctx, env.DB.Pool); err != nil {
		t.Fatal(err)
	}
	// The reference application's stream, which stats reads, beside the test one.
	if _, err := env.JS.CreateStream(ctx, jetstream.StreamConfig{Name: refapp.StreamName, Subjects: []string{refapp.StreamSubjects}}); err != nil {
		t.Fatal(err)
	}
	if _, err := env.JS.CreateOrUpdateConsumer(ctx, refapp.StreamName, jetstream.ConsumerConfig{
		Durable: refapp.ChargeConsumer, FilterSubject: refapp.SubjectCharge, AckPolicy: jetstream.AckExplicitPolicy,
	}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		env.Publish(t, refapp.SubjectCharge, "k", "", fmt.Appendf(nil, `{"account":"a","amount_cents":%d}`, i+1))
	}

	// Found through the URL file a running worker keeps under --data-dir.
	dataDir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dataDir, runenv.NATSURLFile), []byte(env.NATS.URL()+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errs, code := worker(t, "stats", "--json", "--database-url", env.DB.URL, "--nats-url=", "--data-dir", dataDir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var st statsOutput
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	js := st.JetStream
	if js == nil || js.Stream != refapp.StreamName || js.Messages != 3 || len(js.Consumers) != 1 || js.Consumers[0].Name != refapp.ChargeConsumer || js.Consumers[0].NumPending != 3 {
		t.Fatalf("jetstream = %+v (error %q)", js, st.JetStreamError)
	}
	if c := js.Consumers[0]; c.Lag != 3 || st.RateOverSeconds < 1 {
		t.Errorf("charges: lag %d over %.2fs, want 3 over a second or more", c.Lag, st.RateOverSeconds)
	}
	if r, ok := st.ConsumerRates[refapp.ChargeConsumer]; !ok || r != 0 {
		t.Errorf("consumer rates %v, want charges at 0/s (nothing consumes)", st.ConsumerRates)
	}

	out, _, _ = worker(t, "stats", "--database-url", env.DB.URL, "--nats-url", env.NATS.URL())
	mustContain(t, "stats", out, "jetstream "+embeddednats.Redact(env.NATS.URL()), "stream IDEM: 3 messages", refapp.ChargeConsumer, refapp.SubjectCharge,
		"lag", "rate", "0.0/s", "lag: messages not yet finished (pending + ack pending); rate: deliveries finished per second over the last 1")
	if token := env.NATS.Options().Token; strings.Contains(out, token) {
		t.Errorf("stats shows the server's token:\n%s", out)
	}

	// A consumer at work while stats reads: its rate is what it finished between
	// the two readings.
	for i := range 40 {
		env.Publish(t, refapp.SubjectCharge, fmt.Sprintf("w-%d", i), "", []byte(`{}`))
	}
	cons, err := env.JS.Consumer(ctx, refapp.StreamName, refapp.ChargeConsumer)
	if err != nil {
		t.Fatal(err)
	}
	stop, acked := make(chan struct{}), make(chan int)
	go func() {
		n := 0
		defer func() { acked <- n }()
		for {
			select {
			case <-stop:
				return
			case <-time.After(25 * time.Millisecond):
			}
			msgs, err := cons.FetchNoWait(1)
			if err != nil {
				continue
			}
			for m := range msgs.Messages() {
				if m.Ack() == nil {
					n++
				}
			}
		}
	}()
	out, errs, code = worker(t, "stats", "--json", "--database-url", env.DB.URL, "--nats-url", env.NATS.URL())
	close(stop)
	if n := <-acked; n == 0 {
		t.Fatal("the test's consumer acknowledged nothing")
	}
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	st = statsOutput{}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if r := st.ConsumerRates[refapp.ChargeConsumer]; r <= 0 {
		t.Errorf("charges finished messages while stats read, at %.2f/s by stats", r)
	}
}

func TestHuman(t *testing.T) {
	for d, want := range map[time.Duration]string{
		850 * time.Millisecond:                         "850ms",
		42 * time.Second:                               "42s",
		3*time.Minute + 12*time.Second:                 "3m12s",
		24 * time.Hour:                                 "24h",
		5*time.Hour + 3*time.Minute:                    "5h3m",
		3*24*time.Hour + 4*time.Hour:                   "3d4h",
		6*24*time.Hour + 23*time.Hour + 59*time.Minute: "7d0h",
	} {
		if got := human(d); got != want {
			t.Errorf("human(%v) = %q, want %q", d, got, want)
		}
	}
}

// A zero-setup worker keeps its rows in a private Postgres under --data-dir; with
// no database named, the operator commands find it there.
func TestOpsFindThePrivatePostgres(t *testing.T) {
	t.Setenv("DATABASE_URL", "") // "not named"; rules out t.Parallel
	cfg, err := pgconn.ParseConfig(pgtest.AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	// Pretend the server the tests use is the worker's private one.
	dataDir := t.TempDir()
	pgDir := filepath.Join(dataDir, pgembed.Subdir)
	if err := os.MkdirAll(pgDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(pgDir, "port"), []byte(strconv.Itoa(int(cfg.Port))+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	parse := func(args ...string) *dbOptions {
		var o dbOptions
		fs := newFlagSet("test", noEnv)
		o.flags(fs)
		if _, err := fs.parse(args); err != nil {
			t.Fatal(err)
		}
		return &o
	}

	o := parse("--data-dir", dataDir)
	o.databaseURL = "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable" // nothing answers at "the default"
	pool, err := openOpsPool(ctx, o)
	if err != nil {
		t.Fatalf("did not find the private Postgres: %v", err)
	}
	if got := pool.Config().ConnConfig.Port; got != cfg.Port {
		t.Errorf("connected to port %d, want the recorded %d", got, cfg.Port)
	}
	pool.Close()

	// A database the user named is used or fails: never silently replaced.
	o = parse("--data-dir", dataDir, "--database-url", "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable")
	if _, err := openOpsPool(ctx, o); err == nil {
		t.Error("an explicit --database-url that does not answer was replaced")
	}

	// No private cluster either: say so.
	o = parse("--data-dir", t.TempDir())
	o.databaseURL = "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable"
	if _, err := openOpsPool(ctx, o); err == nil || !strings.Contains(err.Error(), "no private Postgres was ever started") {
		t.Errorf("err = %v", err)
	}
}

// The operator commands find a zero-setup worker's private Postgres (and its
// embedded JetStream) from any working directory, with the data dir given by the
// environment only, while the worker runs (they take none of its locks), and even
// though a Postgres answers at the default URL: the data dir records that its
// worker uses the private cluster.
func TestOpsFindTheZeroSetupWorkerFromAnyDirectory(t *testing.T) {
	if _, err := os.Stat("/usr/lib/postgresql"); err != nil {
		t.Skip("no PostgreSQL server binaries on this machine") // .ci/run installs them
	}
	// A home the postgres system user can reach when the test runs as root.
	home, err := os.MkdirTemp("", "idem-home-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(home, 0o755) //nolint:errcheck // the postgres user must reach it
	t.Cleanup(func() { os.RemoveAll(home) })
	for k, v := range map[string]string{"XDG_STATE_HOME": filepath.Join(home, "state"), "HOME": home,
		"IDEM_DATA_DIR": "", "DATABASE_URL": "", "NATS_URL": "", "IDEM_SCHEMA": ""} {
		t.Setenv(k, v) // rules out t.Parallel
	}
	dataDir := filepath.Join(home, "state", "idem")

	// The worker as runService opens it when nothing answers at its default URL.
	ctx := context.Background()
	e, err := runenv.Open(ctx, runenv.Config{DatabaseURL: "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable",
		PrivatePostgres: true, DataDir: dataDir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := e.Close(ctx); err != nil {
			t.Error(err)
		}
	})
	if _, err := migrations.Apply(ctx, e.Pool, migrations.Config{}); err != nil {
		t.Fatal(err)
	}
	if err := refapp.Migrate(ctx, e.Pool); err != nil {
		t.Fatal(err)
	}
	seedKey(t, &pgtest.DB{Pool: e.Pool}, "", "", "k-zero-setup")
	js, err := jetstream.New(e.NC)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: refapp.StreamName, Subjects: []string{refapp.StreamSubjects}}); err != nil {
		t.Fatal(err)
	}

	t.Chdir(t.TempDir()) // anywhere but where the worker started

	out, errs, code := worker(t, "inspect", "k-zero-setup")
	if code != 0 {
		t.Fatalf("inspect: exit %d: %s\n%s", code, errs, out)
	}
	mustContain(t, "inspect", out, "charges: done", "dead letters (1)")

	out, errs, code = worker(t, "stats", "--json")
	if code != 0 {
		t.Fatalf("stats: exit %d: %s", code, errs)
	}
	var st statsOutput
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if st.Requests.Total != 1 || count(st.Stats, "payments") != 1 {
		t.Errorf("stats = %+v", st.Stats)
	}
	if st.JetStream == nil || st.JetStream.Stream != refapp.StreamName {
		t.Errorf("stats found no JetStream: %+v (%s)", st.JetStream, st.JetStreamError)
	} else if strings.Contains(out, e.NATSURL) || strings.Contains(out, "@") {
		t.Errorf("stats prints the NATS credential:\n%s", out)
	}

	out, errs, code = worker(t, "dead-letters", "list")
	if code != 0 || !strings.Contains(out, "fingerprint mismatch: test") {
		t.Errorf("dead-letters list: exit %d: %s\n%s", code, errs, out)
	}

	t.Setenv("IDEM_SCHEMA", "zero_setup")
	if out, errs, code = worker(t, "migrate"); code != 0 {
		t.Fatalf("migrate: exit %d: %s\n%s", code, errs, out)
	}
	var n int
	if err := e.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = 'zero_setup' AND tablename = 'idem_outbox'`).Scan(&n); err != nil || n != 1 {
		t.Errorf("migrate did not reach the private cluster: %d tables, %v", n, err)
	}
}

// tablesOnlyOutbox is the application's outbox in schema of db, with no broker:
// what a test writes there the worker under test publishes.
func tablesOnlyOutbox(t *testing.T, db *pgtest.DB, schema string) *outbox.Outbox {
	t.Helper()
	inst, err := install.New(db.Pool, nil, refapp.Config{Schema: schema}.InstallConfig())
	if err != nil {
		t.Fatal(err)
	}
	return outbox.New(inst)
}

// A request the ingress is running has no record until it commits; inspect shows
// it in flight by the key's lock.
func TestInspectShowsARequestInFlight(t *testing.T) {
	t.Parallel()
	db := opsDB(t, "")
	ctx := context.Background()
	hold, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Rollback(ctx)
	if _, err := hold.Exec(ctx, store.New("").Requests.Lock, int32(store.RequestLock("tenant-a", "k-fly")), "5000ms"); err != nil {
		t.Fatal(err)
	}
	out, errs, code := worker(t, "inspect", "k-fly", "--scope", "tenant-a", "--database-url", db.URL)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	mustContain(t, "inspect", out, "in flight now: backend pid", "0 duplicates waiting", "its record is written when it commits")
	if strings.Contains(out, "Nothing is known") {
		t.Errorf("a key in flight is reported unknown:\n%s", out)
	}
}
