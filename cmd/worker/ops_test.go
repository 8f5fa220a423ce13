package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/outbox"
)

// seedKey writes one key's whole life by hand: request, outbox, inbox, ledger, and a
// dead letter for a mismatched copy.
func seedKey(t *testing.T, db *pgtest.DB, scope, key string) {
	t.Helper()
	ctx := context.Background()
	scoped := idem.ScopedKey(scope, idem.Key(key))
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO idem_requests (scope, key, fingerprint, method, path, response_code, expires_at)
			VALUES ($1, $2, '\x0102', 'POST', '/v1/payments', 202, now() + interval '1 day')`, scope, key); err != nil {
			return err
		}
		if err := outbox.Enqueue(ctx, tx, idem.Message{Key: scoped, Subject: idem.SubjectCharge, Payload: []byte(`{}`)}); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO idem_inbox (consumer, key, fingerprint, status, completed_at, expires_at)
			VALUES ('charges', $1, '\x00', 'done', now(), now() + interval '1 day')`, scoped); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ($1, 'acct_ops', 1250)`, scoped); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO idem_dead_letters (consumer, key, subject, payload, reason, deliveries)
			VALUES ('charges', $1, $2, '{}', 'fingerprint mismatch: test', 1)`, scoped, idem.SubjectCharge)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestInspectShowsAKeysWholeLife(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	seedKey(t, db, "tenant-a", "k-ops")

	var out, errb bytes.Buffer
	if code := run([]string{"inspect", "k-ops", "--scope", "tenant-a", "--database-url", db.URL}, &out, &errb); code != 0 {
		t.Fatalf("inspect exit %d: %s", code, errb.String())
	}
	text := out.String()
	for _, want := range []string{`key "k-ops" in scope "tenant-a"`, "POST /v1/payments", "answered 202",
		"idem.payments.charge", "NOT PUBLISHED yet", "charges", "done", "fingerprint mismatch: test", "acct_ops", "1250 cents"} {
		if !strings.Contains(text, want) {
			t.Errorf("inspect output lacks %q:\n%s", want, text)
		}
	}

	// The same key in another scope is another intent: nothing known.
	out.Reset()
	run([]string{"inspect", "--database-url", db.URL, "k-ops"}, &out, &errb)
	if !strings.Contains(out.String(), "nothing is known") {
		t.Errorf("unscoped inspect: %s", out.String())
	}

	out.Reset()
	if code := run([]string{"inspect", "k-ops", "--scope", "tenant-a", "--json", "--database-url", db.URL}, &out, &errb); code != 0 {
		t.Fatal(errb.String())
	}
	var life keyLife
	if err := json.Unmarshal(out.Bytes(), &life); err != nil {
		t.Fatal(err)
	}
	if life.Request == nil || len(life.Outbox) != 1 || len(life.Inbox) != 1 || len(life.Ledger) != 1 || len(life.DeadLetters) != 1 {
		t.Errorf("json life = %+v", life)
	}
}

func TestStatsCounts(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	seedKey(t, db, "", "k-1")
	seedKey(t, db, "", "k-2")
	var out, errb bytes.Buffer
	if code := run([]string{"stats", "--json", "--database-url", db.URL, "--data-dir", t.TempDir()}, &out, &errb); code != 0 {
		t.Fatalf("stats exit %d: %s", code, errb.String())
	}
	var st stats
	if err := json.Unmarshal(out.Bytes(), &st); err != nil {
		t.Fatal(err)
	}
	if st.Requests != 2 || st.OutboxPending != 2 || st.Inbox["charges"]["done"] != 2 || st.DeadLetters != 2 || st.DeadLettersPending != 2 || st.LedgerEntries != 2 {
		t.Errorf("stats = %+v", st)
	}
	if !strings.Contains(errb.String(), "JetStream lag not shown") {
		t.Errorf("stats should say why lag is missing: %q", errb.String())
	}
	out.Reset()
	if code := run([]string{"stats", "--database-url", db.URL, "--data-dir", t.TempDir()}, &out, &errb); code != 0 || !strings.Contains(out.String(), "outbox pending") {
		t.Errorf("text stats: %d %s", code, out.String())
	}
}
