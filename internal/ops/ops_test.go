package ops_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/ops"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/outbox"
)

// The test's own topology and application table: ops knows no application.
const (
	subjectOrder = "test.orders.place"
	subjectMail  = "test.mail.send"
	consumerShip = "shipper"
	consumerMail = "mailer"
)

// sqlCreateShipments is the test application's effect table: one row per shipment
// a consumer made, by scoped key. Like any effect table of the kind, it has no
// unique key, so a double effect shows up as a second row.
const sqlCreateShipments = `
CREATE TABLE public.shipments (
    id         bigserial   PRIMARY KEY,
    key        text        NOT NULL,
    carrier    text        NOT NULL,
    tracking   text,
    weight_kg  numeric     NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)`

// shipmentEffects is the test application's EffectsFunc.
func shipmentEffects(ctx context.Context, tx pgx.Tx, scope string, key idem.Key) (ops.Effects, error) {
	t, err := ops.QueryTable(ctx, tx, "shipments",
		`SELECT id, carrier, tracking, weight_kg FROM public.shipments WHERE key = $1 ORDER BY id`, idem.ScopedKey(scope, key))
	if err != nil {
		return ops.Effects{}, err
	}
	e := ops.Effects{Tables: []ops.EffectTable{t}}
	if n := len(t.Rows); n > 1 {
		e.Attention = append(e.Attention, fmt.Sprintf("DOUBLE EFFECT: %d shipments for one key", n))
	}
	return e, nil
}

