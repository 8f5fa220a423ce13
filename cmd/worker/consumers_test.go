package main

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/registry"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

// `worker consumers rename` moves what a stopped consumer knows to its new name
// and deletes the old name's durable consumer; a consumer seen lately is refused.
func TestConsumersRename(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	srv := natstest.Start(t)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: refapp.StreamName, Subjects: []string{refapp.StreamSubjects}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateConsumer(ctx, refapp.StreamName, jetstream.ConsumerConfig{Durable: "charges", FilterSubject: refapp.SubjectCharge, AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	if _, err := registry.Register(ctx, db.Pool, "", registry.Consumer{Name: "charges", Stream: refapp.StreamName, FilterSubject: refapp.SubjectCharge, KeyLifetime: 72 * time.Hour}, false); err != nil {
		t.Fatal(err)
	}
	db.Count(t, `WITH i AS (INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
		SELECT 'charges', 'k-' || g, 'idem.payments.charge', '\x00', 'done', now() + interval '1 hour' FROM generate_series(1, 3) g RETURNING 1) SELECT count(*) FROM i`)
	flags := []string{"--database-url", db.URL, "--nats-url", srv.URL()}

	_, errs, code := worker(t, append([]string{"consumers", "rename", "charges", "ledger"}, flags...)...)
	if code != exitError {
		t.Fatalf("rename of a consumer seen a moment ago: exit %d (%s), want %d", code, errs, exitError)
	}
	mustContain(t, "refusal", errs, "still running", "stop every worker")

	db.Count(t, `WITH u AS (UPDATE idem_consumers SET last_seen_at = now() - interval '1 hour' RETURNING 1) SELECT count(*) FROM u`)
	out, errs, code := worker(t, append([]string{"consumers", "rename", "charges", "ledger"}, flags...)...)
	if code != exitOK {
		t.Fatalf("rename: exit %d: %s", code, errs)
	}
	mustContain(t, "rename", out, "renamed consumer charges to ledger", "deleted the durable consumer charges")
	if n := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'ledger'`); n != 3 {
		t.Errorf("inbox rows under the new name = %d, want 3", n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_consumers WHERE name = 'ledger'`); n != 1 {
		t.Errorf("registry entries of the new name = %d, want 1", n)
	}
	if _, err := js.Consumer(ctx, refapp.StreamName, "charges"); err == nil {
		t.Error("the old durable consumer is still there")
	}

	if _, _, code := worker(t, append([]string{"consumers", "rename", "ledger"}, flags...)...); code != exitUsage {
		t.Errorf("rename with one name: exit %d, want %d", code, exitUsage)
	}
}

// worker consumers forget removes a retired consumer from the registry, so that
// intents stop waiting for it, and says so when the name is not registered.
func TestConsumersForget(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	if _, err := registry.Register(ctx, db.Pool, "", registry.Consumer{Name: "audit", Stream: refapp.StreamName, FilterSubject: refapp.SubjectCharge, KeyLifetime: 72 * time.Hour}, false); err != nil {
		t.Fatal(err)
	}
	flags := []string{"--database-url", db.URL}
	out, errs, code := worker(t, append([]string{"consumers", "forget", "audit"}, flags...)...)
	if code != exitOK {
		t.Fatalf("forget: exit %d: %s", code, errs)
	}
	mustContain(t, "forget", out, "forgot consumer audit")
	if n := db.Count(t, `SELECT count(*) FROM idem_consumers WHERE name = 'audit'`); n != 0 {
		t.Errorf("audit still registered (%d rows)", n)
	}
	_, errs, code = worker(t, append([]string{"consumers", "forget", "audit"}, flags...)...)
	if code != exitError {
		t.Fatalf("forget of a name not registered: exit %d (%s), want %d", code, errs, exitError)
	}
	mustContain(t, "forget again", errs, "no consumer audit is registered")
	if _, errs, code = worker(t, append([]string{"consumers", "forget", "audit", "--nats-url", "nats://x"}, flags...)...); code != exitUsage {
		t.Errorf("forget with a NATS flag it does not take: exit %d (%s), want %d", code, errs, exitUsage)
	}
}
