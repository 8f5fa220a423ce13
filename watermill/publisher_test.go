package idemwatermill_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/outbox"
	idemwatermill "github.com/idemkit/idem/watermill"
)

// orderIntent runs one producer transaction: a business row and the outbox
// messages through the Watermill publisher. It returns the open transaction.
func orderIntent(t *testing.T, db testDB, msgs ...*message.Message) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) }) // a no-op once committed
	if err := insertEffect(ctx, tx, msgs[0]); err != nil {      // the business row
		t.Fatal(err)
	}
	pub := idemwatermill.NewOutboxPublisher(newOutbox(t, db), tx)
	if err := pub.Publish(topic, msgs...); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	var inTx int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM idem_outbox`).Scan(&inTx); err != nil {
		t.Fatal(err)
	}
	if inTx != len(msgs) {
		t.Fatalf("outbox rows inside the transaction = %d, want %d", inTx, len(msgs))
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_outbox`); got != 0 {
		t.Fatalf("outbox rows visible before commit = %d, want 0", got)
	}
	return tx
}

// The outbox rows share the producer's transaction: a rollback leaves neither the
// business row nor the messages; a commit leaves both.
func TestOutboxPublisherWritesOnlyWhenTheTransactionCommits(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	ctx := context.Background()

	first := order("key-1", "acct_1", 1250)
	first.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	// A Msg-Id in the metadata (copied from a message this service received, say)
	// is not the message's: the row's Msg-Id is derived from its subject and key.
	first.Metadata.Set(idem.HeaderMsgID, idem.MsgID(topic, "some-incoming-key"))
	second := order("key-2", "acct_1", 1250)
	second.Metadata.Set(idem.HeaderScope, "tenant_a")

	tx := orderIntent(t, db, first, second)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_outbox`); got != 0 {
		t.Errorf("outbox rows after rollback = %d, want 0", got)
	}
	if got := effects(t, db); got != 0 {
		t.Errorf("business rows after rollback = %d, want 0", got)
	}

	tx = orderIntent(t, db, first, second)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := effects(t, db); got != 1 {
		t.Errorf("business rows after commit = %d, want 1", got)
	}

	rows, err := db.Pool.Query(ctx, `SELECT key, subject, msg_id, headers, payload FROM idem_outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		Key, Subject, MsgID string
		Headers             map[string]string
		Payload             []byte
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("outbox rows after commit = %d, want 2", len(got))
	}
	wantKeys := []string{"key-1", idem.ScopedKey("tenant_a", "key-2")}
	for i, src := range []*message.Message{first, second} {
		r := got[i]
		if r.Key != wantKeys[i] || r.Subject != topic || r.MsgID != idem.MsgID(topic, wantKeys[i]) {
			t.Errorf("row %d: key %q subject %q msg_id %q; want %q, %q, %q",
				i, r.Key, r.Subject, r.MsgID, wantKeys[i], topic, idem.MsgID(topic, wantKeys[i]))
		}
		if string(r.Payload) != string(src.Payload) {
			t.Errorf("row %d: payload %q, want %q", i, r.Payload, src.Payload)
		}
		if _, ok := r.Headers[idem.HeaderKey]; ok {
			t.Errorf("row %d: the key is duplicated into the headers", i)
		}
		if _, ok := r.Headers[idem.HeaderScope]; ok {
			t.Errorf("row %d: the scope is duplicated into the headers", i)
		}
		if _, ok := r.Headers[idem.HeaderMsgID]; ok {
			t.Errorf("row %d: a metadata %s became a header", i, idem.HeaderMsgID)
		}
	}
	if tp := got[0].Headers["traceparent"]; tp != first.Metadata.Get("traceparent") {
		t.Errorf("traceparent header = %q, want the metadata's", tp)
	}
}

