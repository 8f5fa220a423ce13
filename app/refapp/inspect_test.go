package refapp_test

import (
	"context"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/internal/ops"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

// The application's hooks read its rows by the key each table stores (scope and
// bare key for the ingress's tables, the scoped key for the ledger) and flag repeats.
func TestInspectEffectsAndCounts(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	if err := refapp.Migrate(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	scoped := idem.ScopedKey("tenant-a", "k-1")
	for _, s := range []struct {
		sql  string
		args []any
	}{
		{`INSERT INTO payments (scope, idempotency_key, account, amount_cents) VALUES ('tenant-a', 'k-1', 'acct_a', 1250), ('tenant-a', 'k-1', 'acct_a', 1250)`, nil},
		{`INSERT INTO emails (scope, idempotency_key, recipient, subject) VALUES ('tenant-a', 'k-1', 'a@example.com', 'receipt')`, nil},
		{`INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ($1, 'acct_a', 1250), ($1, 'acct_a', 1250)`, []any{scoped}},
		// Another tenant's intent with the same bare key, and the bare key in the
		// ledger: neither is tenant-a's.
		{`INSERT INTO payments (scope, idempotency_key, account, amount_cents) VALUES ('tenant-b', 'k-1', 'acct_b', 1)`, nil},
		{`INSERT INTO emails (scope, idempotency_key, recipient, subject) VALUES ('tenant-b', 'k-1', 'b@example.com', 'x'), ('tenant-b', 'k-1', 'b@example.com', 'x')`, nil},
		{`INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ('k-1', 'acct_b', 1)`, nil},
	} {
		if _, err := db.Pool.Exec(ctx, s.sql, s.args...); err != nil {
			t.Fatalf("%s: %v", s.sql, err)
		}
	}
	r, err := ops.New(db.Pool, ops.Config{Effects: refapp.InspectEffects, Counts: refapp.Counts})
	if err != nil {
		t.Fatal(err)
	}

	rep, err := r.Inspect(ctx, "tenant-a", "k-1")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]ops.EffectTable{}
	var names []string
	for _, tb := range rep.Effects.Tables {
		got[tb.Name] = tb
		names = append(names, tb.Name)
	}
	if strings.Join(names, ",") != "payments,emails,ledger_entries" {
		t.Fatalf("tables = %q", names)
	}
	if p := got["payments"]; len(p.Rows) != 2 || strings.Join(p.Columns, ",") != "id,account,amount_cents,created_at" || p.Rows[0][1] != "acct_a" || p.Rows[0][2] != "1250" {
		t.Errorf("payments = %+v", p)
	}
	if e := got["emails"]; len(e.Rows) != 1 || e.Rows[0][1] != "a@example.com" {
		t.Errorf("emails = %+v", e)
	}
	if l := got["ledger_entries"]; len(l.Rows) != 2 || l.Rows[1][1] != "acct_a" {
		t.Errorf("ledger_entries = %+v", l)
	}
	want := "DOUBLE EFFECT: 2 ledger entries for one key;2 payments rows for one key (the ingress should have replayed)"
	if !rep.Known || strings.Join(rep.Effects.Attention, ";") != want {
		t.Errorf("attention = %q, want %q", rep.Effects.Attention, want)
	}

	// tenant-b's repeated email is flagged; its single ledger row under the bare key
	// is no-scope's, not tenant-b's.
	rep, err = r.Inspect(ctx, "tenant-b", "k-1")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(rep.Effects.Attention, ";") != "2 emails rows for one key (the ingress should have replayed)" {
		t.Errorf("tenant-b attention = %q", rep.Effects.Attention)
	}

	st, err := r.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantCounts := []ops.Count{{Name: "payments", N: 3}, {Name: "emails", N: 3}, {Name: "ledger_entries", N: 3}}
	if len(st.Counts) != 3 || st.Counts[0] != wantCounts[0] || st.Counts[1] != wantCounts[1] || st.Counts[2] != wantCounts[2] {
		t.Errorf("counts = %+v, want %+v", st.Counts, wantCounts)
	}
}
