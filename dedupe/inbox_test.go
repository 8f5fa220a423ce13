package dedupe_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

const claimConsumer = "charges"

// testMessage is the message of every claim that does not say otherwise.
const testMessage = "test.charge"

// testStream is the stream of the tests' installations; an inbox never touches it.
var testStream = install.Stream{Name: testenv.Stream, Subjects: []string{testenv.Subjects}}

// installOf is the installation of schema in db, without a NATS connection: the
// inbox needs only the tables.
func installOf(t testing.TB, db *pgtest.DB, schema string) *install.Installation {
	t.Helper()
	inst, err := install.New(db.Pool, nil, install.Config{Schema: schema, Stream: testStream})
	if err != nil {
		t.Fatal(err)
	}
	return inst
}

// newInbox starts a database shaped by opts and returns it with its inbox.
func newInbox(t testing.TB, opts pgtest.Options) (*pgtest.DB, *dedupe.Inbox) {
	t.Helper()
	db := pgtest.NewWith(t, opts)
	return db, dedupe.New(installOf(t, db, opts.Schema))
}

// byKey keys verdicts by key alone, for claims of one message each.
func byKey(vs map[dedupe.ID]dedupe.Verdict) map[string]dedupe.Verdict {
	out := make(map[string]dedupe.Verdict, len(vs))
	for id, v := range vs {
		out[id.Key] = v
	}
	return out
}

// claim runs one Claim in its own transaction, settles what it judged Fresh (with
// no result) and commits, as a consumer does around its effect.
func claim(t *testing.T, db *pgtest.DB, in *dedupe.Inbox, consumer string, claims ...dedupe.Claim) map[string]dedupe.Verdict {
	t.Helper()
	var out map[dedupe.ID]dedupe.Verdict
	err := pgx.BeginFunc(context.Background(), db.Pool, func(tx pgx.Tx) error {
		var err error
		if out, err = in.Claim(context.Background(), tx, consumer, claims); err != nil {
			return err
		}
		return in.Settle(context.Background(), tx, consumer, freshOf(claims, out, nil), time.Hour)
	})
	if err != nil {
		t.Fatalf("Claim and Settle: %v", err)
	}
	return byKey(out)
}

// freshOf is the settlements of the claims judged Fresh, with results[key].
func freshOf(claims []dedupe.Claim, verdicts map[dedupe.ID]dedupe.Verdict, results map[string][]byte) []dedupe.Settlement {
	var done []dedupe.Settlement
	for _, c := range claims {
		if verdicts[c.ID()] == dedupe.Fresh {
			done = append(done, dedupe.Settlement{Claim: c, Result: results[c.Key]})
		}
	}
	return done
}

func check(t *testing.T, db *pgtest.DB, in *dedupe.Inbox, consumer string, claims ...dedupe.Claim) map[string]dedupe.Verdict {
	t.Helper()
	out, err := in.Check(context.Background(), db.Pool, consumer, claims)
	if err != nil {
		t.Fatalf("Check: %v", err)
	}
	return byKey(out)
}

func wantVerdicts(t *testing.T, what string, got, want map[string]dedupe.Verdict) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %d verdicts %v, want %v", what, len(got), got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %q is %s, want %s", what, k, got[k], v)
		}
	}
}

