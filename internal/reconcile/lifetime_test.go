package reconcile_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/internal/registry"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// lifetimeRaised is the story of a consumer whose KeyLifetime is raised after it
// settled a row that another consumer keeps unproven: "settled" settles k-1 under
// 30h and is redeployed with 400h; "missing" (72h) is down. 31 hours later
// settled's inbox row has expired, by the lifetime it was written under.
func lifetimeRaised(t *testing.T) *bundle {
	t.Helper()
	b := setup(t, options{})
	stop := b.consumer(t, "settled", testenv.Subject, lifetime(30*time.Hour))
	b.consumer(t, "missing", testenv.Subject, lifetime(72*time.Hour))()
	b.publish(t, testenv.Subject, "k-1")
	testenv.Eventually(t, 10*time.Second, "settled settles k-1", func() bool { return b.env.Effects(t, "k-1") == 1 })
	stop()
	// The redeploy: settled registers again, with the raised lifetime.
	stop = b.consumer(t, "settled", testenv.Subject, lifetime(400*time.Hour))
	testenv.Eventually(t, 10*time.Second, "settled registered with 400h", func() bool {
		return b.env.DB.Count(t, `SELECT count(*) FROM idem_consumers WHERE name = 'settled' AND key_lifetime = '400 hours'`) == 1
	})
	stop()
	// 31 hours pass: the row and settled's record of it are that old, and the
	// record has expired by the 30h it was written under.
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_outbox SET created_at = now() - interval '31 hours', published_at = now() - interval '31 hours' RETURNING 1) SELECT count(*) FROM u`)
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_inbox SET created_at = now() - interval '31 hours', expires_at = now() - interval '1 hour' WHERE consumer = 'settled' RETURNING 1) SELECT count(*) FROM u`)
	return b
}

func lifetime(d time.Duration) func(*consumer.Config) {
	return func(c *consumer.Config) { c.KeyLifetime = d }
}