// shipmentCounts is the test application's CountsFunc.
func shipmentCounts(ctx context.Context, tx pgx.Tx) ([]ops.Count, error) {
	var n int64
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM public.shipments`).Scan(&n); err != nil {
		return nil, err
	}
	return []ops.Count{{Name: "shipments", N: n}}, nil
}

// newDB is a test database with idem's tables in schema and the shipments table.
func newDB(t *testing.T, schema string) *pgtest.DB {
	t.Helper()
	db := pgtest.NewWith(t, pgtest.Options{Schema: schema})
	exec(t, db, "", sqlCreateShipments)
	return db
}

func newReader(t *testing.T, db *pgtest.DB, cfg ops.Config) *ops.Reader {
	t.Helper()
	r, err := ops.New(db.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// tables is the installation of db's idem tables in schema, without a NATS
// connection: ops reads tables only. Its stream takes the test's subjects.
func tables(t *testing.T, db *pgtest.DB, schema string) *install.Installation {
	t.Helper()
	inst, err := install.New(db.Pool, nil, install.Config{Schema: schema, Stream: install.Stream{Name: testenv.Stream, Subjects: []string{testenv.Subjects}}})
	if err != nil {
		t.Fatal(err)
	}
	return inst
}

// exec runs sql with idem's tables qualified for schema.
func exec(t *testing.T, db *pgtest.DB, schema, sql string, args ...any) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), pgschema.Qualify(schema, sql), args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// seedLife writes one intent's rows in schema the way the ingress, relay and
// consumers do: scope and bare key in idem_requests; the scoped key everywhere past
// the ingress, the test application's shipment included.
func seedLife(t *testing.T, db *pgtest.DB, schema, scope, key string) string {
	t.Helper()
	ctx := context.Background()
	scoped := idem.ScopedKey(scope, idem.Key(key))
	ob := outbox.New(tables(t, db, schema))
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, pgschema.Qualify(schema, `INSERT INTO idem_requests (scope, key, fingerprint, method, path, response_code, response_body, expires_at)
			VALUES ($1, $2, '\xdeadbeefcafef00d0102', 'POST', '/v1/orders', 202, '{"status":"accepted"}', now() + interval '1 day')`), scope, key); err != nil {
			return err
		}
		return ob.Enqueue(ctx, tx,
			idem.Message{Key: scoped, Subject: subjectOrder, Payload: []byte(`{"sku":"x-1","qty":2}`)},
			idem.Message{Key: scoped, Subject: subjectMail, Payload: []byte(`{"to":"a@example.com"}`)},
		)
	})
	if err != nil {
		t.Fatal(err)
	}
	exec(t, db, schema, `UPDATE idem_outbox SET published_at = now(), attempts = 1 WHERE key = $1 AND subject = $2`, scoped, subjectOrder)
	exec(t, db, schema, `UPDATE idem_outbox SET attempts = 3, last_error = 'nats: timeout' WHERE key = $1 AND subject = $2`, scoped, subjectMail)
	// A binary result (not UTF-8), and an external effect whose worker died mid-way.
	exec(t, db, schema, `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, result, completed_at, expires_at)
		VALUES ($2, $1, 'test.orders.place', '\x00', 'done', '\xff00fe', now(), now() + interval '1 day')`, scoped, consumerShip)
	exec(t, db, schema, `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, lease_until, lease_attempts, step, expires_at)
		VALUES ($2, $1, 'test.mail.send', '\x00', 'leased', now() - interval '1 minute', 2, 'sent', now() + interval '1 day')`, scoped, consumerMail)
	exec(t, db, schema, `INSERT INTO public.shipments (key, carrier, weight_kg) VALUES ($1, 'acme post', 1.25)`, scoped)
	exec(t, db, schema, `INSERT INTO idem_dead_letters (consumer, key, subject, payload, reason, deliveries)
		VALUES ($3, $1, $2, '{}', 'fingerprint mismatch: test', 1)`, scoped, subjectOrder, consumerShip)
	return scoped
}

func TestInspectReadsEveryHopOfOneKey(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	ctx := context.Background()
	scoped := seedLife(t, db, "", "tenant-a", "k-1")
	// Noise: the same bare key in another scope, and other keys in other consumers.
	seedLife(t, db, "", "tenant-b", "k-1")
	seedLife(t, db, "", "", "k-2")
	exec(t, db, "", `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
		SELECT 'c' || (g % 7), 'noise-' || g, 'test.x', '\x00', 'done', now() + interval '1 day' FROM generate_series(1, 500) g`)

	r, err := newReader(t, db, ops.Config{Effects: shipmentEffects}).Inspect(ctx, "tenant-a", "k-1")
	if err != nil {
		t.Fatal(err)
	}
	if !r.Known || r.ScopedKey != scoped || r.AsOf.IsZero() {
		t.Fatalf("report header = %+v", r)
	}
	if q := r.Request; q == nil || q.Method != "POST" || *q.ResponseCode != 202 || q.Fingerprint != "deadbeefcafef00d0102" || q.ResponseBody.String() != `{"status":"accepted"}` {
		t.Errorf("request = %+v", r.Request)
	}
	if len(r.Outbox) != 2 || r.Outbox[0].PublishedAt == nil || r.Outbox[1].PublishedAt != nil ||
		r.Outbox[1].LastError == nil || *r.Outbox[1].LastError != "nats: timeout" || r.Outbox[0].MsgID != idem.MsgID(subjectOrder, scoped) {
		t.Errorf("outbox = %+v", r.Outbox)
	}
	if len(r.Inbox) != 2 || r.Inbox[0].Consumer != consumerMail || r.Inbox[1].Consumer != consumerShip ||
		r.Inbox[0].Status != "leased" || r.Inbox[0].LeaseAttempts != 2 || *r.Inbox[0].Step != "sent" {
		t.Errorf("inbox = %+v", r.Inbox)
	}
	if len(r.DeadLetters) != 1 || r.DeadLetters[0].Reason != "fingerprint mismatch: test" {
		t.Errorf("dead letters = %+v", r.DeadLetters)
	}
	// The application's rows, through its hook: its own row only, as text, NULL
	// shown as such; one shipment is no cause for attention.
	e := r.Effects
	if len(e.Tables) != 1 || e.Tables[0].Name != "shipments" || strings.Join(e.Tables[0].Columns, ",") != "id,carrier,tracking,weight_kg" ||
		len(e.Tables[0].Rows) != 1 || strings.Join(e.Tables[0].Rows[0][1:], ",") != "acme post,"+ops.Null+",1.25" || len(e.Attention) != 0 {
		t.Errorf("effects = %+v", e)
	}

	// Machine output: a binary result is base64, lists are never null.
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"result":"base64:/wD+"`, `"attention":[]`, `"name":"shipments","columns":["id","carrier","tracking","weight_kg"]`} {
		if !strings.Contains(string(b), want) {
			t.Errorf("JSON lacks %s: %s", want, b)
		}
	}
}

// The application's own warnings reach the report, and its rows alone make a key
// known: idem's records expire, a double effect does not.
func TestInspectEffectsHookAloneKnowsAKey(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	exec(t, db, "", `INSERT INTO public.shipments (key, carrier, weight_kg) VALUES ('k-old', 'acme post', 1), ('k-old', 'acme post', 1)`)

	r, err := newReader(t, db, ops.Config{Effects: shipmentEffects}).Inspect(context.Background(), "", "k-old")
	if err != nil {
		t.Fatal(err)
	}
	if !r.Known || r.Request != nil || len(r.Outbox) != 0 || len(r.Effects.Tables[0].Rows) != 2 {
		t.Fatalf("report = %+v", r)
	}
	if strings.Join(r.Effects.Attention, ";") != "DOUBLE EFFECT: 2 shipments for one key" {
		t.Errorf("attention = %q", r.Effects.Attention)
	}

	// Without the hook ops sees none of it.
	r, err = newReader(t, db, ops.Config{}).Inspect(context.Background(), "", "k-old")
	if err != nil {
		t.Fatal(err)
	}
	if r.Known || r.Effects.Tables == nil || len(r.Effects.Tables) != 0 {
		t.Errorf("no hook: report = %+v", r)
	}
}

