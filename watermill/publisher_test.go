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
	"github.com/idemkit/idem/internal/pgtest"
	idemwatermill "github.com/idemkit/idem/watermill"
)

// chargeIntent runs one producer transaction: a business row and two outbox
// messages through the Watermill publisher. It returns the open transaction.
func chargeIntent(t *testing.T, db *pgtest.DB, msgs ...*message.Message) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) }) // a no-op once committed
	if _, err := tx.Exec(ctx, `INSERT INTO payments (idempotency_key, account, amount_cents) VALUES ('k', 'acct_1', 1250)`); err != nil {
		t.Fatal(err)
	}
	pub := idemwatermill.NewOutboxPublisher(tx)
	if err := pub.Publish(idem.SubjectCharge, msgs...); err != nil {
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
	db := pgtest.New(t)
	ctx := context.Background()

	first := payment("key-1", "acct_1", 1250)
	first.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	second := payment("key-2", "acct_1", 1250)
	second.Metadata.Set(idem.HeaderScope, "tenant_a")

	tx := chargeIntent(t, db, first, second)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_outbox`); got != 0 {
		t.Errorf("outbox rows after rollback = %d, want 0", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM payments`); got != 0 {
		t.Errorf("payments after rollback = %d, want 0", got)
	}

	tx = chargeIntent(t, db, first, second)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := db.Count(t, `SELECT count(*) FROM payments`); got != 1 {
		t.Errorf("payments after commit = %d, want 1", got)
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
		if r.Key != wantKeys[i] || r.Subject != idem.SubjectCharge || r.MsgID != idem.MsgID(idem.SubjectCharge, wantKeys[i]) {
			t.Errorf("row %d: key %q subject %q msg_id %q; want %q, %q, %q",
				i, r.Key, r.Subject, r.MsgID, wantKeys[i], idem.SubjectCharge, idem.MsgID(idem.SubjectCharge, wantKeys[i]))
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
	}
	if tp := got[0].Headers["traceparent"]; tp != first.Metadata.Get("traceparent") {
		t.Errorf("traceparent header = %q, want the metadata's", tp)
	}
}

// Bad input is refused before any statement runs, so the transaction stays usable.
func TestOutboxPublisherRejectsBadInput(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	pub := idemwatermill.NewOutboxPublisher(tx)

	withMeta := func(k, v string) *message.Message {
		m := payment("key-1", "acct_1", 1)
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
		{"topic outside idem.", "payments.charge", payment("key-1", "acct_1", 1), nil},
		{"topic with empty token", "idem..charge", payment("key-1", "acct_1", 1), nil},
		{"topic ending in a dot", "idem.", payment("key-1", "acct_1", 1), nil},
		{"wildcard topic", "idem.*", payment("key-1", "acct_1", 1), nil},
		{"topic with a space", "idem.pay ments", payment("key-1", "acct_1", 1), nil},
		{"no key: a UUID is not a key", idem.SubjectCharge, uuidOnly, idem.ErrMissingKey},
		{"malformed key", idem.SubjectCharge, payment("bad\x00key", "acct_1", 1), idem.ErrMalformedKey},
		{"header name with a colon", idem.SubjectCharge, withMeta("x:y", "v"), nil},
		{"header value with a line break", idem.SubjectCharge, withMeta("x-note", "a\r\nb"), nil},
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
	}

	if err := pub.Publish(idem.SubjectCharge, payment("key-1", "acct_1", 1)); err != nil {
		t.Fatalf("a valid message after the rejected ones: %v", err)
	}
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(idem.SubjectCharge, payment("key-2", "acct_1", 1)); err == nil {
		t.Error("a closed publisher accepted a message")
	}
	if err := idemwatermill.NewOutboxPublisher(nil).Publish(idem.SubjectCharge, payment("key-3", "acct_1", 1)); err == nil {
		t.Error("a publisher without a transaction accepted a message")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_outbox`); got != 1 {
		t.Errorf("outbox rows = %d, want 1", got)
	}
}

// Inbox and outbox together: a handler charges and emits a receipt through the
// outbox, in the middleware's transaction, and fails the first time after both
// writes. The failed attempt leaves no ledger row and no outbox row; the
// redelivery leaves one of each.
func TestHandlerWritesOutboxInTheInboxTransaction(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ps := newPubSub()
	var calls atomic.Int64
	handler := func(msg *message.Message) error {
		tx, ok := idemwatermill.TxFromContext(msg.Context())
		if !ok {
			return errors.New("no transaction")
		}
		if err := insertLedger(msg.Context(), tx, msg); err != nil {
			return err
		}
		receipt := message.NewMessageWithContext(msg.Context(), watermill.NewUUID(), []byte(`{"to":"a@example.com"}`))
		receipt.Metadata.Set(idem.HeaderKey, msg.Metadata.Get(idem.HeaderKey)) // same intent
		if err := idemwatermill.NewOutboxPublisher(tx).Publish(idem.SubjectEmail, receipt); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return errTransient
		}
		return nil
	}
	startRouter(t, ps, handler, newMiddleware(t, db))

	key := idem.NewKey().String()
	publish(t, ps, payment(key, "acct_1", 1250))
	publish(t, ps, payment(key, "acct_1", 1250)) // and a redelivery, folded

	if got := calls.Load(); got != 2 {
		t.Errorf("handler ran %d times, want 2 (one failure, one success)", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM ledger_entries`); got != 1 {
		t.Errorf("ledger rows = %d, want 1", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = $1 AND subject = $2`, key, idem.SubjectEmail); got != 1 {
		t.Errorf("receipt outbox rows = %d, want 1", got)
	}
}
