package idemwatermill_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"maps"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	idemwatermill "github.com/idemkit/idem/watermill"
)

// newMiddleware returns the middleware under test with consumer consumerName.
func newMiddleware(t *testing.T, db testDB) message.HandlerMiddleware {
	t.Helper()
	mw, err := idemwatermill.NewMiddleware(newInst(t, db, ""), idemwatermill.Config{Consumer: consumerName})
	if err != nil {
		t.Fatalf("new middleware: %v", err)
	}
	return mw
}

// noPublish adapts a handler that produces no messages.
func noPublish(h message.NoPublishHandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) }
}

// poisonQueue is the wiring the package documents: permanent errors go to a poison
// queue (here a recorder) and are acked; everything else is returned to the router.
func poisonQueue(t *testing.T, rec *recorder) message.HandlerMiddleware {
	t.Helper()
	pq, err := middleware.PoisonQueueWithFilter(rec, "poison", idemwatermill.IsPermanent)
	if err != nil {
		t.Fatalf("poison queue: %v", err)
	}
	return pq
}

// A true redelivery (same key, same payload) is folded: one effect, the handler
// runs once, every delivery is acked. A redelivery may come with a new Watermill
// UUID (a relay re-publish mints one); the UUID is not the key, so it is folded
// too.
func TestRedeliveryIsFoldedIntoOneEffect(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	ps := newPubSub()
	h := &flaky{next: effectInTx}
	startRouter(t, ps, h.handle, newMiddleware(t, db))

	msg := order(idem.NewKey().String(), "acct_1", 1250)
	publish(t, ps, msg)
	publish(t, ps, msg) // the broker redelivers the same message

	again := order(msg.Metadata.Get(idem.HeaderKey), "acct_1", 1250)
	if again.UUID == msg.UUID {
		t.Fatal("test setup: the re-publish must carry a fresh UUID")
	}
	publish(t, ps, again)

	if got := h.calls.Load(); got != 1 {
		t.Errorf("handler ran %d times, want 1", got)
	}
	if got := effects(t, db); got != 1 {
		t.Errorf("effect rows = %d, want 1", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'billing'`); got != 1 {
		t.Errorf("inbox rows = %d, want 1", got)
	}
}

// The same key with a different payload is a producer bug: it is rejected with a
// permanent error that the poison queue files with its reason; the first order
// stands alone and the second amount is never billed.
func TestSameKeyDifferentPayloadIsRejected(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	ps := newPubSub()
	poisoned := &recorder{}
	h := &flaky{next: effectInTx}
	startRouter(t, ps, h.handle, poisonQueue(t, poisoned), newMiddleware(t, db))

	key := idem.NewKey().String()
	publish(t, ps, order(key, "acct_1", 1250))
	publish(t, ps, order(key, "acct_1", 9999)) // acked only after the poison queue took it

	if got := h.calls.Load(); got != 1 {
		t.Errorf("handler ran %d times, want 1", got)
	}
	if got := effects(t, db); got != 1 {
		t.Errorf("effect rows = %d, want 1", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM public.order_effects WHERE amount_cents = 9999`); got != 0 {
		t.Errorf("the mismatched payload was billed %d times", got)
	}
	msgs := poisoned.messages()
	if len(msgs) != 1 {
		t.Fatalf("poison queue holds %d messages, want 1", len(msgs))
	}
	if reason := msgs[0].Metadata.Get(middleware.ReasonForPoisonedKey); !strings.Contains(reason, idem.ErrFingerprintMismatch.Error()) {
		t.Errorf("poison reason = %q, want it to name the fingerprint mismatch", reason)
	}

	// The error itself, without the router (which names no topic: the message is
	// then named by its Idem-Message alone).
	wrapped := newMiddleware(t, db)(noPublish(effectInTx))
	direct := idem.NewKey().String()
	if _, err := wrapped(order(direct, "acct_1", 1250)); err != nil {
		t.Fatal(err)
	}
	_, err := wrapped(order(direct, "acct_1", 9999))
	if !errors.Is(err, idemwatermill.ErrFingerprintMismatch) || !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("error = %v, want ErrFingerprintMismatch wrapping idem.ErrFingerprintMismatch", err)
	}
	if !idemwatermill.IsPermanent(err) {
		t.Errorf("a fingerprint mismatch must be permanent: %v", err)
	}
}

