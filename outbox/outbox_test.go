package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/ops"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// installOf is the installation of db's public schema on a stream of subjects,
// without a NATS connection: the outbox needs only the tables.
func installOf(t *testing.T, db *pgtest.DB, subjects ...string) *install.Installation {
	t.Helper()
	inst, err := install.New(db.Pool, nil, install.Config{Stream: install.Stream{Name: testenv.Stream, Subjects: subjects}})
	if err != nil {
		t.Fatal(err)
	}
	return inst
}

// newOutbox is the outbox of db, which accepts the test stream's subjects only.
func newOutbox(t *testing.T, db *pgtest.DB) *outbox.Outbox {
	t.Helper()
	return outbox.New(installOf(t, db, testenv.Subjects))
}

// enqueue writes msgs in one committed transaction.
func enqueue(t *testing.T, db *pgtest.DB, ob *outbox.Outbox, msgs ...idem.Message) {
	t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, msgs...) }); err != nil {
		t.Fatal(err)
	}
}

// commitBatched writes msgs the way the producer middleware does: AddToBatch,
// sent with the transaction's other statements, no NOTIFY.
func commitBatched(t *testing.T, db *pgtest.DB, ob *outbox.Outbox, msgs ...idem.Message) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		if err := ob.AddToBatch(ctx, b, msgs...); err != nil {
			return err
		}
		return tx.SendBatch(ctx, b).Close()
	})
	if err != nil {
		t.Fatal(err)
	}
}

func msg(key string) idem.Message {
	return idem.Message{Key: key, Subject: testenv.Subject, Payload: []byte(`{"n":1}`)}
}

