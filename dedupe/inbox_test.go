package dedupe_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/install"
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

// claim runs one Claim in its own transaction and commits it.
func claim(t *testing.T, db *pgtest.DB, in *dedupe.Inbox, consumer string, claims ...dedupe.Claim) map[string]dedupe.Verdict {
	t.Helper()
	var out map[dedupe.ID]dedupe.Verdict
	err := pgx.BeginFunc(context.Background(), db.Pool, func(tx pgx.Tx) error {
		var err error
		out, err = in.Claim(context.Background(), tx, consumer, claims, time.Hour)
		return err
	})
	if err != nil {
		t.Fatalf("Claim: %v", err)
	}
	return byKey(out)
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

			// A claim that rolls back (the effect failed) is forgotten with it.
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			got, err := in.Claim(ctx, tx, claimConsumer, []dedupe.Claim{{Key: "k5", Message: testMessage, Payload: a}}, time.Hour)
			if err != nil {
				t.Fatal(err)
			}
			wantVerdicts(t, "claim before rollback", byKey(got), map[string]dedupe.Verdict{"k5": dedupe.Fresh})
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			wantVerdicts(t, "after rollback", check(t, db, in, claimConsumer, dedupe.Claim{Key: "k5", Message: testMessage, Payload: a}),
				map[string]dedupe.Verdict{"k5": dedupe.Absent})

			// Results are stored on fresh keys and read back by Lookup.
			err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
				if _, err := in.Claim(ctx, tx, claimConsumer, []dedupe.Claim{{Key: "k6", Message: testMessage, Payload: a}}, time.Hour); err != nil {
					return err
				}
				return in.SetResults(ctx, tx, claimConsumer, map[dedupe.ID][]byte{{Key: "k6", Message: testMessage}: []byte(`"first"`)})
			})
			if err != nil {
				t.Fatal(err)
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

			// Every row is in the configured schema, none anywhere else.
			where := schema
			if where == "" {
				where = "public"
			}
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
		_, err := public.Claim(context.Background(), tx, claimConsumer, []dedupe.Claim{{Key: "k", Message: testMessage, Payload: []byte("x")}}, time.Hour)
		return err
	})
	if err == nil {
		t.Fatal("the public inbox claimed on a database whose idem tables live in inbox_test")
	}
	if _, err := install.New(db.Pool, nil, install.Config{Schema: "Not-A-Schema", Stream: testStream}); err == nil {
		t.Error("install.New accepted an invalid schema name")
	}
}

// Two transactions claim the same key at once: the second waits for the first and
// sees the key Duplicate when it commits, Fresh when it rolls back. Exactly one of
// them ever owns the key. On a partitioned inbox the two claims ask for different
// lifetimes, so their rows would land in different partitions, which no unique
// index spans: there only the claim's key lock makes the second wait.
func TestInboxConcurrentClaimHasOneOwner(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		firstCommits, partitioned bool
	}{{true, false}, {false, false}, {true, true}, {false, true}} {
		name := map[bool]string{true: "first commits", false: "first rolls back"}[tc.firstCommits]
		if tc.partitioned {
			name += " partitioned"
		}
		firstCommits := tc.firstCommits
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db, in := newInbox(t, pgtest.Options{Partitioned: tc.partitioned})
			secondLifetime := time.Hour
			if tc.partitioned {
				secondLifetime = 7 * 24 * time.Hour
			}
			ctx := context.Background()
			cl := []dedupe.Claim{{Key: "k-race", Message: testMessage, Payload: []byte("x")}}

			first, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer first.Rollback(ctx) //nolint:errcheck // a no-op once ended
			got, err := in.Claim(ctx, first, claimConsumer, cl, time.Hour)
			if err != nil {
				t.Fatal(err)
			}
			wantVerdicts(t, "first", byKey(got), map[string]dedupe.Verdict{"k-race": dedupe.Fresh})

			type result struct {
				v   map[dedupe.ID]dedupe.Verdict
				err error
			}
			second := make(chan result, 1)
			go func() {
				var r result
				r.err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					var err error
					r.v, err = in.Claim(ctx, tx, claimConsumer, cl, secondLifetime)
					return err
				})
				second <- r
			}()
			testenv.Eventually(t, 45*time.Second, "the second claim to wait on the first", func() bool {
				return db.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`) == 1
			})
			want := dedupe.Duplicate
			if firstCommits {
				err = first.Commit(ctx)
			} else {
				err = first.Rollback(ctx)
				want = dedupe.Fresh
			}
			if err != nil {
				t.Fatal(err)
			}
			var r result
			select {
			case r = <-second:
			case <-time.After(45 * time.Second):
				t.Fatal("the second claim never returned")
			}
			if r.err != nil {
				t.Fatal(r.err)
			}
			wantVerdicts(t, "second", byKey(r.v), map[string]dedupe.Verdict{"k-race": want})
			if n := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = 'k-race'`); n != 1 {
				t.Errorf("inbox rows = %d, want 1", n)
			}
		})
	}
}

func TestInboxClaimNothing(t *testing.T) {
	t.Parallel()
	_, in := newInbox(t, pgtest.Options{})
	// No keys, no statement: a nil transaction is never touched.
	got, err := in.Claim(context.Background(), nil, claimConsumer, nil, time.Hour)
	if err != nil || len(got) != 0 {
		t.Fatalf("Claim(no keys) = %v, %v; want an empty map", got, err)
	}
	for v, s := range map[dedupe.Verdict]string{dedupe.Fresh: "fresh", dedupe.Duplicate: "duplicate", dedupe.Mismatch: "mismatch", dedupe.Absent: "absent"} {
		if v.String() != s {
			t.Errorf("%d.String() = %q, want %q", int(v), v.String(), s)
		}
	}
}