// A message without Idempotency-Key never reaches the handler and is never hashed
// into a key: it is a permanent error, filed by the poison queue.
func TestMissingKeyGoesToPoisonQueue(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	ps := newPubSub()
	poisoned := &recorder{}
	h := &flaky{next: effectInTx}
	startRouter(t, ps, h.handle, poisonQueue(t, poisoned), newMiddleware(t, db))

	publish(t, ps, order("", "acct_1", 1250))

	if got := h.calls.Load(); got != 0 {
		t.Errorf("handler ran %d times, want 0", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox`); got != 0 {
		t.Errorf("inbox rows = %d, want 0", got)
	}
	msgs := poisoned.messages()
	if len(msgs) != 1 {
		t.Fatalf("poison queue holds %d messages, want 1", len(msgs))
	}
	if reason := msgs[0].Metadata.Get(middleware.ReasonForPoisonedKey); !strings.Contains(reason, idem.ErrMissingKey.Error()) {
		t.Errorf("poison reason = %q, want it to name the missing key", reason)
	}
}

func TestBadKeysArePermanentErrors(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	cases := []struct {
		name     string
		metadata map[string]string
		want     error
	}{
		{"no key", nil, idem.ErrMissingKey},
		{"empty key", map[string]string{idem.HeaderKey: ""}, idem.ErrMissingKey},
		{"control byte", map[string]string{idem.HeaderKey: "pay\x01"}, idem.ErrMalformedKey},
		{"blank", map[string]string{idem.HeaderKey: "   "}, idem.ErrMalformedKey},
		{"too long", map[string]string{idem.HeaderKey: strings.Repeat("k", idem.MaxKeyLen+1)}, idem.ErrMalformedKey},
		{"bad scope", map[string]string{idem.HeaderKey: "k1", idem.HeaderScope: "tenant\n"}, idem.ErrMalformedKey},
		{"scoped twice", map[string]string{idem.HeaderKey: idem.ScopedKey("t1", "k1"), idem.HeaderScope: "t2"}, idem.ErrMalformedKey},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			called := false
			wrapped := newMiddleware(t, db)(func(*message.Message) ([]*message.Message, error) {
				called = true
				return nil, nil
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
			for k, v := range tc.metadata {
				msg.Metadata.Set(k, v)
			}
			_, err := wrapped(msg)
			if !errors.Is(err, tc.want) || !idemwatermill.IsPermanent(err) {
				t.Errorf("error = %v, want a permanent error wrapping %v", err, tc.want)
			}
			if called {
				t.Error("the handler ran")
			}
		})
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox`); got != 0 {
		t.Errorf("inbox rows = %d, want 0", got)
	}
}

// A handler that writes and then fails leaves nothing behind: neither its write
// nor the claim. The next delivery runs again; the one after is a duplicate.
func TestHandlerErrorRollsBackClaimAndWrites(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	mw := newMiddleware(t, db)
	msg := order(idem.NewKey().String(), "acct_1", 1250)

	failing := mw(func(msg *message.Message) ([]*message.Message, error) {
		if err := effectInTx(msg); err != nil {
			return nil, err
		}
		return nil, errTransient // after the write
	})
	_, err := failing(msg)
	if !errors.Is(err, errTransient) {
		t.Fatalf("error = %v, want the handler's own error", err)
	}
	if idemwatermill.IsPermanent(err) {
		t.Errorf("a plain handler error must not be permanent")
	}
	if got := effects(t, db); got != 0 {
		t.Errorf("effect rows after the failure = %d, want 0", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox`); got != 0 {
		t.Errorf("inbox rows after the failure = %d, want 0 (the claim must roll back)", got)
	}

	h := &flaky{next: effectInTx}
	working := mw(noPublish(h.handle))
	for i := range 2 {
		if _, err := working(msg); err != nil {
			t.Fatalf("delivery %d: %v", i+2, err)
		}
	}
	if got := h.calls.Load(); got != 1 {
		t.Errorf("handler ran %d times after the failure, want 1", got)
	}
	if got := effects(t, db); got != 1 {
		t.Errorf("effect rows = %d, want 1", got)
	}

	// A handler may mark its own error permanent; the claim rolls back just the same.
	other := order(idem.NewKey().String(), "acct_2", 1)
	_, err = mw(noPublish(func(*message.Message) error {
		return idemwatermill.Permanent(errors.New("account closed"))
	}))(other)
	if !idemwatermill.IsPermanent(err) {
		t.Errorf("error = %v, want permanent", err)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = $1`, other.Metadata.Get(idem.HeaderKey)); got != 0 {
		t.Errorf("a permanently failed message left its claim behind")
	}
}

// Concurrent deliveries of one message: exactly one effect commits. On a plain
// inbox every delivery finds the message new and runs the handler; the first to
// settle commits, the others' settlements wait for it and fail, and each is claimed
// again and folded. On a partitioned inbox the others wait in their claim on the
// key's lock and are folded without running the handler. Every delivery returns
// without an error.
func TestConcurrentDeliveriesProduceOneEffect(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	const deliveries = 8
	msg := order(idem.NewKey().String(), "acct_1", 1250)
	partitioned := db.Count(t, `SELECT count(*) FROM pg_partitioned_table WHERE partrelid = 'idem_inbox'::regclass`) == 1

	var inHandler atomic.Int64
	h := &flaky{next: func(msg *message.Message) error {
		// Hold every delivery here until all of them are in the handler (or, on a
		// partitioned inbox, the others are blocked on the key's lock), so the
		// test exercises the concurrent path and not a sequential one. (Asked
		// through the pool: inside a transaction pg_stat_activity is a frozen
		// snapshot.)
		inHandler.Add(1)
		stop := time.Now().Add(deadline)
		for inHandler.Load() < deliveries {
			var waiting int
			err := db.Pool.QueryRow(msg.Context(), `SELECT count(*) FROM pg_stat_activity
				WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
			if err != nil {
				return err
			}
			if partitioned && waiting == deliveries-1 {
				break
			}
			if time.Now().After(stop) {
				return errors.New("the other deliveries never reached the handler or the key's lock")
			}
			time.Sleep(5 * time.Millisecond) // poll interval of a condition wait, bounded by stop
		}
		return effectInTx(msg)
	}}
	wrapped := newMiddleware(t, db)(noPublish(h.handle))

	var wg sync.WaitGroup
	errs := make(chan error, deliveries)
	for range deliveries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := wrapped(msg.Copy())
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("delivery: %v", err)
		}
	}
	want := int64(deliveries)
	if partitioned {
		want = 1
	}
	if got := h.calls.Load(); got != want {
		t.Errorf("handler ran %d times, want %d", got, want)
	}
	if got := effects(t, db); got != 1 {
		t.Errorf("effect rows = %d, want 1", got)
	}
}

// The transaction is in the context while the handler runs and gone afterwards,
// so no finished transaction leaks to outer middlewares. Produced messages are
// returned on the first delivery and not on a duplicate.
func TestTransactionContextAndProducedMessages(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	if _, ok := idemwatermill.TxFromContext(context.Background()); ok {
		t.Error("TxFromContext found a transaction in an empty context")
	}

	msg := order(idem.NewKey().String(), "acct_1", 1250)
	receipt := message.NewMessage(watermill.NewUUID(), []byte(`{"receipt":true}`))
	sawTx := false
	wrapped := newMiddleware(t, db)(func(m *message.Message) ([]*message.Message, error) {
		_, sawTx = idemwatermill.TxFromContext(m.Context())
		return []*message.Message{receipt}, nil
	})

	produced, err := wrapped(msg)
	if err != nil {
		t.Fatal(err)
	}
	if !sawTx {
		t.Error("the handler saw no transaction")
	}
	if _, ok := idemwatermill.TxFromContext(msg.Context()); ok {
		t.Error("the transaction is still in the message context after the handler")
	}
	if len(produced) != 1 || produced[0] != receipt {
		t.Errorf("produced = %v, want the handler's receipt", produced)
	}

	produced, err = wrapped(msg)
	if err != nil || len(produced) != 0 {
		t.Errorf("duplicate: produced %d messages, err %v; want none, nil", len(produced), err)
	}
}

// Scope metadata keeps two tenants' equal keys apart; the inbox stores the scoped
// key, as idem's JetStream consumer would.
func TestScopesKeepEqualKeysApart(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	wrapped := newMiddleware(t, db)(noPublish(effectInTx))
	for _, scope := range []string{"tenant_a", "tenant_b", "tenant_a"} {
		msg := order("order-1", "acct_1", 1250)
		msg.Metadata.Set(idem.HeaderScope, scope)
		if _, err := wrapped(msg); err != nil {
			t.Fatalf("scope %s: %v", scope, err)
		}
	}
	if got := effects(t, db); got != 2 {
		t.Errorf("effect rows = %d, want 2 (one per tenant)", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = $1`, idem.ScopedKey("tenant_a", "order-1")); got != 1 {
		t.Errorf("inbox does not hold tenant_a's scoped key")
	}
}

func TestKeyLifetime(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	for consumer, want := range map[string]time.Duration{"default": 0, "short": time.Hour} {
		mw, err := idemwatermill.NewMiddleware(newInst(t, db, ""), idemwatermill.Config{Consumer: consumer, KeyLifetime: want})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := mw(noPublish(effectInTx))(order("k1", "acct_1", 1)); err != nil {
			t.Fatal(err)
		}
		if want == 0 {
			want = 72 * time.Hour // dedupe.DefaultLifetime
		}
		var seconds float64
		if err := db.Pool.QueryRow(context.Background(),
			`SELECT extract(epoch FROM expires_at - created_at)::float8 FROM idem_inbox WHERE consumer = $1`, consumer).Scan(&seconds); err != nil {
			t.Fatal(err)
		}
		got := time.Duration(seconds * float64(time.Second))
		if got < want-time.Minute || got > want+time.Minute {
			t.Errorf("%s: key lifetime = %v, want %v", consumer, got, want)
		}
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	pool := unreachablePool(t) // validation queries nothing
	inst := installOn(t, pool, "")
	cases := []struct {
		name string
		cfg  idemwatermill.Config
		nil  bool
	}{
		{name: "nil installation", cfg: idemwatermill.Config{Consumer: "c"}, nil: true},
		{name: "no consumer", cfg: idemwatermill.Config{}},
		{name: "negative lifetime", cfg: idemwatermill.Config{Consumer: "c", KeyLifetime: -time.Second}},
		{name: "wildcard outbox subject", cfg: idemwatermill.Config{Consumer: "c", OutboxSubject: "orders.>"}},
		{name: "outbox subject with an empty token", cfg: idemwatermill.Config{Consumer: "c", OutboxSubject: "orders..confirmed"}},
		{name: "outbox subject with a space", cfg: idemwatermill.Config{Consumer: "c", OutboxSubject: "orders.con firmed"}},
	}
	for _, tc := range cases {
		in := inst
		if tc.nil {
			in = nil
		}
		if _, err := idemwatermill.NewMiddleware(in, tc.cfg); err == nil {
			t.Errorf("%s: NewMiddleware accepted it", tc.name)
		}
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: Middleware did not panic", tc.name)
				}
			}()
			idemwatermill.Middleware(in, tc.cfg)
		}()
	}
	// The schema is the installation's: a bad one is refused there.
	if _, err := install.New(pool, nil, install.Config{Schema: "Idem-Tables",
		Stream: install.Stream{Name: streamName, Subjects: []string{streamSubjects}}}); err == nil {
		t.Error("install.New accepted a bad schema")
	}

	// The topology is the user's: any literal subject is a valid outbox subject
	// (the installation's outbox refuses, per message, one its stream does not
	// store), and any schema.
	for _, tc := range []struct {
		schema string
		cfg    idemwatermill.Config
	}{
		{"", idemwatermill.Config{Consumer: "c", OutboxSubject: subjectConfirmed}},
		{"", idemwatermill.Config{Consumer: "c", OutboxSubject: "billing.receipts.sent"}},
		{"tenant_tables", idemwatermill.Config{Consumer: "c"}},
	} {
		if _, err := idemwatermill.NewMiddleware(installOn(t, pool, tc.schema), tc.cfg); err != nil {
			t.Errorf("NewMiddleware(%+v) in schema %q refused a valid config: %v", tc.cfg, tc.schema, err)
		}
	}
}

// With OutboxSubject, the messages a handler returns go into idem's outbox inside
// the message's transaction and none is handed to the router: they commit with the
// claim or not at all. A message without a key gets a derived one in the incoming
// scope; one with a key keeps it; a duplicate produces nothing more.
func TestProducedMessagesThroughTheOutbox(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	mw, err := idemwatermill.NewMiddleware(newInst(t, db, ""), idemwatermill.Config{
		Consumer: consumerName, OutboxSubject: subjectConfirmed,
	})
	if err != nil {
		t.Fatal(err)
	}
	failOnce := true
	wrapped := mw(func(m *message.Message) ([]*message.Message, error) {
		if err := effectInTx(m); err != nil {
			return nil, err
		}
		unkeyed := message.NewMessage(watermill.NewUUID(), []byte(`{"receipt":1}`))
		keyed := message.NewMessage(watermill.NewUUID(), []byte(`{"receipt":2}`))
		keyed.Metadata.Set(idem.HeaderKey, "receipt-explicit")
		keyed.Metadata.Set("X-Trace", "t1")
		if failOnce {
			// Produced, then failed: neither the effect row nor the messages may
			// survive the rollback.
			failOnce = false
			return []*message.Message{unkeyed, keyed}, errors.New("transient")
		}
		return []*message.Message{unkeyed, keyed}, nil
	})
	msg := order("order-7", "acct_1", 1250)
	msg.Metadata.Set(idem.HeaderScope, "tenant_a")

	if _, err := wrapped(msg); err == nil {
		t.Fatal("the failing attempt returned no error")
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 0 {
		t.Fatalf("outbox rows after a failed handler = %d, want 0", n)
	}
	for attempt := range 2 { // the retry, then a duplicate
		produced, err := wrapped(msg)
		if err != nil || len(produced) != 0 {
			t.Fatalf("attempt %d: produced %d messages to the router, err %v; want none, nil", attempt, len(produced), err)
		}
	}
	if n := effects(t, db); n != 1 {
		t.Errorf("effect rows = %d, want 1", n)
	}
	derived := idem.ScopedKey("tenant_a", idem.Key(idemwatermill.DerivedKey(consumerName, "order-7", 0)))
	for _, want := range []struct{ key, payload string }{
		{derived, `{"receipt":1}`},
		{"receipt-explicit", `{"receipt":2}`},
	} {
		if n := db.Count(t, `SELECT count(*) FROM idem_outbox WHERE subject = $3 AND key = $1 AND payload = $2::bytea AND msg_id = $4`,
			want.key, want.payload, subjectConfirmed, idem.MsgID(subjectConfirmed, want.key)); n != 1 {
			t.Errorf("outbox rows with key %q and payload %s = %d, want 1", want.key, want.payload, n)
		}
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 2 {
		t.Errorf("outbox rows = %d, want 2 (a duplicate produces nothing)", n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox WHERE headers->>'X-Trace' = 't1'`); n != 1 {
		t.Errorf("the keyed message lost its metadata header")
	}
}

// A produced message that can never be an outbox message is a permanent error,
// and the claim is rolled back with everything else.
func TestProducedMessageThatCannotBeAHeaderIsPermanent(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	mw := idemwatermill.Middleware(newInst(t, db, ""), idemwatermill.Config{Consumer: consumerName, OutboxSubject: subjectConfirmed})
	wrapped := mw(func(m *message.Message) ([]*message.Message, error) {
		out := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		out.Metadata.Set("bad name", "v")
		return []*message.Message{out}, effectInTx(m)
	})
	_, err := wrapped(order("order-8", "acct_1", 1))
	if !idemwatermill.IsPermanent(err) {
		t.Fatalf("err = %v, want a permanent error", err)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_inbox`) + effects(t, db); n != 0 {
		t.Errorf("%d inbox and effect rows survived, want none", n)
	}
}

// The installation's outbox applies its stream subjects: a produced message on a
// subject no stream stores is refused with a permanent error (no retry can store
// it), and the claim is rolled back with everything else.
func TestProducedMessageOutsideTheStreamIsPermanent(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	mw := idemwatermill.Middleware(newInst(t, db, ""), idemwatermill.Config{
		Consumer: consumerName, OutboxSubject: "billing.receipts.sent",
	})
	wrapped := mw(func(m *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte(`{}`))}, effectInTx(m)
	})
	_, err := wrapped(order("order-9", "acct_1", 1))
	if !idemwatermill.IsPermanent(err) || !errors.Is(err, idem.ErrBadSubject) {
		t.Fatalf("err = %v, want a permanent error wrapping idem.ErrBadSubject", err)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_inbox`) + effects(t, db) + db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 0 {
		t.Errorf("%d inbox, effect and outbox rows survived, want none", n)
	}
}

// A handler commonly copies the incoming metadata (trace and correlation ids) onto
// the messages it produces. The incoming Nats-Msg-Id must not come along: the outbox
// refuses a caller-set Msg-Id, and were it published the broker would fold the new
// message into the incoming one inside its duplicate window. It is dropped, and the
// row's Msg-Id is derived from its own subject and key; the rest of the metadata
// survives.
func TestProducedMessagesDropTheIncomingMsgID(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	mw := idemwatermill.Middleware(newInst(t, db, ""), idemwatermill.Config{
		Consumer: consumerName, OutboxSubject: subjectConfirmed,
	})
	wrapped := mw(func(m *message.Message) ([]*message.Message, error) {
		copied := message.NewMessage(watermill.NewUUID(), []byte(`{"confirmed":true}`))
		copied.Metadata = maps.Clone(m.Metadata) // Idempotency-Key, Nats-Msg-Id, traceparent, X-Correlation-Id
		unkeyed := message.NewMessage(watermill.NewUUID(), []byte(`{"confirmed":"again"}`))
		unkeyed.Metadata.Set(idem.HeaderMsgID, m.Metadata.Get(idem.HeaderMsgID))
		return []*message.Message{copied, unkeyed}, effectInTx(m)
	})

	in := order(idem.NewKey().String(), "acct_1", 1250)
	key := in.Metadata.Get(idem.HeaderKey)
	in.Metadata.Set(idem.HeaderMsgID, idem.MsgID(topic, key)) // as idem's relay published it
	in.Metadata.Set("X-Correlation-Id", "corr-1")
	if _, err := wrapped(in); err != nil {
		t.Fatalf("handling a message whose produced messages carry its Msg-Id: %v", err)
	}

	derived := idem.ScopedKey("", idem.Key(idemwatermill.DerivedKey(consumerName, key, 1)))
	for _, want := range []string{key, derived} {
		var msgID string
		var headers map[string]string
		if err := db.Pool.QueryRow(context.Background(),
			`SELECT msg_id, headers FROM idem_outbox WHERE key = $1 AND subject = $2`, want, subjectConfirmed).Scan(&msgID, &headers); err != nil {
			t.Fatalf("outbox row for key %q: %v", want, err)
		}
		if msgID != idem.MsgID(subjectConfirmed, want) {
			t.Errorf("key %q: msg_id = %q, want %q (derived from its own subject and key)", want, msgID, idem.MsgID(subjectConfirmed, want))
		}
		if _, ok := headers[idem.HeaderMsgID]; ok {
			t.Errorf("key %q: the incoming %s was copied into the headers: %v", want, idem.HeaderMsgID, headers)
		}
	}
	var corr string
	if err := db.Pool.QueryRow(context.Background(),
		`SELECT headers->>'X-Correlation-Id' FROM idem_outbox WHERE key = $1`, key).Scan(&corr); err != nil || corr != "corr-1" {
		t.Errorf("copied metadata header X-Correlation-Id = %q (%v), want corr-1", corr, err)
	}
}

// The installation's schema holds the claim and the produced messages; a
// middleware of an installation in the default schema cannot find them.
func TestSchema(t *testing.T) {
	t.Parallel()
	const schema = "idem_tables"
	db := newDB(t, schema)
	mw := idemwatermill.Middleware(newInst(t, db, schema), idemwatermill.Config{
		Consumer: consumerName, OutboxSubject: subjectConfirmed,
	})
	wrapped := mw(func(m *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte(`{}`))}, effectInTx(m)
	})
	msg := order("order-10", "acct_1", 1)
	for range 2 { // the first delivery, then a duplicate
		if _, err := wrapped(msg); err != nil {
			t.Fatal(err)
		}
	}
	if n := effects(t, db); n != 1 {
		t.Errorf("effect rows = %d, want 1", n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_tables.idem_inbox WHERE consumer = $1 AND key = 'order-10'`, consumerName); n != 1 {
		t.Errorf("claims in %s.idem_inbox = %d, want 1", schema, n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_tables.idem_outbox WHERE subject = $1`, subjectConfirmed); n != 1 {
		t.Errorf("rows in %s.idem_outbox = %d, want 1", schema, n)
	}

	public := idemwatermill.Middleware(newInst(t, db, ""), idemwatermill.Config{Consumer: consumerName})
	if _, err := public(noPublish(effectInTx))(order("order-11", "acct_1", 1)); err == nil {
		t.Error("a middleware of the public schema found idem's tables in a database that has them elsewhere")
	}
}

func TestDerivedKey(t *testing.T) {
	t.Parallel()
	if got := idemwatermill.DerivedKey("billing", "k1", 2); got != "billing:k1:2" {
		t.Errorf("DerivedKey = %q", got)
	}
	long := idemwatermill.DerivedKey("billing", strings.Repeat("k", 255), 0)
	if _, err := idem.ParseKey(long); err != nil || len(long) != 64 {
		t.Errorf("DerivedKey of a long key = %q (%v), want 64 hex digits", long, err)
	}
	if long == idemwatermill.DerivedKey("billing", strings.Repeat("k", 255), 1) {
		t.Error("two positions share a derived key")
	}
}

// A copy addressed to other consumers (idem.HeaderReplayFor: a dead-letter replay,
// a re-drive) is acked without calling the handler: this consumer settled the
// message already, and its inbox may have forgotten the key. One addressed to it,
// or to nobody in particular, runs.
func TestCopiesForOtherConsumersAreSkipped(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	wrapped := newMiddleware(t, db)(noPublish(effectInTx))
	for i, to := range []string{"emails", "emails,audit", consumerName, "emails," + consumerName, ""} {
		msg := order(idem.NewKey().String(), "acct_1", 100)
		if to != "" {
			msg.Metadata.Set(idem.HeaderReplayFor, to)
		}
		before := effects(t, db)
		if _, err := wrapped(msg); err != nil {
			t.Fatalf("copy for %q: %v", to, err)
		}
		ran := effects(t, db) > before
		if want := i >= 2; ran != want {
			t.Errorf("copy for %q ran the handler: %v, want %v", to, ran, want)
		}
	}
}

// The middleware logs through its installation's logger: a rejected message is
// logged there, naming the consumer.
func TestLogsThroughTheInstallation(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	var logs strings.Builder
	var mu sync.Mutex
	inst, err := install.New(db.Pool, nil, install.Config{Stream: install.Stream{Name: streamName, Subjects: []string{streamSubjects}},
		Logger: slog.New(slog.NewTextHandler(lockedWriter{&mu, &logs}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	wrapped := idemwatermill.Middleware(inst, idemwatermill.Config{Consumer: consumerName})(noPublish(effectInTx))
	if _, err := wrapped(order("", "acct_1", 1)); err == nil {
		t.Fatal("a message without a key was accepted")
	}
	mu.Lock()
	defer mu.Unlock()
	if got := logs.String(); !strings.Contains(got, "message rejected: no valid idempotency key") || !strings.Contains(got, "consumer="+consumerName) {
		t.Errorf("the installation's logger got %q, want the rejection naming the consumer", got)
	}
}

// lockedWriter serialises writes to w.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
