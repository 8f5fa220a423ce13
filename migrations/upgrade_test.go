package migrations_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/deadletter"
	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/migrations"
)

// applyUpTo applies the embedded migrations up to and including version last, as
// a worker of that version would have, and records them.
func applyUpTo(t *testing.T, db *pgtest.DB, last int) {
	t.Helper()
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, m := range all {
		if m.Version > last {
			break
		}
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS idem_schema_migrations (version int PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
				INSERT INTO idem_schema_migrations (version, name) VALUES (`+fmt.Sprint(m.Version)+`, '`+m.Name+`')`)
			return err
		})
		if err != nil {
			t.Fatalf("apply %s: %v", m.Name, err)
		}
	}
}

// Schema v5 names a delivery by (consumer, key, message), in place, on a plain and
// on a partitioned inbox. A row written before it keeps its meaning — its consumer
// settled every message of its key — so a message in flight across the upgrade is
// folded into it, not run a second time; a lease under way across the upgrade is
// honoured; dead letters learn their message from their subject.
func TestUpgradeToV5KeepsEveryRowsMeaning(t *testing.T) {
	t.Parallel()
	for _, partitioned := range []bool{false, true} {
		t.Run(fmt.Sprintf("partitioned=%v", partitioned), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
			applyUpTo(t, db, 4)
			if partitioned {
				if _, err := partition.Convert(ctx, db.Pool, partition.Config{}); err != nil {
					t.Fatalf("convert a v4 inbox: %v", err)
				}
			}
			fp := func(payload string) []byte { s := sha256.Sum256([]byte(payload)); return s[:] }
			exec := func(sql string, args ...any) {
				t.Helper()
				if _, err := db.Pool.Exec(ctx, sql, args...); err != nil {
					t.Fatalf("%s: %v", sql, err)
				}
			}
			// What a v4 worker left: a settled key, an external effect under way, an
			// attempt count and a dead letter.
			exec(`INSERT INTO idem_inbox (consumer, key, fingerprint, status, completed_at, expires_at) VALUES ('charges', 'k-done', $1, 'done', now(), now() + interval '72 hours')`, fp("A"))
			exec(`INSERT INTO idem_inbox (consumer, key, fingerprint, status, lease_until, lease_owner, lease_attempts, expires_at)
				VALUES ('emails', 'k-leased', $1, 'leased', now() + interval '1 hour', 'v4-holder', 1, now() + interval '72 hours')`, fp("E"))
			exec(`INSERT INTO idem_attempts (consumer, key, attempts, expires_at) VALUES ('charges', 'k-tried', 3, now() + interval '72 hours')`)
			exec(`INSERT INTO idem_dead_letters (consumer, key, subject, payload, reason) VALUES ('charges', 'k-dead', 'idem.payments.charge', 'x', 'poison')`)

			applied, err := migrations.Apply(ctx, db.Pool, migrations.Config{})
			if err != nil {
				t.Fatalf("apply v5: %v", err)
			}
			if len(applied) == 0 || applied[0] != "005_identity.sql" {
				t.Fatalf("applied %v, want v5 first", applied)
			}
			if err := migrations.Check(ctx, db.Pool, migrations.Config{}); err != nil {
				t.Fatal(err)
			}

			inst, err := install.New(db.Pool, nil, install.Config{Stream: install.Stream{Name: "PAYMENTS", Subjects: []string{"idem.>"}}})
			if err != nil {
				t.Fatal(err)
			}
			in := dedupe.New(inst)
			var verdicts map[dedupe.ID]dedupe.Verdict
			claims := []dedupe.Claim{
				{Key: "k-done", Message: "idem.payments.charge", Payload: []byte("A")}, // the message in flight: folded
				{Key: "k-done", Message: "idem.payments.refund", Payload: []byte("B")}, // another message, another payload: the old row cannot tell, so never merged
				{Key: "k-new", Message: "idem.payments.charge", Payload: []byte("A")},
				{Key: "k-new", Message: "idem.payments.refund", Payload: []byte("B")},
			}
			if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) (err error) {
				if verdicts, err = in.Claim(ctx, tx, "charges", claims); err != nil {
					return err
				}
				var fresh []dedupe.Settlement
				for _, c := range claims {
					if verdicts[c.ID()] == dedupe.Fresh {
						fresh = append(fresh, dedupe.Settlement{Claim: c})
					}
				}
				return in.Settle(ctx, tx, "charges", fresh, time.Hour)
			}); err != nil {
				t.Fatal(err)
			}
			want := []dedupe.Verdict{dedupe.Duplicate, dedupe.Mismatch, dedupe.Fresh, dedupe.Fresh}
			for i, c := range claims {
				if got := verdicts[c.ID()]; got != want[i] {
					t.Errorf("claim %s/%s after the upgrade: %s, want %s", c.Key, c.Message, got, want[i])
				}
			}

			// The lease under way when the schema moved: still busy for the new
			// version, and its v4 holder can still complete it.
			r, err := in.Lease(ctx, db.Pool, "emails", dedupe.ID{Key: "k-leased", Message: "idem.emails.send"}, []byte("E"), time.Minute, time.Hour)
			if err != nil || r.Outcome != dedupe.LeaseBusy {
				t.Fatalf("lease of a key leased before the upgrade = %+v, %v; want busy", r, err)
			}
			exec(`UPDATE idem_inbox SET lease_until = now() - interval '1 second' WHERE key = 'k-leased'`)
			r, err = in.Lease(ctx, db.Pool, "emails", dedupe.ID{Key: "k-leased", Message: "idem.emails.send"}, []byte("E"), time.Minute, time.Hour)
			if err != nil || r.Outcome != dedupe.LeaseAcquired || r.Attempt != 2 || r.Holder.Message != "" {
				t.Fatalf("lease of an expired pre-upgrade lease = %+v, %v; want it taken over (attempt 2, the old row)", r, err)
			}
			if err := in.CompleteLease(ctx, db.Pool, r.Holder, nil); err != nil {
				t.Fatal(err)
			}
			r, err = in.Lease(ctx, db.Pool, "emails", dedupe.ID{Key: "k-leased", Message: "idem.emails.send"}, []byte("E"), time.Minute, time.Hour)
			if err != nil || r.Outcome != dedupe.LeaseDone {
				t.Fatalf("lease after completing the old row = %+v, %v; want done", r, err)
			}

			dls := deadletter.New(inst)
			if list, err := dls.List(ctx, 10); err != nil || len(list) != 1 || list[0].Message != "idem.payments.charge" {
				t.Errorf("the v4 dead letter = %+v, %v; want its message to be its subject", list, err)
			}
			if n := db.Count(t, `SELECT count(*) FROM idem_attempts WHERE key = 'k-tried' AND message = ''`); n != 1 {
				t.Errorf("the v4 attempt count is gone")
			}
			// A worker of version 4 claiming after the upgrade fails loudly rather
			// than writing a row that names no message.
			_, err = db.Pool.Exec(ctx, `INSERT INTO idem_inbox (consumer, key, fingerprint, status, completed_at, expires_at) VALUES ('charges', 'k-v4', $1, 'done', now(), now() + interval '1 hour')`, fp("A"))
			if err == nil {
				t.Error("a v4-style claim (no message) was accepted after the upgrade")
			}
		})
	}
}
