package opsquery_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/opsquery"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
)

func exec(t *testing.T, db *pgtest.DB, sql string, args ...any) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// seedLife writes one intent's rows the way the ingress, relay and consumers do:
// scope and bare key in idem_requests, payments and emails; the scoped key
// everywhere past the ingress.
func seedLife(t *testing.T, db *pgtest.DB, scope, key string) string {
	t.Helper()
	ctx := context.Background()
	scoped := idem.ScopedKey(scope, idem.Key(key))
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO idem_requests (scope, key, fingerprint, method, path, response_code, response_body, expires_at)
			VALUES ($1, $2, '\xdeadbeefcafef00d0102', 'POST', '/v1/payments', 202, '{"status":"accepted"}', now() + interval '1 day')`, scope, key); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO payments (scope, idempotency_key, account, amount_cents) VALUES ($1, $2, 'acct_ops', 1250)`, scope, key); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO emails (scope, idempotency_key, recipient, subject) VALUES ($1, $2, 'a@example.com', 'receipt')`, scope, key); err != nil {
			return err
		}
		return outbox.EnqueueBatch(ctx, tx, []idem.Message{
			{Key: scoped, Subject: idem.SubjectCharge, Payload: []byte(`{"account":"acct_ops","amount_cents":1250}`)},
			{Key: scoped, Subject: idem.SubjectEmail, Payload: []byte(`{"to":"a@example.com"}`)},
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	exec(t, db, `UPDATE idem_outbox SET published_at = now(), attempts = 1 WHERE key = $1 AND subject = $2`, scoped, idem.SubjectCharge)
	exec(t, db, `UPDATE idem_outbox SET attempts = 3, last_error = 'nats: timeout' WHERE key = $1 AND subject = $2`, scoped, idem.SubjectEmail)
	// A binary result (not UTF-8), and an external effect whose worker died mid-way.
	exec(t, db, `INSERT INTO idem_inbox (consumer, key, fingerprint, status, result, completed_at, expires_at)
		VALUES ('charges', $1, '\x00', 'done', '\xff00fe', now(), now() + interval '1 day')`, scoped)
	exec(t, db, `INSERT INTO idem_inbox (consumer, key, fingerprint, status, lease_until, lease_attempts, step, expires_at)
		VALUES ('emails', $1, '\x00', 'leased', now() - interval '1 minute', 2, 'sent', now() + interval '1 day')`, scoped)
	exec(t, db, `INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ($1, 'acct_ops', 1250)`, scoped)
	exec(t, db, `INSERT INTO idem_dead_letters (consumer, key, subject, payload, reason, deliveries)
		VALUES ('charges', $1, $2, '{}', 'fingerprint mismatch: test', 1)`, scoped, idem.SubjectCharge)
	return scoped
}

func TestInspectReadsEveryHopOfOneKey(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	scoped := seedLife(t, db, "tenant-a", "k-1")
	// Noise: the same bare key in another scope, and other keys in other consumers.
	seedLife(t, db, "tenant-b", "k-1")
	seedLife(t, db, "", "k-2")
	exec(t, db, `INSERT INTO idem_inbox (consumer, key, fingerprint, status, expires_at)
		SELECT 'c' || (g % 7), 'noise-' || g, '\x00', 'done', now() + interval '1 day' FROM generate_series(1, 500) g`)

	r, err := opsquery.Inspect(ctx, db.Pool, "tenant-a", "k-1")
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
		r.Outbox[1].LastError == nil || *r.Outbox[1].LastError != "nats: timeout" || r.Outbox[0].MsgID != idem.MsgID(idem.SubjectCharge, scoped) {
		t.Errorf("outbox = %+v", r.Outbox)
	}
	if len(r.Inbox) != 2 || r.Inbox[0].Consumer != "charges" || r.Inbox[1].Consumer != "emails" ||
		r.Inbox[1].Status != "leased" || r.Inbox[1].LeaseAttempts != 2 || *r.Inbox[1].Step != "sent" {
		t.Errorf("inbox = %+v", r.Inbox)
	}
	if len(r.DeadLetters) != 1 || r.DeadLetters[0].Reason != "fingerprint mismatch: test" {
		t.Errorf("dead letters = %+v", r.DeadLetters)
	}
	if len(r.Payments) != 1 || len(r.Emails) != 1 || len(r.Ledger) != 1 || r.Ledger[0].AmountCents != 1250 {
		t.Errorf("business rows: payments %+v emails %+v ledger %+v", r.Payments, r.Emails, r.Ledger)
	}

	// Machine output: a binary result is base64, lists are never null.
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"result":"base64:/wD+"`) {
		t.Errorf("binary result in JSON: %s", b)
	}
}