// The verdicts of Claim and Check, in one schema: a new key is Fresh (once), the
// same key and payload again a Duplicate, the same key with another payload a
// Mismatch; Check claims nothing and says Absent of an unknown key; keys are per
// consumer; a rolled-back claim leaves nothing behind.
func TestInboxClaimVerdicts(t *testing.T) {
	t.Parallel()
	for _, schema := range []string{"", "inbox_test"} {
		name := map[string]string{"": "public", "inbox_test": "inbox_test"}[schema]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db, in := newInbox(t, pgtest.Options{Schema: schema})
			ctx := context.Background()
			a, b := []byte("payload A"), []byte("payload B")

			wantVerdicts(t, "first claim", claim(t, db, in, claimConsumer,
				dedupe.Claim{Key: "k2", Message: testMessage, Payload: a}, dedupe.Claim{Key: "k1", Message: testMessage, Payload: a}),
				map[string]dedupe.Verdict{"k1": dedupe.Fresh, "k2": dedupe.Fresh})
			wantVerdicts(t, "second claim", claim(t, db, in, claimConsumer,
				dedupe.Claim{Key: "k1", Message: testMessage, Payload: a}, dedupe.Claim{Key: "k2", Message: testMessage, Payload: b}, dedupe.Claim{Key: "k3", Message: testMessage, Payload: b}),
				map[string]dedupe.Verdict{"k1": dedupe.Duplicate, "k2": dedupe.Mismatch, "k3": dedupe.Fresh})

			// Check judges without claiming: k4 stays unknown afterwards.
			wantVerdicts(t, "check", check(t, db, in, claimConsumer,
				dedupe.Claim{Key: "k1", Message: testMessage, Payload: a}, dedupe.Claim{Key: "k2", Message: testMessage, Payload: b}, dedupe.Claim{Key: "k4", Message: testMessage, Payload: a}),
				map[string]dedupe.Verdict{"k1": dedupe.Duplicate, "k2": dedupe.Mismatch, "k4": dedupe.Absent})
			wantVerdicts(t, "check again", check(t, db, in, claimConsumer, dedupe.Claim{Key: "k4", Message: testMessage, Payload: a}),
				map[string]dedupe.Verdict{"k4": dedupe.Absent})

			// Another consumer has its own key space.
			wantVerdicts(t, "other consumer", claim(t, db, in, "emails", dedupe.Claim{Key: "k1", Message: testMessage, Payload: b}),
				map[string]dedupe.Verdict{"k1": dedupe.Fresh})

			// A claim writes nothing: a transaction that claims and commits
			// without settling leaves the delivery unknown.
			err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
				got, err := in.Claim(ctx, tx, claimConsumer, []dedupe.Claim{{Key: "k5", Message: testMessage, Payload: a}})
				wantVerdicts(t, "claim without settle", byKey(got), map[string]dedupe.Verdict{"k5": dedupe.Fresh})
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			wantVerdicts(t, "after a claim alone", check(t, db, in, claimConsumer, dedupe.Claim{Key: "k5", Message: testMessage, Payload: a}),
				map[string]dedupe.Verdict{"k5": dedupe.Absent})

			// A settlement that rolls back (the effect failed) is forgotten with it.
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			k5 := []dedupe.Claim{{Key: "k5", Message: testMessage, Payload: a}}
			if err := in.Settle(ctx, tx, claimConsumer, freshOf(k5, map[dedupe.ID]dedupe.Verdict{k5[0].ID(): dedupe.Fresh}, nil), time.Hour); err != nil {
				t.Fatal(err)
			}
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			wantVerdicts(t, "after rollback", check(t, db, in, claimConsumer, dedupe.Claim{Key: "k5", Message: testMessage, Payload: a}),
				map[string]dedupe.Verdict{"k5": dedupe.Absent})

			// Results are stored with the settlement, in the row's one version,
			// and read back by Lookup.
			k6 := []dedupe.Claim{{Key: "k6", Message: testMessage, Payload: a}}
			var before, after [2]int64
			err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
				// This backend's writes to the inbox (every partition's) not yet
				// reported: this transaction's, and maybe some before it.
				writes := func(into *[2]int64) error {
					return tx.QueryRow(ctx, `SELECT COALESCE(sum(n_tup_ins), 0)::bigint, COALESCE(sum(n_tup_upd), 0)::bigint
FROM pg_stat_xact_user_tables WHERE relname LIKE 'idem\_inbox%'`).Scan(&into[0], &into[1])
				}
				if err := writes(&before); err != nil {
					return err
				}
				v, err := in.Claim(ctx, tx, claimConsumer, k6)
				if err != nil {
					return err
				}
				if err := in.Settle(ctx, tx, claimConsumer, freshOf(k6, v, map[string][]byte{"k6": []byte(`"first"`)}), time.Hour); err != nil {
					return err
				}
				return writes(&after)
			})
			if err != nil {
				t.Fatal(err)
			}
			if inserts, updates := after[0]-before[0], after[1]-before[1]; inserts != 1 || updates != 0 {
				t.Errorf("claiming and settling one delivery wrote %d inserts and %d updates, want one insert", inserts, updates)
			}
			recs, err := in.Lookup(ctx, db.Pool, claimConsumer, []dedupe.ID{{Key: "k6", Message: testMessage}, {Key: "k-none", Message: testMessage}})
			if err != nil {
				t.Fatal(err)
			}
			if r, ok := recs[dedupe.ID{Key: "k6", Message: testMessage}]; !ok || string(r.Result) != `"first"` || r.Status != dedupe.StatusDone || !r.Matches(a) || r.Matches(b) {
				t.Errorf("Lookup(k6) = %+v (found %v), want done with the first result and payload A's fingerprint", r, ok)
			}
			if _, ok := recs[dedupe.ID{Key: "k-none", Message: testMessage}]; ok || len(recs) != 1 {
				t.Errorf("Lookup returned %d records, want only k6", len(recs))
			}
			where := schema
			if where == "" {
				where = "public"
			}
			// Every row is in the configured schema, none anywhere else.
			if n := db.Count(t, `SELECT count(*) FROM `+where+`.idem_inbox`); n != 5 {
				t.Errorf("%s.idem_inbox holds %d rows, want 5 (k1 twice, k2, k3, k6)", where, n)
			}
			if schema != "" {
				if n := db.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename = 'idem_inbox'`); n != 0 {
					t.Errorf("public.idem_inbox exists: the inbox is not confined to its schema")
				}
			}
		})
	}
}

// An inbox of one schema does not read or write another's table: the default
// inbox on a database migrated into another schema finds no idem_inbox.
func TestInboxSchemaIsQualified(t *testing.T) {
	t.Parallel()
	db := pgtest.NewWith(t, pgtest.Options{Schema: "inbox_test"})
	public := dedupe.New(installOf(t, db, ""))
	err := pgx.BeginFunc(context.Background(), db.Pool, func(tx pgx.Tx) error {
		_, err := public.Claim(context.Background(), tx, claimConsumer, []dedupe.Claim{{Key: "k", Message: testMessage, Payload: []byte("x")}})
		return err
	})
	if err == nil {
		t.Fatal("the public inbox claimed on a database whose idem tables live in inbox_test")
	}
	if _, err := install.New(db.Pool, nil, install.Config{Schema: "Not-A-Schema", Stream: testStream}); err == nil {
		t.Error("install.New accepted an invalid schema name")
	}
}

// Two transactions process the same delivery at once: both claim it, the first
// settles it, and the second settles it while the first is still open. The second
// waits for the first, and fails with ErrSettleConflict when the first commits
// (it rolls back and, claiming again, finds a Duplicate), or settles it when the
// first rolls back. Exactly one of them ever commits the delivery. On a
// partitioned inbox, which no unique index spans (the two ask for different
// lifetimes, so their rows would land in different partitions), the second
// waits already in its claim, on the key's lock, and judges the delivery by what
// the first did.
func TestInboxConcurrentSettleHasOneOwner(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		firstCommits, partitioned bool
	}{{true, false}, {false, false}, {true, true}, {false, true}} {
		name := map[bool]string{true: "first commits", false: "first rolls back"}[tc.firstCommits]
		if tc.partitioned {
			name += " partitioned"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db, in := newInbox(t, pgtest.Options{Partitioned: tc.partitioned})
			// IDEM_TEST_PARTITIONED=1 partitions every test database.
			partitioned := db.Count(t, `SELECT count(*) FROM pg_partitioned_table WHERE partrelid = 'idem_inbox'::regclass`) == 1
			secondLifetime := time.Hour
			if partitioned {
				secondLifetime = 7 * 24 * time.Hour
			}
			ctx := context.Background()
			cl := []dedupe.Claim{{Key: "k-race", Message: testMessage, Payload: []byte("x")}}

			first, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer first.Rollback(ctx) //nolint:errcheck // a no-op once ended
			got, err := in.Claim(ctx, first, claimConsumer, cl)
			if err != nil {
				t.Fatal(err)
			}
			wantVerdicts(t, "first", byKey(got), map[string]dedupe.Verdict{"k-race": dedupe.Fresh})
			if err := in.Settle(ctx, first, claimConsumer, freshOf(cl, got, nil), time.Hour); err != nil {
				t.Fatal(err)
			}

			// The second: claim, settle what was fresh, commit; once more after a
			// conflict, as a consumer does.
			type result struct {
				claimed, reclaimed map[dedupe.ID]dedupe.Verdict
				settleErr, err     error
			}
			second := make(chan result, 1)
			go func() {
				var r result
				r.err = func() error {
					tx, err := db.Pool.Begin(ctx)
					if err != nil {
						return err
					}
					defer tx.Rollback(ctx) //nolint:errcheck // a no-op once ended
					if r.claimed, err = in.Claim(ctx, tx, claimConsumer, cl); err != nil {
						return err
					}
					if r.settleErr = in.Settle(ctx, tx, claimConsumer, freshOf(cl, r.claimed, nil), secondLifetime); r.settleErr == nil {
						return tx.Commit(ctx)
					}
					if err := tx.Rollback(ctx); err != nil {
						return err
					}
					return pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
						r.reclaimed, err = in.Claim(ctx, tx, claimConsumer, cl)
						return err
					})
				}()
				second <- r
			}()
			testenv.Eventually(t, 45*time.Second, "the second to wait on the first", func() bool {
				return db.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`) == 1
			})
			if firstCommits := tc.firstCommits; firstCommits {
				err = first.Commit(ctx)
			} else {
				err = first.Rollback(ctx)
			}
			if err != nil {
				t.Fatal(err)
			}
			var r result
			select {
			case r = <-second:
			case <-time.After(45 * time.Second):
				t.Fatal("the second never returned")
			}
			if r.err != nil {
				t.Fatal(r.err)
			}
			switch {
			case partitioned && tc.firstCommits:
				wantVerdicts(t, "second claim", byKey(r.claimed), map[string]dedupe.Verdict{"k-race": dedupe.Duplicate})
			case tc.firstCommits:
				wantVerdicts(t, "second claim", byKey(r.claimed), map[string]dedupe.Verdict{"k-race": dedupe.Fresh})
				if !errors.Is(r.settleErr, dedupe.ErrSettleConflict) {
					t.Fatalf("the second's settle = %v, want ErrSettleConflict", r.settleErr)
				}
				wantVerdicts(t, "second claim after the conflict", byKey(r.reclaimed), map[string]dedupe.Verdict{"k-race": dedupe.Duplicate})
			default:
				wantVerdicts(t, "second claim", byKey(r.claimed), map[string]dedupe.Verdict{"k-race": dedupe.Fresh})
				if r.settleErr != nil {
					t.Fatalf("the second's settle after the first rolled back = %v, want it to settle", r.settleErr)
				}
			}
			if n := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = 'k-race'`); n != 1 {
				t.Errorf("inbox rows = %d, want 1", n)
			}
		})
	}
}

// A partitioned inbox converted under a running inbox, which learnt the table
// plain: its settlement inserts nothing into the converted table (its primary key
// no longer makes a delivery unique) and says ErrSettleConflict, and the next
// claim learns the layout and serialises on the key's lock.
func TestSettleRelearnsAConvertedInbox(t *testing.T) {
	t.Parallel()
	db, in := newInbox(t, pgtest.Options{})
	if db.Count(t, `SELECT count(*) FROM pg_partitioned_table WHERE partrelid = 'idem_inbox'::regclass`) == 1 {
		t.Skip("the test database is partitioned already")
	}
	ctx := context.Background()
	claim(t, db, in, claimConsumer, dedupe.Claim{Key: "k-before", Message: testMessage, Payload: []byte("x")}) // learns: plain
	if _, err := partition.Convert(ctx, db.Pool, partition.Config{}); err != nil {
		t.Fatal(err)
	}
	cl := []dedupe.Claim{{Key: "k-after", Message: testMessage, Payload: []byte("x")}}
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		v, err := in.Claim(ctx, tx, claimConsumer, cl)
		if err != nil {
			return err
		}
		return in.Settle(ctx, tx, claimConsumer, freshOf(cl, v, nil), time.Hour)
	})
	if !errors.Is(err, dedupe.ErrSettleConflict) {
		t.Fatalf("settling on the converted table with the plain statement = %v, want ErrSettleConflict", err)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = 'k-after'`); n != 0 {
		t.Fatalf("the plain statement wrote %d rows into the partitioned inbox", n)
	}
	wantVerdicts(t, "claim again", claim(t, db, in, claimConsumer, cl...), map[string]dedupe.Verdict{"k-after": dedupe.Fresh})
	if n := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = 'k-after'`); n != 1 {
		t.Fatalf("after learning the layout: %d rows, want 1", n)
	}
}

// Settle refuses what no claim would hand it: a delivery without a message, and
// one delivery twice.
func TestSettleRefusesBadInput(t *testing.T) {
	t.Parallel()
	db, in := newInbox(t, pgtest.Options{})
	ctx := context.Background()
	one := dedupe.Settlement{Claim: dedupe.Claim{Key: "k", Message: testMessage, Payload: []byte("x")}}
	for name, done := range map[string][]dedupe.Settlement{
		"no message": {{Claim: dedupe.Claim{Key: "k", Payload: []byte("x")}}},
		"twice":      {one, one},
	} {
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return in.Settle(ctx, tx, claimConsumer, done, time.Hour) })
		if err == nil || errors.Is(err, dedupe.ErrSettleConflict) {
			t.Errorf("%s: Settle = %v, want a refusal", name, err)
		}
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_inbox`); n != 0 {
		t.Errorf("refused settlements wrote %d rows", n)
	}
}

func TestInboxClaimNothing(t *testing.T) {
	t.Parallel()
	_, in := newInbox(t, pgtest.Options{})
	// No keys, no statement: a nil transaction is never touched.
	got, err := in.Claim(context.Background(), nil, claimConsumer, nil)
	if err != nil || len(got) != 0 {
		t.Fatalf("Claim(no keys) = %v, %v; want an empty map", got, err)
	}
	if err := in.Settle(context.Background(), nil, claimConsumer, nil, time.Hour); err != nil {
		t.Fatalf("Settle(nothing) = %v", err)
	}
	for v, s := range map[dedupe.Verdict]string{dedupe.Fresh: "fresh", dedupe.Duplicate: "duplicate", dedupe.Mismatch: "mismatch", dedupe.Absent: "absent"} {
		if v.String() != s {
			t.Errorf("%d.String() = %q, want %q", int(v), v.String(), s)
		}
	}
}