func TestInspectHookErrorFailsTheCall(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	boom := errors.New("boom")
	failing := func(context.Context, pgx.Tx, string, idem.Key) (ops.Effects, error) { return ops.Effects{}, boom }
	if _, err := newReader(t, db, ops.Config{Effects: failing}).Inspect(context.Background(), "", "k"); !errors.Is(err, boom) {
		t.Errorf("Inspect err = %v, want the hook's", err)
	}
	failingCounts := func(context.Context, pgx.Tx) ([]ops.Count, error) { return nil, boom }
	if _, err := newReader(t, db, ops.Config{Counts: failingCounts}).Stats(context.Background()); !errors.Is(err, boom) {
		t.Errorf("Stats err = %v, want the hook's", err)
	}
	// The hooks run in ops' read-only snapshot: they cannot write.
	writing := func(ctx context.Context, tx pgx.Tx, _ string, key idem.Key) (ops.Effects, error) {
		_, err := tx.Exec(ctx, `INSERT INTO public.shipments (key, carrier, weight_kg) VALUES ($1, 'x', 1)`, string(key))
		return ops.Effects{}, err
	}
	if _, err := newReader(t, db, ops.Config{Effects: writing}).Inspect(context.Background(), "", "k"); err == nil ||
		!strings.Contains(err.Error(), "read-only") {
		t.Errorf("a write in the hook: err = %v, want read-only", err)
	}
}

func TestInspectUnknownKeyNamesOtherScopes(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	seedLife(t, db, "", "tenant-a", "k-1")
	seedLife(t, db, "", "", "k-1")

	r, err := newReader(t, db, ops.Config{Effects: shipmentEffects}).Inspect(context.Background(), "tenant-z", "k-1")
	if err != nil {
		t.Fatal(err)
	}
	if r.Known || r.Request != nil || len(r.Outbox)+len(r.Inbox)+len(r.Effects.Tables[0].Rows) != 0 {
		t.Fatalf("tenant-z knows nothing, got %+v", r)
	}
	if strings.Join(r.OtherScopes, ",") != ",tenant-a" {
		t.Errorf("other scopes = %q, want no scope and tenant-a", r.OtherScopes)
	}
	b, _ := json.Marshal(r)
	if !strings.Contains(string(b), `"outbox":[]`) || !strings.Contains(string(b), `"rows":[]`) {
		t.Errorf("empty lists should be [] in JSON: %s", b)
	}
}

func TestInspectRefusesMalformedInput(t *testing.T) {
	t.Parallel()
	r := newReader(t, newDB(t, ""), ops.Config{})
	for _, tc := range []struct {
		scope string
		key   idem.Key
	}{{"", ""}, {"", "bad\tkey"}, {"bad\tscope", "k"}} {
		if _, err := r.Inspect(context.Background(), tc.scope, tc.key); !errors.Is(err, idem.ErrMalformedKey) && !errors.Is(err, idem.ErrMissingKey) {
			t.Errorf("Inspect(%q, %q) err = %v", tc.scope, tc.key, err)
		}
	}
}

// New checks its configuration without a database: the pool leads nowhere.
func TestNewRefusesABadSchema(t *testing.T) {
	t.Parallel()
	pool := pgtest.Unreachable(t)
	if _, err := ops.New(pool, ops.Config{Schema: `Bad"Schema`}); err == nil {
		t.Error("New accepted a bad schema name")
	}
	if _, err := ops.New(pool, ops.Config{Schema: "idem_app"}); err != nil {
		t.Errorf("New refused a good schema name: %v", err)
	}
	if _, err := ops.New(nil, ops.Config{}); err == nil {
		t.Error("New accepted a nil DB")
	}
}

