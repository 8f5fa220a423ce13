package reconcile_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// bundle is one test's world: the test environment, an installation on it, its
// outbox and a relay that awaits proof, and a reconciler that judges every
// published row at once.
type bundle struct {
	env    *testenv.Env
	inst   *install.Installation
	ob     *outbox.Outbox
	relays *testenv.Relays
	rec    *reconcile.Reconciler
	stream string
}

type options struct {
	stream     install.Stream // default the test stream
	reconciler reconcile.Config
}

func setup(t *testing.T, opts options) *bundle {
	t.Helper()
	env := testenv.New(t)
	b := &bundle{env: env, inst: env.Inst}
	if opts.stream.Name != "" {
		b.inst = env.Install(t, func(c *install.Config) { c.Stream = opts.stream })
	}
	b.stream = b.inst.Stream().Name
	b.ob = outbox.New(b.inst)
	b.relays = env.StartRelays(t, b.inst, relay.Config{AwaitProof: true})
	rc := opts.reconciler
	if rc.After == 0 {
		rc.After = time.Millisecond // every published row is due at once
	}
	var err error
	if b.rec, err = reconcile.New(parts.Of(b.inst), rc); err != nil {
		t.Fatal(err)
	}
	return b
}

// enqueue writes one message per key on subject and relays them.
func (b *bundle) publish(t *testing.T, subject string, keys ...string) {
	t.Helper()
	ctx := context.Background()
	msgs := make([]idem.Message, len(keys))
	for i, k := range keys {
		msgs[i] = idem.Message{Key: k, Subject: subject, Payload: []byte(fmt.Sprintf(`{"k":%q}`, k))}
	}
	if err := pgx.BeginFunc(ctx, b.env.DB.Pool, func(tx pgx.Tx) error { return b.ob.Enqueue(ctx, tx, msgs...) }); err != nil {
		t.Fatal(err)
	}
	b.drain(t)
}

func (b *bundle) drain(t *testing.T) {
	t.Helper()
	b.relays.Drain(t)
}

// consumer starts a consumer of subject on the bundle's stream; stop stops it.
func (b *bundle) consumer(t *testing.T, name, subject string, edit ...func(*consumer.Config)) (stop func()) {
	t.Helper()
	return b.observedConsumer(t, name, subject, nil, edit...)
}