func TestInspectUnknownKeyNamesOtherScopes(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	seedLife(t, db, "tenant-a", "k-1")
	seedLife(t, db, "", "k-1")

	r, err := opsquery.Inspect(context.Background(), db.Pool, "tenant-z", "k-1")
	if err != nil {
		t.Fatal(err)
	}
	if r.Known || r.Request != nil || len(r.Outbox)+len(r.Inbox)+len(r.Ledger) != 0 {
		t.Fatalf("tenant-z knows nothing, got %+v", r)
	}
	if strings.Join(r.OtherScopes, ",") != ",tenant-a" {
		t.Errorf("other scopes = %q, want no scope and tenant-a", r.OtherScopes)
	}
	b, _ := json.Marshal(r)
	if !strings.Contains(string(b), `"outbox":[]`) {
		t.Errorf("empty lists should be [] in JSON: %s", b)
	}
}

func TestReadStatsCountsAndOldestPending(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	seedLife(t, db, "", "k-1")
	seedLife(t, db, "", "k-2")
	exec(t, db, `UPDATE idem_outbox SET created_at = now() - interval '90 seconds' WHERE id = (SELECT min(id) FROM idem_outbox WHERE published_at IS NULL)`)
	exec(t, db, `UPDATE idem_dead_letters SET replayed_at = now() WHERE id = (SELECT min(id) FROM idem_dead_letters)`)
	exec(t, db, `INSERT INTO idem_inbox (consumer, key, fingerprint, status, expires_at) VALUES ('charges', 'old', '\x00', 'done', now() - interval '1 second')`)

	s, err := opsquery.ReadStats(context.Background(), db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if s.Requests.Total != 2 || s.Requests.Running != 0 {
		t.Errorf("requests = %+v", s.Requests)
	}
	o := s.Outbox
	if o.Pending != 2 || o.Failing != 2 || o.Published != 2 || o.OldestPendingAt == nil || o.OldestPendingAgeSeconds < 89 {
		t.Errorf("outbox = %+v", o)
	}
	want := []opsquery.InboxCount{
		{Consumer: "charges", Status: "done", Rows: 3, Expired: 1},
		{Consumer: "emails", Status: "leased", Rows: 2, LeaseExpired: 2},
	}
	if len(s.Inbox) != len(want) || s.Inbox[0] != want[0] || s.Inbox[1] != want[1] {
		t.Errorf("inbox = %+v, want %+v", s.Inbox, want)
	}
	if s.DeadLetters != (opsquery.DeadLetterStats{Total: 2, NotReplayed: 1}) {
		t.Errorf("dead letters = %+v", s.DeadLetters)
	}
	if s.Business != (opsquery.BusinessStats{Payments: 2, Emails: 2, LedgerEntries: 2}) {
		t.Errorf("business = %+v", s.Business)
	}
}

func TestReadJetStreamConsumerLag(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := testenv.Ctx(t)
	if _, err := env.JS.CreateOrUpdateConsumer(ctx, idem.StreamName, jetstream.ConsumerConfig{
		Durable: "charges", FilterSubject: idem.SubjectCharge, AckPolicy: jetstream.AckExplicitPolicy,
	}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		env.Publish(t, idem.SubjectCharge, "k", "", testenv.ChargePayload("a", i+1))
	}
	env.Publish(t, idem.SubjectEmail, "k", "", []byte(`{}`))

	// Take one and leave it unacknowledged: it is ack-pending, not pending.
	c, err := env.JS.Consumer(ctx, idem.StreamName, "charges")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Next(jetstream.FetchMaxWait(5 * time.Second)); err != nil {
		t.Fatal(err)
	}

	js, err := opsquery.ReadJetStream(ctx, env.JS, idem.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	if js.Messages != 4 || js.LastSeq != 4 || len(js.Consumers) != 1 {
		t.Fatalf("stream = %+v", js)
	}
	lag := js.Consumers[0]
	if lag.Name != "charges" || lag.NumPending != 2 || lag.NumAckPending != 1 || lag.FilterSubjects[0] != idem.SubjectCharge {
		t.Errorf("lag = %+v", lag)
	}
}

func TestBytesJSONRoundTrip(t *testing.T) {
	for _, in := range []opsquery.Bytes{nil, {}, opsquery.Bytes(`{"a":1}`), {0xff, 0x00}, opsquery.Bytes("base64:not really")} {
		b, err := json.Marshal(in)
		if err != nil {
			t.Fatal(err)
		}
		var out opsquery.Bytes
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		if (in == nil) != (out == nil) || string(in) != string(out) {
			t.Errorf("%q -> %s -> %q", in, b, out)
		}
	}
}