func TestStatsCountsAndOldestPending(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	seedLife(t, db, "", "", "k-1")
	seedLife(t, db, "", "", "k-2")
	exec(t, db, "", `UPDATE idem_outbox SET created_at = now() - interval '90 seconds' WHERE id = (SELECT min(id) FROM idem_outbox WHERE published_at IS NULL)`)
	exec(t, db, "", `UPDATE idem_dead_letters SET replayed_at = now() WHERE id = (SELECT min(id) FROM idem_dead_letters)`)
	exec(t, db, "", `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at) VALUES ($1, 'old', 'test.x', '\x00', 'done', now() - interval '1 second')`, consumerShip)

	s, err := newReader(t, db, ops.Config{Counts: shipmentCounts}).Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.Requests.Total != 2 || s.Requests.Running != 0 || s.AsOf.IsZero() {
		t.Errorf("requests = %+v", s.Requests)
	}
	o := s.Outbox
	if o.Pending != 2 || o.Failing != 2 || o.Published != 2 || o.OldestPendingAt == nil || o.OldestPendingAgeSeconds < 89 {
		t.Errorf("outbox = %+v", o)
	}
	want := []ops.InboxCount{
		{Consumer: consumerMail, Status: "leased", Rows: 2, LeaseExpired: 2},
		{Consumer: consumerShip, Status: "done", Rows: 3, Expired: 1},
	}
	if len(s.Inbox) != len(want) || s.Inbox[0] != want[0] || s.Inbox[1] != want[1] {
		t.Errorf("inbox = %+v, want %+v", s.Inbox, want)
	}
	if s.DeadLetters != (ops.DeadLetterStats{Total: 2, NotReplayed: 1}) {
		t.Errorf("dead letters = %+v", s.DeadLetters)
	}
	if len(s.Counts) != 1 || s.Counts[0] != (ops.Count{Name: "shipments", N: 2}) {
		t.Errorf("counts = %+v", s.Counts)
	}

	// Stats' backlog is ReadBacklog's, the one definition, to the row.
	b, err := ops.ReadBacklog(context.Background(), db.Pool, parts.Of(tables(t, db, "")).Store)
	if err != nil {
		t.Fatal(err)
	}
	if b.Pending != o.Pending || b.OldestCreatedAt == nil || !b.OldestCreatedAt.Equal(*o.OldestPendingAt) {
		t.Errorf("backlog %+v disagrees with stats %+v", b, o)
	}

	// Nothing pending: no oldest row, no age; no hook: no counts (but a list).
	exec(t, db, "", `UPDATE idem_outbox SET published_at = now()`)
	s, err = newReader(t, db, ops.Config{}).Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.Outbox.Pending != 0 || s.Outbox.OldestPendingAt != nil || s.Outbox.OldestPendingAgeSeconds != 0 || s.Counts == nil || len(s.Counts) != 0 {
		t.Errorf("drained: outbox %+v, counts %+v", s.Outbox, s.Counts)
	}
}

// idem's tables in their own schema, and a decoy installation in public with other
// rows for the same key: the Reader of the schema reads the schema's rows only.
func TestInspectAndStatsInASchema(t *testing.T) {
	t.Parallel()
	const schema = "ops_test"
	db := newDB(t, schema)
	ctx := context.Background()
	if _, err := migrations.Apply(ctx, db.Pool, migrations.Config{}); err != nil {
		t.Fatal(err)
	}
	scoped := seedLife(t, db, schema, "tenant-a", "k-1")
	exec(t, db, "", `INSERT INTO idem_requests (scope, key, fingerprint, method, path, response_code, expires_at)
		VALUES ('tenant-a', 'k-1', '\x00', 'PUT', '/decoy', 500, now() + interval '1 day')`)
	exec(t, db, "", `INSERT INTO idem_dead_letters (consumer, key, subject, payload, reason) VALUES ('decoy', $1, 'x.y', '{}', 'decoy'), ('decoy', $1, 'x.y', '{}', 'decoy')`, scoped)

	r := newReader(t, db, ops.Config{Schema: schema, Effects: shipmentEffects, Counts: shipmentCounts})
	rep, err := r.Inspect(ctx, "tenant-a", "k-1")
	if err != nil {
		t.Fatal(err)
	}
	if q := rep.Request; q == nil || q.Path != "/v1/orders" || len(rep.Outbox) != 2 || len(rep.Inbox) != 2 ||
		len(rep.DeadLetters) != 1 || rep.DeadLetters[0].Reason != "fingerprint mismatch: test" || len(rep.Effects.Tables[0].Rows) != 1 {
		t.Errorf("schema %s: report = %+v", schema, rep)
	}
	st, err := r.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Requests.Total != 1 || st.Outbox.Pending != 1 || st.Outbox.Published != 1 || st.DeadLetters.Total != 1 ||
		len(st.Inbox) != 2 || st.Counts[0].N != 1 {
		t.Errorf("schema %s: stats = %+v", schema, st)
	}

	// And the decoy is where it should be: the default schema's Reader sees it.
	rep, err = newReader(t, db, ops.Config{}).Inspect(ctx, "tenant-a", "k-1")
	if err != nil {
		t.Fatal(err)
	}
	if rep.Request == nil || rep.Request.Path != "/decoy" || len(rep.Outbox) != 0 || len(rep.DeadLetters) != 2 {
		t.Errorf("public: report = %+v", rep)
	}
}