// A consumer's raised KeyLifetime does not reach back: a row written before the
// raise is judged by the lifetime its settlement was written under, so once that
// settlement may have expired the row is alerted, never re-driven to the consumer
// that settled it.
func TestRaisedLifetimeDoesNotRedriveWhatWasSettled(t *testing.T) {
	t.Parallel()
	b := lifetimeRaised(t)
	rep := b.pass(t)
	if rep.Redriven != 0 || rep.Alerted != 1 {
		t.Fatalf("pass = %+v; want the row alerted (for missing), none re-driven", rep)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE consumer = 'missing' AND key = 'k-1'`); n != 1 {
		t.Fatalf("dead letters of k-1 for missing = %d, want 1", n)
	}
}

// The negative control: judged by the lifetime registered today, the row is
// re-driven, settled's expired record is collected, and k-1's effect runs again.
func TestRaisedLifetimeNegativeControl(t *testing.T) {
	t.Parallel()
	ctx := faults.With(context.Background(), faults.New().Switch(faults.RegisteredLifetime))
	b := lifetimeRaised(t)
	rep, err := b.rec.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Redriven != 1 {
		t.Fatalf("pass = %+v; the control must re-drive the row", rep)
	}
	b.env.DB.Count(t, `WITH d AS (DELETE FROM idem_inbox WHERE consumer = 'settled' AND expires_at < now() RETURNING 1) SELECT count(*) FROM d`)
	b.drain(t)
	defer b.consumer(t, "settled", testenv.Subject, lifetime(400*time.Hour))()
	testenv.Eventually(t, 20*time.Second, "k-1's effect runs a second time", func() bool { return b.env.Effects(t, "k-1") == 2 })
}

// A process still running with the old lifetime during a redeploy keeps settling
// under it: each of its sightings moves the time up to which rows are judged by
// the shorter lifetime. A prior lifetime every row of which has expired is
// forgotten at the next change.
func TestPriorLifetimeFollowsTheProcessesThatUseIt(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	ctx := context.Background()
	entry := func() registry.Consumer {
		t.Helper()
		cs, err := registry.Registered(ctx, b.env.DB.Pool, "")
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cs {
			if c.Name == "c" {
				return c
			}
		}
		t.Fatal("c is not registered")
		return registry.Consumer{}
	}
	register := func(d time.Duration) {
		t.Helper()
		c := registry.Consumer{Name: "c", Stream: b.stream, FilterSubject: testenv.Subject, KeyLifetime: d}
		if _, err := registry.Register(ctx, b.env.DB.Pool, "", c, false); err != nil {
			t.Fatal(err)
		}
	}
	register(30 * time.Hour)
	if c := entry(); c.PriorKeyLifetime != 0 || c.SettledLifetime(time.Now()) != 30*time.Hour {
		t.Fatalf("first registration: %+v; want no prior lifetime", c)
	}
	register(400 * time.Hour)
	raised := entry()
	if raised.PriorKeyLifetime != 30*time.Hour || raised.KeyLifetimeSince == nil {
		t.Fatalf("after the raise: %+v; want prior lifetime 30h since now", raised)
	}
	if got := raised.SettledLifetime(raised.KeyLifetimeSince.Add(-time.Hour)); got != 30*time.Hour {
		t.Fatalf("a row written before the raise is judged by %s, want 30h", got)
	}
	if got := raised.SettledLifetime(raised.KeyLifetimeSince.Add(time.Hour)); got != 400*time.Hour {
		t.Fatalf("a row written after the raise is judged by %s, want 400h", got)
	}

	// An old process is seen: rows written up to now may be its.
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_consumers SET key_lifetime_since = now() - interval '1 hour' RETURNING 1) SELECT count(*) FROM u`)
	if err := registry.Seen(ctx, b.env.DB.Pool, "", "c", 30*time.Hour); err != nil {
		t.Fatal(err)
	}
	if c := entry(); c.KeyLifetimeSince == nil || time.Since(*c.KeyLifetimeSince) > 10*time.Minute {
		t.Fatalf("after a sighting of the old process: since %v; want about now", c.KeyLifetimeSince)
	}
	// A new process is seen: nothing moves.
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_consumers SET key_lifetime_since = now() - interval '1 hour' RETURNING 1) SELECT count(*) FROM u`)
	if err := registry.Seen(ctx, b.env.DB.Pool, "", "c", 400*time.Hour); err != nil {
		t.Fatal(err)
	}
	if c := entry(); c.KeyLifetimeSince == nil || time.Since(*c.KeyLifetimeSince) < 50*time.Minute {
		t.Fatalf("after a sighting of a new process: since %v; want an hour ago, unmoved", c.KeyLifetimeSince)
	}

	// 31 hours after the last use of 30h, every row settled under it has expired:
	// the next change keeps 400h alone.
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_consumers SET key_lifetime_since = now() - interval '31 hours' RETURNING 1) SELECT count(*) FROM u`)
	register(500 * time.Hour)
	if c := entry(); c.PriorKeyLifetime != 400*time.Hour {
		t.Fatalf("after a second raise: prior %s, want 400h (30h has expired everywhere)", c.PriorKeyLifetime)
	}
}

// A reconciler of an older release stands down on a schema a newer one migrated:
// it re-drives nothing, and says why.
func TestReconcilerStandsDownOnANewerSchema(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	b.register(t, "c", testenv.Subject)
	b.publish(t, testenv.Subject, "k-1")
	if err := b.streamHandle(t).Purge(context.Background()); err != nil {
		t.Fatal(err)
	}
	b.env.DB.Count(t, `WITH i AS (INSERT INTO idem_schema_migrations (version, name) VALUES (9999, '9999_from_the_future.sql') RETURNING 1) SELECT count(*) FROM i`)
	rep, err := b.rec.Pass(context.Background())
	if !errors.Is(err, reconcile.ErrSchemaAhead) || rep.Redriven != 0 {
		t.Fatalf("pass on a newer schema = %+v, %v; want nothing done and ErrSchemaAhead", rep, err)
	}
	b.env.DB.Count(t, `WITH d AS (DELETE FROM idem_schema_migrations WHERE version = 9999 RETURNING 1) SELECT count(*) FROM d`)
	if rep := b.pass(t); rep.Redriven != 1 {
		t.Fatalf("pass on this release's schema = %+v; want the lost row re-driven", rep)
	}
}