// Enqueue refuses, before writing anything, a message the broker could never take
// or that would lose its identity on the way: a missing or malformed (scoped) key,
// a subject that is not literal or lies outside the stream's subjects, a nil payload, a
// header the relay owns or that NATS cannot carry. The refusal leaves the caller's
// transaction usable, and a batch with one bad message writes none of them.
func TestEnqueueRefusesBadMessages(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ob := newOutbox(t, db)
	ok := msg("k-ok")
	with := func(mut func(*idem.Message)) idem.Message {
		m := msg("k")
		mut(&m)
		return m
	}
	cases := []struct {
		name string
		m    idem.Message
		is   error // the sentinel, when there is one
		want string
	}{
		{"no key", with(func(m *idem.Message) { m.Key = "" }), idem.ErrMissingKey, ""},
		{"key too long", with(func(m *idem.Message) { m.Key = strings.Repeat("k", idem.MaxKeyLen+1) }), idem.ErrMalformedKey, ""},
		{"control byte in key", with(func(m *idem.Message) { m.Key = "k\x01" }), idem.ErrMalformedKey, ""},
		{"empty scope before the separator", with(func(m *idem.Message) { m.Key = "\x1fk" }), idem.ErrMalformedKey, ""},
		{"empty key after the scope", with(func(m *idem.Message) { m.Key = "tenant\x1f" }), idem.ErrMalformedKey, ""},
		{"malformed scope", with(func(m *idem.Message) { m.Key = idem.ScopedKey(strings.Repeat("s", idem.MaxKeyLen+1), "k") }), idem.ErrMalformedKey, ""},
		{"subject outside the stream", with(func(m *idem.Message) { m.Subject = "orders.created" }), idem.ErrBadSubject, "outside the stream's subjects"},
		{"wildcard subject", with(func(m *idem.Message) { m.Subject = "test.>" }), idem.ErrBadSubject, ""},
		{"empty subject", with(func(m *idem.Message) { m.Subject = "" }), idem.ErrBadSubject, ""},
		{"nil payload", with(func(m *idem.Message) { m.Payload = nil }), nil, "nil payload"},
		{"caller-set Nats-Msg-Id", with(func(m *idem.Message) { m.Headers = map[string]string{idem.HeaderMsgID: "mine"} }), nil, "set by the relay"},
		{"caller-set Idem-Enqueued-At", with(func(m *idem.Message) { m.Headers = map[string]string{idem.HeaderEnqueuedAt: "2020-01-01T00:00:00Z"} }), nil, "set by the relay"},
		{"caller-set Idempotency-Key", with(func(m *idem.Message) { m.Headers = map[string]string{idem.HeaderKey: "other"} }), nil, "set by the relay"},
		// Consumers skip a copy that is not for them: a producer naming consumers
		// would make the others drop its message.
		{"caller-set Idem-Replay-For", with(func(m *idem.Message) { m.Headers = map[string]string{idem.HeaderReplayFor: "charges"} }), nil, "set by the relay"},
		{"caller-set Idem-Message", with(func(m *idem.Message) { m.Headers = map[string]string{idem.HeaderMessage: "line-1"} }), nil, "set by the relay"},
		{"caller-set Nats-Rollup", with(func(m *idem.Message) { m.Headers = map[string]string{"Nats-Rollup": "sub"} }), nil, "reserved Nats- namespace"},
		{"caller-set nats-ttl", with(func(m *idem.Message) { m.Headers = map[string]string{"nats-ttl": "1s"} }), nil, "reserved Nats- namespace"},
		{"message name with a space", with(func(m *idem.Message) { m.Name = "line 1" }), nil, "message name"},
		{"header name with a space", with(func(m *idem.Message) { m.Headers = map[string]string{"X Trace": "1"} }), nil, "header name"},
		{"header value with a line break", with(func(m *idem.Message) { m.Headers = map[string]string{"X-Trace": "1\r\nNats-Msg-Id: forged"} }), nil, "line break"},
	}
	ctx := context.Background()
	for _, tc := range cases {
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			err := ob.Enqueue(ctx, tx, tc.m)
			if err == nil {
				return errors.New("accepted")
			}
			// Refused before any statement ran: the transaction still works.
			if err := ob.Enqueue(ctx, tx, ok); err != nil {
				t.Errorf("%s: the transaction is unusable after the refusal: %v", tc.name, err)
			}
			return err
		})
		switch {
		case err == nil || err.Error() == "accepted":
			t.Errorf("%s: Enqueue accepted %+v", tc.name, tc.m)
		case tc.is != nil && !errors.Is(err, tc.is):
			t.Errorf("%s: err = %v, want %v", tc.name, err, tc.is)
		case tc.want != "" && !strings.Contains(err.Error(), tc.want):
			t.Errorf("%s: err = %v, want it to mention %q", tc.name, err, tc.want)
		}
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 0 {
		t.Fatalf("outbox rows after refusals = %d, want 0", n)
	}

	// One bad message refuses the whole batch.
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		return ob.Enqueue(ctx, tx, msg("k-1"), with(func(m *idem.Message) { m.Subject = "orders.created" }))
	})
	if !errors.Is(err, idem.ErrBadSubject) {
		t.Fatalf("batch with a bad message: err = %v, want ErrBadSubject", err)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 0 {
		t.Fatalf("outbox rows after a refused batch = %d, want 0", n)
	}

	// What is accepted: scoped keys, extra headers, an empty (non-nil) payload,
	// and no call at all.
	enqueue(t, db, ob,
		idem.Message{Key: idem.ScopedKey("tenant-a", "k1"), Subject: testenv.Subject, Payload: []byte{}, Headers: map[string]string{"X-Trace": "t1"}},
		msg("k1"))
	enqueue(t, db, ob)
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 2 {
		t.Fatalf("outbox rows = %d, want 2", n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = $1 AND msg_id = $2 AND headers->>'X-Trace' = 't1'`,
		idem.ScopedKey("tenant-a", "k1"), idem.MsgID(testenv.Subject, idem.ScopedKey("tenant-a", "k1"))); n != 1 {
		t.Errorf("the scoped message was not stored with its Msg-Id and headers")
	}
}

// The installation's stream's subjects bound the outbox: a subject under them is
// accepted, any other is refused while the caller can still tell its client; a
// stream of every subject (">") takes any literal subject.
func TestOutboxSubjectsRefuseOutOfStreamSubject(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	ob := outbox.New(installOf(t, db, "test.payments.*", "test.emails.>"))
	for subject, accepted := range map[string]bool{
		"test.payments.charge":   true,
		"test.emails.send.now":   true,
		"test.payments.charge.x": false, // "*" is one token
		"test.emails":            false, // ">" needs at least one more
		"orders.created":         false,
	} {
		m := idem.Message{Key: "k-" + subject, Subject: subject, Payload: []byte("{}")}
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, m) })
		switch {
		case accepted && err != nil:
			t.Errorf("%s: refused: %v", subject, err)
		case !accepted && !errors.Is(err, idem.ErrBadSubject):
			t.Errorf("%s: err = %v, want ErrBadSubject", subject, err)
		}
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 2 {
		t.Errorf("outbox rows = %d, want the 2 accepted", n)
	}
	anySubject := outbox.New(installOf(t, db, ">"))
	enqueue(t, db, anySubject, idem.Message{Key: "k-any", Subject: "orders.created", Payload: []byte("{}")})

	// An outbox is only made of an installation, which refuses what no outbox
	// could use.
	for name, cfg := range map[string]install.Config{
		"bad filter":  {Stream: install.Stream{Name: testenv.Stream, Subjects: []string{"test..x"}}},
		"> not last":  {Stream: install.Stream{Name: testenv.Stream, Subjects: []string{"test.>.x"}}},
		"bad schema":  {Schema: "Not-A-Schema", Stream: install.Stream{Name: testenv.Stream, Subjects: []string{testenv.Subjects}}},
		"no subjects": {Stream: install.Stream{Name: testenv.Stream}},
	} {
		if _, err := install.New(db.Pool, nil, cfg); err == nil {
			t.Errorf("%s: install.New accepted %+v", name, cfg)
		}
	}
}

// A rolled-back producer transaction leaves no message: the outbox row lives and
// dies with the business rows.
func TestEnqueueRollsBackWithTheTransaction(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ob := newOutbox(t, db)
	ctx := context.Background()
	boom := errors.New("business failure")
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if err := ob.Enqueue(ctx, tx, msg("k-rollback")); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatal(err)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 0 {
		t.Fatalf("outbox rows after rollback = %d, want 0", n)
	}
}

// The caller's trace context travels in the message headers, so the consumer's
// span continues the producer's trace; a traceparent the caller set is kept.
func TestEnqueueCarriesTraceContext(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ob := newOutbox(t, db)
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ctx, span := tp.Tracer("test").Start(context.Background(), "produce")
	defer span.End()
	own := msg("k-own")
	own.Headers = map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, msg("k-traced"), own) }); err != nil {
		t.Fatal(err)
	}
	headers := func(key string) map[string]string {
		var raw []byte
		if err := db.Pool.QueryRow(context.Background(), `SELECT headers FROM idem_outbox WHERE key = $1`, key).Scan(&raw); err != nil {
			t.Fatal(err)
		}
		h := map[string]string{}
		if err := json.Unmarshal(raw, &h); err != nil {
			t.Fatal(err)
		}
		return h
	}
	if tpHeader := headers("k-traced")["traceparent"]; !strings.Contains(tpHeader, span.SpanContext().TraceID().String()) {
		t.Errorf("traceparent = %q, want the caller's trace %s", tpHeader, span.SpanContext().TraceID())
	}
	if got := headers("k-own")["traceparent"]; got != own.Headers["traceparent"] {
		t.Errorf("caller's own traceparent replaced: %q", got)
	}
	if own.Headers["tracestate"] != "" || len(own.Headers) != 1 {
		t.Errorf("Enqueue modified the caller's header map: %v", own.Headers)
	}
}

// The backlog (ops.ReadBacklog) is the relay's queue: pending rows and the age of
// the oldest.
func TestBacklog(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ob := outbox.New(env.Inst)
	ctx := context.Background()
	b, err := ops.ReadBacklog(ctx, env.DB.Pool, parts.Of(env.Inst).Store)
	if err != nil || b.Pending != 0 || b.OldestCreatedAt != nil || b.OldestAge != 0 {
		t.Fatalf("empty outbox: Backlog = %+v, %v", b, err)
	}
	enqueue(t, env.DB, ob, msg("k-1"), msg("k-2"))
	if _, err := env.DB.Pool.Exec(ctx, `UPDATE idem_outbox SET created_at = now() - interval '1 hour' WHERE key = 'k-1'`); err != nil {
		t.Fatal(err)
	}
	b, err = ops.ReadBacklog(ctx, env.DB.Pool, parts.Of(env.Inst).Store)
	if err != nil || b.Pending != 2 || b.OldestCreatedAt == nil || b.OldestAge < 59*60e9 {
		t.Fatalf("Backlog = %+v, %v; want 2 pending, the oldest about an hour old", b, err)
	}
	r, err := relay.New(parts.Of(env.Inst), relay.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := r.Drain(ctx); err != nil || n != 2 {
		t.Fatalf("Drain = %d, %v; want 2", n, err)
	}
	if b, err = ops.ReadBacklog(ctx, env.DB.Pool, parts.Of(env.Inst).Store); err != nil || b.Pending != 0 || b.OldestCreatedAt != nil {
		t.Fatalf("after the drain: Backlog = %+v, %v; want nothing pending", b, err)
	}
}

// One message goes in a VALUES row of its own, more in one unnest over their
// columns (sqlEnqueueOne and sqlEnqueue). Either statement, through Enqueue or
// AddToBatch, must store a message alike: the same key, subject, Msg-Id, headers
// and payload, byte for byte.
func TestEnqueueOneAndManyStoreAlike(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ob := newOutbox(t, db)
	ctx := context.Background()
	m := func(key string) idem.Message {
		return idem.Message{Key: idem.ScopedKey("tenant", idem.Key(key)), Subject: testenv.Subject,
			Payload: []byte{0, 1, 0xff, '"'}, Headers: map[string]string{"X-Trace": "t \"1\""}}
	}
	enqueue(t, db, ob, m("one"))
	enqueue(t, db, ob, m("many-1"), m("many-2"))
	commitBatched(t, db, ob, m("batch-one"))
	commitBatched(t, db, ob, m("batch-many-1"), m("batch-many-2"))

	rows, err := db.Pool.Query(ctx, `SELECT key, subject, msg_id, headers->>'X-Trace', payload FROM idem_outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	type stored struct {
		key, subject, msgID, trace string
		payload                    []byte
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (s stored, err error) {
		return s, r.Scan(&s.key, &s.subject, &s.msgID, &s.trace, &s.payload)
	})
	if err != nil {
		t.Fatal(err)
	}
	keys := []string{"one", "many-1", "many-2", "batch-one", "batch-many-1", "batch-many-2"}
	if len(got) != len(keys) {
		t.Fatalf("stored %d rows, want %d", len(got), len(keys))
	}
	for i, k := range keys {
		want := m(k)
		w := stored{want.Key, want.Subject, idem.MsgID(want.Subject, want.Key), want.Headers["X-Trace"], want.Payload}
		if g := got[i]; g.key != w.key || g.subject != w.subject || g.msgID != w.msgID || g.trace != w.trace || string(g.payload) != string(w.payload) {
			t.Errorf("%s: stored %+v, want %+v", k, g, w)
		}
	}
}