func TestReadJetStreamConsumerLag(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := testenv.Ctx(t)
	if _, err := env.JS.CreateOrUpdateConsumer(ctx, testenv.Stream, jetstream.ConsumerConfig{
		Durable: consumerShip, FilterSubject: subjectOrder, AckPolicy: jetstream.AckExplicitPolicy,
	}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		env.Publish(t, subjectOrder, "k", "", fmt.Appendf(nil, `{"qty":%d}`, i+1))
	}
	env.Publish(t, subjectMail, "k", "", []byte(`{}`))

	// Take one and leave it unacknowledged: it is ack-pending, not pending.
	c, err := env.JS.Consumer(ctx, testenv.Stream, consumerShip)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Next(jetstream.FetchMaxWait(5 * time.Second)); err != nil {
		t.Fatal(err)
	}

	js, err := ops.ReadJetStream(ctx, env.JS, testenv.Stream)
	if err != nil {
		t.Fatal(err)
	}
	if js.Stream != testenv.Stream || js.Messages != 4 || js.LastSeq != 4 || len(js.Consumers) != 1 {
		t.Fatalf("stream = %+v", js)
	}
	lag := js.Consumers[0]
	if lag.Name != consumerShip || lag.NumPending != 2 || lag.NumAckPending != 1 || lag.FilterSubjects[0] != subjectOrder {
		t.Errorf("lag = %+v", lag)
	}

	if _, err := ops.ReadJetStream(ctx, env.JS, "NO_SUCH_STREAM"); err == nil || !strings.Contains(err.Error(), "NO_SUCH_STREAM") {
		t.Errorf("unknown stream: err = %v", err)
	}
}

func TestBytesJSONRoundTrip(t *testing.T) {
	t.Parallel()
	for _, in := range []ops.Bytes{nil, {}, ops.Bytes(`{"a":1}`), {0xff, 0x00}, ops.Bytes("base64:not really")} {
		b, err := json.Marshal(in)
		if err != nil {
			t.Fatal(err)
		}
		var out ops.Bytes
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		if (in == nil) != (out == nil) || string(in) != string(out) {
			t.Errorf("%q -> %s -> %q", in, b, out)
		}
	}
}

// A request the ingress is running holds its key's lock and has no record yet:
// inspect shows it in flight, with the duplicate waiting behind it, and stats
// count it running; once it ends, neither does.
func TestInspectShowsARequestInFlight(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	ctx := context.Background()
	st := store.New("")
	lock := int32(store.RequestLock("tenant-a", "k-fly"))
	hold, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Rollback(ctx)
	if _, err := hold.Exec(ctx, st.Requests.Lock, lock, "5000ms"); err != nil {
		t.Fatal(err)
	}
	// A duplicate waiting for it.
	dup, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer dup.Rollback(ctx)
	waited := make(chan error, 1)
	go func() { _, err := dup.Exec(ctx, st.Requests.Lock, lock, "5000ms"); waited <- err }()

	r := newReader(t, db, ops.Config{})
	testenv.Eventually(t, 5*time.Second, "the duplicate waits", func() bool {
		rep, err := r.Inspect(ctx, "tenant-a", "k-fly")
		if err != nil {
			t.Fatal(err)
		}
		return rep.InFlight != nil && rep.InFlight.Waiting == 1
	})
	rep, _ := r.Inspect(ctx, "tenant-a", "k-fly")
	if !rep.Known || rep.Request != nil || rep.InFlight.PID == 0 {
		t.Fatalf("in flight: %+v / %+v", rep, rep.InFlight)
	}
	if other, _ := r.Inspect(ctx, "tenant-b", "k-fly"); other.InFlight != nil {
		t.Errorf("the key in another scope shows in flight: %+v", other.InFlight)
	}
	s, err := r.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s.Requests.Running != 1 {
		t.Errorf("running = %d, want 1", s.Requests.Running)
	}
	hold.Rollback(ctx)
	if err := <-waited; err != nil {
		t.Fatal(err)
	}
	dup.Rollback(ctx)
	if rep, _ := r.Inspect(ctx, "tenant-a", "k-fly"); rep.InFlight != nil || rep.Known {
		t.Errorf("after the request ended: %+v", rep.InFlight)
	}
}