// observedConsumer is consumer with obs told its events.
func (b *bundle) observedConsumer(t *testing.T, name, subject string, obs idem.Observer, edit ...func(*consumer.Config)) (stop func()) {
	t.Helper()
	cfg := testenv.ConsumerConfig(name)
	cfg.Subject = subject
	for _, e := range edit {
		e(&cfg)
	}
	c, err := consumer.New(b.inst.Observing(obs), cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop = testenv.Go(t, "consumer "+name, c.Run)
	testenv.Eventually(t, 10*time.Second, name+" registered and subscribed", func() bool {
		_, err := b.env.JS.Consumer(context.Background(), b.stream, name)
		return err == nil && b.env.DB.Count(t, `SELECT count(*) FROM idem_consumers WHERE name = $1`, name) == 1
	})
	return stop
}

// register registers a consumer without running it: one that is down.
func (b *bundle) register(t *testing.T, name, subject string) {
	t.Helper()
	stop := b.consumer(t, name, subject)
	stop()
}

func (b *bundle) pass(t *testing.T) reconcile.Report {
	t.Helper()
	rep, err := b.rec.Pass(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// passUntil passes until cond holds of the sum of the reports, draining the relay
// between passes (what a running worker does).
func (b *bundle) passUntil(t *testing.T, what string, cond func(total reconcile.Report) bool) reconcile.Report {
	t.Helper()
	var total reconcile.Report
	testenv.Eventually(t, 20*time.Second, what, func() bool {
		rep := b.pass(t)
		total.Checked += rep.Checked
		total.Completed += rep.Completed
		total.Lagging += rep.Lagging
		total.Unrouted += rep.Unrouted
		total.Redriven += rep.Redriven
		total.Alerted += rep.Alerted
		b.drain(t)
		return cond(total)
	})
	return total
}

func (b *bundle) stat(t *testing.T) reconcile.Status {
	t.Helper()
	s, err := reconcile.ReadStatus(context.Background(), b.env.DB.Pool, "")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func (b *bundle) streamHandle(t *testing.T) jetstream.Stream {
	t.Helper()
	s, err := b.env.JS.Stream(context.Background(), b.stream)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func keys(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	return out
}

// A published row stays without an expiry until every consumer that reads it has
// settled it; then the reconciler completes it and its retention starts. An
// intent settled by one consumer but not yet by another is not complete.
func TestRetentionFollowsCompletion(t *testing.T) {
	t.Parallel()
	b := setup(t, options{reconciler: reconcile.Config{Retention: time.Hour}})
	b.consumer(t, "fast", testenv.Subject)
	b.register(t, "slow", testenv.Subject) // registered, then down
	b.publish(t, testenv.Subject, keys("k", 3)...)
	testenv.Eventually(t, 10*time.Second, "fast settles all", func() bool { return b.env.Effects(t, "k-2") == 1 })

	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE (published_at IS NOT NULL OR relay = 'log') AND expires_at IS NULL`); n != 3 {
		t.Fatalf("published rows without an expiry = %d, want 3: a published row must not be deleted by age alone", n)
	}
	if rep := b.pass(t); rep.Completed != 0 || rep.Lagging != 3 {
		t.Fatalf("with slow down: %+v; want 0 completed and 3 lagging (still in the stream)", rep)
	}
	if s := b.stat(t); s.Unproven != 3 || s.Lagging != 3 || s.OldestUnprovenAge <= 0 {
		t.Fatalf("status = %+v", s)
	}
	b.consumer(t, "slow", testenv.Subject)
	b.passUntil(t, "all three complete", func(r reconcile.Report) bool { return r.Completed == 3 })
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE completed_at IS NOT NULL
		AND expires_at BETWEEN now() + interval '59 minutes' AND now() + interval '61 minutes'`); n != 3 {
		t.Fatalf("completed rows kept for the Retention = %d, want 3", n)
	}
	if s := b.stat(t); s.Unproven != 0 || s.Redriven != 0 {
		t.Fatalf("status after = %+v", s)
	}
}

// Each way the stream loses a message it acknowledged: the reconciler finds the row
// gone without a receipt and re-drives it under a new Msg-Id generation; the
// consumer then runs the effect exactly once. Without the reconciler the effect
// never happens (checked before each pass).
func TestLostMessagesAreRedrivenOnce(t *testing.T) {
	t.Parallel()
	const n = 5
	for _, tc := range []struct {
		name string
		// lose makes the stream lose the published messages of keys while the
		// consumer is down.
		lose func(t *testing.T, b *bundle, keys []string)
	}{
		{"stream purged", func(t *testing.T, b *bundle, _ []string) {
			if err := b.streamHandle(t).Purge(context.Background()); err != nil {
				t.Fatal(err)
			}
		}},
		{"stream deleted and recreated, its sequences reused", func(t *testing.T, b *bundle, keys []string) {
			ctx := context.Background()
			if err := b.env.JS.DeleteStream(ctx, b.stream); err != nil {
				t.Fatal(err)
			}
			if _, err := b.inst.EnsureStream(ctx); err != nil {
				t.Fatal(err)
			}
			// Other messages take the lost ones' sequences.
			for i := range keys {
				b.env.Publish(t, "test.other", fmt.Sprintf("other-%d", i), fmt.Sprintf("other-%d", i), []byte(`{}`))
			}
		}},
		{"messages deleted", func(t *testing.T, b *bundle, keys []string) {
			for seq := uint64(1); seq <= uint64(len(keys)); seq++ {
				if err := b.streamHandle(t).DeleteMsg(context.Background(), seq); err != nil {
					t.Fatal(err)
				}
			}
		}},
		{"acknowledged by something that is not the consumer", func(t *testing.T, b *bundle, keys []string) {
			// A second process bound to the same durable consumer acks without
			// an inbox: the stream keeps the messages, but will never deliver
			// them again.
			c, err := b.env.JS.Consumer(context.Background(), b.stream, "c")
			if err != nil {
				t.Fatal(err)
			}
			batch, err := c.Fetch(len(keys), jetstream.FetchMaxWait(5*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			got := 0
			for m := range batch.Messages() {
				if err := m.DoubleAck(context.Background()); err != nil {
					t.Fatal(err)
				}
				got++
			}
			if got != len(keys) {
				t.Fatalf("intruder fetched %d, want %d", got, len(keys))
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, options{})
			b.register(t, "c", testenv.Subject)
			ks := keys("k", n)
			b.publish(t, testenv.Subject, ks...)
			tc.lose(t, b, ks)

			stop := b.consumer(t, "c", testenv.Subject)
			testenv.Eventually(t, 10*time.Second, "consumer idle", b.env.Drained(t, "c"))
			if got := b.env.AllEffects(t); got != 0 {
				t.Fatalf("effects before reconciling = %d, want 0 (the loss must be real)", got)
			}
			total := b.passUntil(t, "every lost intent re-driven and completed", func(r reconcile.Report) bool { return r.Completed == n })
			if total.Redriven != n || total.Alerted != 0 {
				t.Fatalf("reports = %+v; want %d re-driven, none alerted", total, n)
			}
			for _, k := range ks {
				if got := b.env.Effects(t, k); got != 1 {
					t.Errorf("effects of %s = %d, want 1", k, got)
				}
			}
			if got := b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE generation = 1 AND msg_id = subject || ' ' || key || chr(29) || 'r1'`); got != n {
				t.Errorf("rows re-driven under generation 1 = %d, want %d", got, n)
			}
			// The relay's failure budget is per generation: one publish so far.
			if got := b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE generation = 1 AND attempts = 1`); got != n {
				t.Errorf("re-driven rows charged one publish = %d, want %d", got, n)
			}
			if s := b.stat(t); s.Redriven != n || s.Unproven != 0 {
				t.Errorf("status = %+v", s)
			}
			stop()
		})
	}
}

// A message that expired from the stream (MaxAge) while its consumer was down is
// re-driven, and the re-drive reaches the consumer once it is back.
func TestExpiredWhileTheConsumerWasDown(t *testing.T) {
	t.Parallel()
	b := setup(t, options{stream: install.Stream{Name: "SHORT", Subjects: []string{"short.>"}}})
	if _, err := b.env.JS.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "SHORT", Subjects: []string{"short.>"}, MaxAge: time.Second, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	b.register(t, "c", "short.x")
	b.publish(t, "short.x", "k-1", "k-2")
	testenv.Eventually(t, 10*time.Second, "the stream expires both", func() bool { return b.env.StreamMsgs(t, "SHORT") == 0 })
	b.consumer(t, "c", "short.x")
	b.passUntil(t, "both re-driven and completed", func(r reconcile.Report) bool { return r.Completed == 2 })
	for _, k := range []string{"k-1", "k-2"} {
		if got := b.env.Effects(t, k); got != 1 {
			t.Errorf("effects of %s = %d, want 1", k, got)
		}
	}
}

// A row younger than After is in flight: even lost, it is not judged yet.
func TestInFlightRowsAreNotJudged(t *testing.T) {
	t.Parallel()
	b := setup(t, options{reconciler: reconcile.Config{After: time.Hour}})
	b.register(t, "c", testenv.Subject)
	b.publish(t, testenv.Subject, "k-1")
	if err := b.streamHandle(t).Purge(context.Background()); err != nil {
		t.Fatal(err)
	}
	if rep := b.pass(t); rep.Checked != 1 || rep.Redriven+rep.Lagging+rep.Alerted+rep.Completed != 0 {
		t.Fatalf("report = %+v; want one row checked and left alone", rep)
	}
}

// A row no registered consumer reads is reported unrouted, not re-driven; once past
// UnroutedHorizon it is dead-lettered under the relay's name, so a replay reaches
// whichever consumer reads it by then — with a horizon that has passed: it was
// published, and a consumer outside the registry may have run it and forgotten its
// key, so a replay needs --force.
func TestUnroutedIntent(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	b.register(t, "c", testenv.Subject)
	b.publish(t, "test.nobody", "k-1")
	if rep := b.pass(t); rep.Unrouted != 1 || rep.Redriven != 0 {
		t.Fatalf("report = %+v; want 1 unrouted", rep)
	}
	if s := b.stat(t); s.Unrouted != 1 {
		t.Fatalf("status = %+v", s)
	}
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_outbox SET created_at = now() - interval '4 days' RETURNING 1) SELECT count(*) FROM u`)
	if rep := b.pass(t); rep.Alerted != 1 {
		t.Fatalf("report past the horizon = %+v; want 1 alerted", rep)
	}
	if got := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE consumer = '(relay)' AND key = 'k-1' AND reason LIKE 'reconcile: no registered consumer reads test.nobody%'
		AND inbox_expires_at <= now()`); got != 1 {
		t.Fatalf("relay dead letters for the unrouted row = %d, want 1 with a replay horizon that has passed", got)
	}
	if s := b.stat(t); s.Unproven != 0 || s.Alerted != 1 {
		t.Fatalf("status = %+v", s)
	}
}

// A row lost past a missing consumer's key lifetime is not re-driven (its inbox may
// have forgotten the key, and the effect would run twice) but dead-lettered for
// that consumer, with a horizon that has passed, so a replay needs --force.
func TestPastTheHorizonAlertsInsteadOfRedriving(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	b.register(t, "c", testenv.Subject)
	b.publish(t, testenv.Subject, "k-1")
	if err := b.streamHandle(t).Purge(context.Background()); err != nil {
		t.Fatal(err)
	}
	life := consumer.Config{}.WithDefaults().KeyLifetime
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_outbox SET created_at = now() - $1::interval RETURNING 1) SELECT count(*) FROM u`, life)
	if rep := b.pass(t); rep.Alerted != 1 || rep.Redriven != 0 {
		t.Fatalf("report = %+v; want 1 alerted, none re-driven", rep)
	}
	if got := b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL AND relay IS NULL AND dead_lettered_at IS NULL`); got != 0 {
		t.Fatalf("rows back in the relay's queue = %d, want 0", got)
	}
	if got := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE consumer = 'c' AND key = 'k-1'
		AND reason LIKE 'reconcile: published but never settled by c%' AND inbox_expires_at <= now()`); got != 1 {
		t.Fatalf("dead letters for c = %d, want 1 with a passed horizon", got)
	}
}

// A dead-letter replay is for one consumer: the others ack it without an effect, so
// it is complete once that consumer alone has settled it.
func TestReplayRowsWaitOnlyForTheirConsumer(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	b.consumer(t, "a", testenv.Subject)
	b.consumer(t, "b", testenv.Subject)
	ctx := context.Background()
	m := idem.Message{Key: "k-1", Subject: testenv.Subject, Payload: []byte(`{}`)}
	if err := pgx.BeginFunc(ctx, b.env.DB.Pool, func(tx pgx.Tx) error { return b.ob.Republish(ctx, tx, "replay-1", "a", m) }); err != nil {
		t.Fatal(err)
	}
	b.drain(t)
	testenv.Eventually(t, 10*time.Second, "both idle", func() bool { return b.env.Drained(t, "a")() && b.env.Drained(t, "b")() })
	b.passUntil(t, "the replay row complete", func(r reconcile.Report) bool { return r.Completed == 1 })
}

// Several reconcilers share the work: each lost row is re-driven once.
func TestTwoReconcilersRedriveEachRowOnce(t *testing.T) {
	t.Parallel()
	const n = 300
	b := setup(t, options{reconciler: reconcile.Config{BatchSize: 20}})
	b.register(t, "c", testenv.Subject)
	b.publish(t, testenv.Subject, keys("k", n)...)
	if err := b.streamHandle(t).Purge(context.Background()); err != nil {
		t.Fatal(err)
	}
	other, err := reconcile.New(parts.Of(b.inst), b.rec.Config())
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	reports := make([]reconcile.Report, 2)
	for i, r := range []*reconcile.Reconciler{b.rec, other} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if reports[i], err = r.Pass(context.Background()); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if got := reports[0].Redriven + reports[1].Redriven; got != n {
		t.Fatalf("re-driven = %d + %d, want %d in all", reports[0].Redriven, reports[1].Redriven, n)
	}
	if got := b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE generation = 1`); got != n {
		t.Fatalf("rows at generation 1 = %d, want %d (none twice)", got, n)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	if _, err := reconcile.New(parts.Of(env.Inst), reconcile.Config{After: -time.Second}); err == nil {
		t.Error("New accepted a negative After")
	}
	// The stream and the schema are the installation's: refused there, and an
	// installation without a NATS connection, which has no stream to read, is
	// refused by New.
	stream := install.Stream{Name: testenv.Stream, Subjects: []string{testenv.Subjects}}
	for name, cfg := range map[string]install.Config{
		"no stream":  {},
		"bad schema": {Stream: stream, Schema: "Bad-Schema"},
	} {
		if _, err := install.New(env.DB.Pool, env.NC, cfg); err == nil {
			t.Errorf("%s: install.New accepted %+v", name, cfg)
		}
	}
	tablesOnly, err := install.New(env.DB.Pool, nil, install.Config{Stream: stream})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := reconcile.New(parts.Of(tablesOnly), reconcile.Config{}); err == nil {
		t.Error("New accepted an installation without a NATS connection")
	}
}

// Trusted subjects are complete once published: their consumers prove delivery
// elsewhere (or not at all).
func TestTrustedSubjectsAreCompleteOncePublished(t *testing.T) {
	t.Parallel()
	b := setup(t, options{reconciler: reconcile.Config{Trusted: []string{"test.remote.>"}}})
	b.register(t, "c", testenv.Subject)
	b.publish(t, "test.remote.x", "k-1")
	if rep := b.pass(t); rep.Completed != 1 || rep.Unrouted != 0 {
		t.Fatalf("report = %+v; want the trusted row complete", rep)
	}
}