// Bad input is refused before any statement runs, with a permanent error, so the
// transaction stays usable.
func TestOutboxPublisherRejectsBadInput(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	pub := idemwatermill.NewOutboxPublisher(newOutbox(t, db), tx)

	withMeta := func(k, v string) *message.Message {
		m := order("key-1", "acct_1", 1)
		m.Metadata.Set(k, v)
		return m
	}
	uuidOnly := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	cases := []struct {
		name  string
		topic string
		msg   *message.Message
		is    error
	}{
		{"empty topic", "", order("key-1", "acct_1", 1), idem.ErrBadSubject},
		{"topic with empty token", "orders..created", order("key-1", "acct_1", 1), idem.ErrBadSubject},
		{"topic ending in a dot", "orders.", order("key-1", "acct_1", 1), idem.ErrBadSubject},
		{"wildcard topic", "orders.*", order("key-1", "acct_1", 1), idem.ErrBadSubject},
		{"topic with a space", "orders.cre ated", order("key-1", "acct_1", 1), idem.ErrBadSubject},
		{"topic outside the stream's subjects", "billing.charged", order("key-1", "acct_1", 1), idem.ErrBadSubject},
		{"no key: a UUID is not a key", topic, uuidOnly, idem.ErrMissingKey},
		{"malformed key", topic, order("bad\x00key", "acct_1", 1), idem.ErrMalformedKey},
		{"malformed scoped key", topic, order(idem.ScopedKey("tenant_a", ""), "acct_1", 1), idem.ErrMalformedKey},
		{"header name with a colon", topic, withMeta("x:y", "v"), nil},
		{"header value with a line break", topic, withMeta("x-note", "a\r\nb"), nil},
	}
	for _, tc := range cases {
		err := pub.Publish(tc.topic, tc.msg)
		if err == nil {
			t.Errorf("%s: accepted", tc.name)
			continue
		}
		if tc.is != nil && !errors.Is(err, tc.is) {
			t.Errorf("%s: error %v, want it to wrap %v", tc.name, err, tc.is)
		}
		if !idemwatermill.IsPermanent(err) {
			t.Errorf("%s: error %v is not permanent", tc.name, err)
		}
	}

	if err := pub.Publish(topic, order("key-1", "acct_1", 1)); err != nil {
		t.Fatalf("a valid message after the rejected ones: %v", err)
	}
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(topic, order("key-2", "acct_1", 1)); err == nil {
		t.Error("a closed publisher accepted a message")
	}
	if err := idemwatermill.NewOutboxPublisher(newOutbox(t, db), nil).Publish(topic, order("key-3", "acct_1", 1)); err == nil {
		t.Error("a publisher without a transaction accepted a message")
	}
	if err := idemwatermill.NewOutboxPublisher(nil, tx).Publish(topic, order("key-4", "acct_1", 1)); err == nil {
		t.Error("a publisher without an outbox accepted a message")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_outbox`); got != 1 {
		t.Errorf("outbox rows = %d, want 1", got)
	}
}

// The topology is the user's: any literal subject under the stream of the
// outbox's installation is accepted, and the publisher writes into the
// installation's schema.
func TestOutboxPublisherUsesTheOutboxTopologyAndSchema(t *testing.T) {
	t.Parallel()
	const schema = "idem_tables"
	db := newDB(t, schema)
	ctx := context.Background()
	inst, err := install.New(db.Pool, nil, install.Config{Schema: schema, Stream: install.Stream{Name: "BILLING", Subjects: []string{"billing.>"}}})
	if err != nil {
		t.Fatal(err)
	}
	ob := outbox.New(inst)
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		return idemwatermill.NewOutboxPublisher(ob, tx).Publish("billing.invoices.issued", order("key-1", "acct_1", 1))
	})
	if err != nil {
		t.Fatalf("publish on a subject of the user's own choosing: %v", err)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_tables.idem_outbox WHERE subject = 'billing.invoices.issued'`); got != 1 {
		t.Errorf("rows in %s.idem_outbox = %d, want 1", schema, got)
	}
}

// Inbox and outbox together: a handler bills an order and emits a confirmation
// through the outbox, in the middleware's transaction, and fails the first time
// after both writes. The failed attempt leaves no effect row and no outbox row; the
// redelivery leaves one of each.
func TestHandlerWritesOutboxInTheInboxTransaction(t *testing.T) {
	t.Parallel()
	db := newDB(t, "")
	ps := newPubSub()
	ob := newOutbox(t, db)
	var calls atomic.Int64
	handler := func(msg *message.Message) error {
		tx, ok := idemwatermill.TxFromContext(msg.Context())
		if !ok {
			return errors.New("no transaction")
		}
		if err := insertEffect(msg.Context(), tx, msg); err != nil {
			return err
		}
		confirmation := message.NewMessageWithContext(msg.Context(), watermill.NewUUID(), []byte(`{"to":"a@example.com"}`))
		confirmation.Metadata.Set(idem.HeaderKey, msg.Metadata.Get(idem.HeaderKey)) // same intent
		if err := idemwatermill.NewOutboxPublisher(ob, tx).Publish(subjectConfirmed, confirmation); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return errTransient
		}
		return nil
	}
	startRouter(t, ps, handler, newMiddleware(t, db))

	key := idem.NewKey().String()
	publish(t, ps, order(key, "acct_1", 1250))
	publish(t, ps, order(key, "acct_1", 1250)) // and a redelivery, folded

	if got := calls.Load(); got != 2 {
		t.Errorf("handler ran %d times, want 2 (one failure, one success)", got)
	}
	if got := effects(t, db); got != 1 {
		t.Errorf("effect rows = %d, want 1", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = $1 AND subject = $2`, key, subjectConfirmed); got != 1 {
		t.Errorf("confirmation outbox rows = %d, want 1", got)
	}
}
