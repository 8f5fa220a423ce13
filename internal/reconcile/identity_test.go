package reconcile_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/deadletter"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/installation"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/internal/registry"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// enqueue writes msgs in one transaction and relays them.
func (b *bundle) enqueue(t *testing.T, msgs ...idem.Message) {
	t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, b.env.DB.Pool, func(tx pgx.Tx) error { return b.ob.Enqueue(ctx, tx, msgs...) }); err != nil {
		t.Fatal(err)
	}
	b.drain(t)
}

// One intent that sends two messages read by one consumer gets two effects: on two
// subjects (a consumer of "test.>"), and on one subject under two names. The
// reconciler proves each message by its own settlement. The same message again
// with another payload is still the producer bug it always was.
func TestTwoMessagesOfOneIntentAreTwoDeliveries(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	b.consumer(t, "audit", "test.>")
	b.enqueue(t,
		idem.Message{Key: "order-1", Subject: "test.orders.created", Payload: []byte(`{"step":"created"}`)},
		idem.Message{Key: "order-1", Subject: "test.orders.paid", Payload: []byte(`{"step":"paid"}`)},
		idem.Message{Key: "order-2", Subject: "test.orders.line", Name: "line-1", Payload: []byte(`{"line":1}`)},
		idem.Message{Key: "order-2", Subject: "test.orders.line", Name: "line-2", Payload: []byte(`{"line":2}`)},
	)
	testenv.Eventually(t, 10*time.Second, "audit drained", b.env.Drained(t, "audit"))
	for _, k := range []string{"order-1", "order-2"} {
		if got := b.env.Effects(t, k); got != 2 {
			t.Errorf("effects of %s = %d, want 2: one per message", k, got)
		}
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Errorf("dead letters = %d, want none", n)
	}
	b.passUntil(t, "the four messages proven", func(r reconcile.Report) bool { return r.Completed == 4 })
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'audit' AND message = 'test.orders.line line-2'`); n != 1 {
		t.Errorf("inbox rows of the named message = %d, want 1", n)
	}

	// line-1 again, with another payload: one message, two payloads. (Under a Msg-Id
	// generation of its own, or the broker's duplicate window would fold it.)
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, b.env.DB.Pool, func(tx pgx.Tx) error {
		return b.ob.Republish(ctx, tx, "bug", "", idem.Message{Key: "order-2", Subject: "test.orders.line", Name: "line-1", Payload: []byte(`{"line":"changed"}`)})
	}); err != nil {
		t.Fatal(err)
	}
	b.drain(t)
	testenv.Eventually(t, 10*time.Second, "the changed copy dead-lettered", func() bool {
		return b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE consumer = 'audit' AND key = 'order-2'
			AND message = 'test.orders.line line-1' AND reason LIKE 'fingerprint mismatch%'`) == 1
	})
	if got := b.env.Effects(t, "order-2"); got != 2 {
		t.Errorf("effects of order-2 after the changed copy = %d, want 2", got)
	}
}

// A re-drive is addressed to the consumers still missing the intent: one that
// settled it acks the copy without an effect, even once its inbox has forgotten the
// key (here: its row deleted after the re-drive was decided, as the collector
// would delete it at its key lifetime).
func TestRedriveReachesOnlyTheMissingConsumers(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	skipped := &testenv.Outcomes{}
	b.observedConsumer(t, "settled", testenv.Subject, skipped.Observe)
	b.register(t, "missing", testenv.Subject)
	b.publish(t, testenv.Subject, "k-1")
	testenv.Eventually(t, 10*time.Second, "settled settles", func() bool { return b.env.Effects(t, "k-1") == 1 })
	if err := b.streamHandle(t).Purge(context.Background()); err != nil {
		t.Fatal(err)
	}
	if rep := b.pass(t); rep.Redriven != 1 {
		t.Fatalf("report = %+v; want the lost row re-driven", rep)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE headers->>'Idem-Replay-For' = 'missing'`); n != 1 {
		t.Fatalf("re-driven rows addressed to missing only = %d, want 1", n)
	}
	b.env.DB.Count(t, `WITH d AS (DELETE FROM idem_inbox WHERE consumer = 'settled' RETURNING 1) SELECT count(*) FROM d`)
	b.drain(t)
	testenv.Eventually(t, 10*time.Second, "settled skips the copy", func() bool { return skipped.Get(idem.OutcomeSkipped) == 1 })
	b.consumer(t, "missing", testenv.Subject)
	b.passUntil(t, "complete", func(r reconcile.Report) bool { return r.Completed == 1 })
	if got := b.env.Effects(t, "k-1"); got != 2 {
		t.Errorf("effects = %d, want 2: settled's first and missing's", got)
	}
}

// Re-driving stops once a copy could outlive the key of any consumer that reads the
// row — a settled one's included, and one with a shorter key lifetime than the
// missing one's — and an inbox row past its expiry proves nothing.
func TestRedriveNeverOutlivesAKey(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	b.consumer(t, "short", testenv.Subject) // default key lifetime, 72h
	b.consumer(t, "long", "test.long", func(c *consumer.Config) { c.KeyLifetime = 400 * time.Hour })
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_consumers SET filter_subject = 'test.effects' WHERE name = 'long' RETURNING 1) SELECT count(*) FROM u`)
	b.publish(t, testenv.Subject, "k-1")
	testenv.Eventually(t, 10*time.Second, "short settles", func() bool { return b.env.Effects(t, "k-1") == 1 })
	if err := b.streamHandle(t).Purge(context.Background()); err != nil {
		t.Fatal(err)
	}
	// 60h old: long's own lifetime would allow a re-drive, but a copy kept for the
	// stream's MaxAge (24h) would outlive short's key (72h, from ~0h).
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_outbox SET created_at = now() - interval '60 hours' RETURNING 1) SELECT count(*) FROM u`)
	if rep := b.pass(t); rep.Redriven != 0 || rep.Alerted != 1 {
		t.Fatalf("report = %+v; want alerted, not re-driven", rep)
	}

	// An expired inbox row is no settlement.
	b.publish(t, testenv.Subject, "k-2")
	testenv.Eventually(t, 10*time.Second, "short settles k-2", func() bool { return b.env.Effects(t, "k-2") == 1 })
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_inbox SET expires_at = now() - interval '1 second' WHERE key = 'k-2' RETURNING 1) SELECT count(*) FROM u`)
	b.env.DB.Count(t, `WITH u AS (INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
		VALUES ('long', 'k-2', 'test.effects', '\x00', 'done', now() + interval '1 hour') RETURNING 1) SELECT count(*) FROM u`)
	if rep := b.pass(t); rep.Completed != 0 {
		t.Fatalf("report = %+v; want k-2 not complete: short's row has expired", rep)
	}
}

// A dead-letter replay is proven by what happened after it: the dead letter it
// replays proves nothing about it, so a replay the stream lost is re-driven; and it
// starts with a fresh attempt count.
func TestLostReplayIsRedriven(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	var broken atomic.Bool
	broken.Store(true)
	handler := func(c *consumer.Config) {
		c.BatchHandler = nil
		c.MaxDeliver = 2
		c.Handler = consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
			if broken.Load() {
				return nil, errors.New("bug in handler")
			}
			res, err := testenv.Effect{}.HandleBatch(ctx, tx, []*consumer.Delivery{d})
			if err != nil {
				return nil, err
			}
			return res[0], nil
		})
	}
	stop := b.consumer(t, "c", testenv.Subject, handler)
	b.publish(t, testenv.Subject, "k-1")
	testenv.Eventually(t, 20*time.Second, "dead-lettered", func() bool {
		return b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE consumer = 'c'`) == 1
	})
	b.passUntil(t, "the original proven by its dead letter", func(r reconcile.Report) bool { return r.Completed == 1 })
	stop()
	broken.Store(false)

	dls := deadletter.New(b.inst)
	list, err := dls.List(context.Background(), 1)
	if err != nil || len(list) != 1 {
		t.Fatalf("dead letters = %v, %v", list, err)
	}
	if _, err := dls.ReplayID(context.Background(), list[0].ID, deadletter.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_attempts WHERE consumer = 'c'`); n != 0 {
		t.Errorf("attempt counts left after the replay = %d, want none: a replay starts afresh", n)
	}
	b.drain(t)
	if err := b.streamHandle(t).Purge(context.Background()); err != nil {
		t.Fatal(err)
	}
	rep := b.pass(t)
	if rep.Completed != 0 || rep.Redriven != 1 {
		t.Fatalf("report = %+v; want the lost replay re-driven, not completed by the old dead letter", rep)
	}
	b.consumer(t, "c", testenv.Subject, handler)
	b.passUntil(t, "the replay proven", func(r reconcile.Report) bool { return r.Completed == 1 })
	if got := b.env.Effects(t, "k-1"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
}

// A durable consumer belongs to the installation that created it. Another
// installation (another database) with the same consumer name on the same stream
// is refused, naming both; and a reconciler never takes another installation's
// acks for a loss. Moving a durable on purpose: delete it, and the new
// installation creates it again.
func TestADurableBelongsToOneInstallation(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	stopFirst := b.consumer(t, "shared", testenv.Subject)

	other := pgtest.New(t)
	otherInst, err := install.New(other.Pool, b.env.NC, install.Config{Stream: b.inst.Stream()})
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(otherInst, testenv.ConsumerConfig("shared"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = c.Run(ctx)
	if !errors.Is(err, consumer.ErrForeignDurable) || !strings.Contains(err.Error(), "/"+b.env.DB.Name+"/public") || !strings.Contains(err.Error(), "/"+other.Name+"/public") {
		t.Fatalf("Run in another installation = %v; want ErrForeignDurable naming both installations", err)
	}

	// The other installation's reconciler sees the first's durable ack past its
	// row (the first consumed it): not a loss of its own.
	otherRelay, err := relay.New(parts.Of(otherInst), relay.Config{AwaitProof: true})
	if err != nil {
		t.Fatal(err)
	}
	otherRec, err := reconcile.New(parts.Of(otherInst), reconcile.Config{After: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := registry.Register(context.Background(), other.Pool, "", registry.Consumer{Name: "shared", Stream: testenv.Stream, FilterSubject: testenv.Subject, KeyLifetime: 72 * time.Hour}, false); err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(context.Background(), other.Pool, func(tx pgx.Tx) error {
		return b.ob.Enqueue(context.Background(), tx, idem.Message{Key: "k-other", Subject: testenv.Subject, Payload: []byte(`{}`)})
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := otherRelay.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "the first installation consumes it", func() bool { return b.env.Effects(t, "k-other") == 1 })
	testenv.Eventually(t, 10*time.Second, "acked", b.env.Drained(t, "shared"))
	rep, err := otherRec.Pass(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Redriven != 0 || rep.Lagging != 1 {
		t.Fatalf("the other installation's reconciler: %+v; want lagging, not re-driven on the first's acks", rep)
	}

	// The deliberate move: the first installation stops, its durable is deleted,
	// the other creates it again.
	stopFirst()
	if err := b.env.JS.DeleteConsumer(context.Background(), testenv.Stream, "shared"); err != nil {
		t.Fatal(err)
	}
	stop := testenv.Go(t, "consumer shared (moved)", c.Run)
	defer stop()
	testenv.Eventually(t, 10*time.Second, "the moved consumer binds the durable", func() bool {
		jc, err := b.env.JS.Consumer(context.Background(), testenv.Stream, "shared")
		return err == nil && strings.HasSuffix(jc.CachedInfo().Config.Metadata["idem.installation"], "/"+other.Name+"/public")
	})
}

// Where a consumer new to the installation starts: by default it backfills what
// the stream holds; StartNew reads only what is published after it registered, and
// the reconciler does not wait for it on older intents.
func TestWhereANewConsumerStarts(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	b.consumer(t, "first", testenv.Subject)
	b.publish(t, testenv.Subject, "k-old")
	testenv.Eventually(t, 10*time.Second, "first settles k-old", func() bool { return b.env.Effects(t, "k-old") == 1 })

	b.consumer(t, "fresh", testenv.Subject, func(c *consumer.Config) { c.Start = consumer.StartNew })
	b.publish(t, testenv.Subject, "k-new")
	testenv.Eventually(t, 10*time.Second, "both settle k-new", func() bool { return b.env.Effects(t, "k-new") == 2 })
	testenv.Eventually(t, 10*time.Second, "fresh idle", b.env.Drained(t, "fresh"))
	if got := b.env.Effects(t, "k-old"); got != 1 {
		t.Fatalf("effects of k-old = %d, want 1: a StartNew consumer does not read history", got)
	}
	b.passUntil(t, "both rows proven without fresh on k-old", func(r reconcile.Report) bool { return r.Completed == 2 })

	b.consumer(t, "late", testenv.Subject, func(c *consumer.Config) { c.Start = consumer.StartBackfill })
	testenv.Eventually(t, 10*time.Second, "late backfills", func() bool { return b.env.Effects(t, "k-old") == 2 && b.env.Effects(t, "k-new") == 3 })

	// Stopped and started again, a StartNew consumer keeps where it started.
	regs, err := registry.Registered(context.Background(), b.env.DB.Pool, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range regs {
		if (r.Name == "fresh") != (r.StartsAt != nil) {
			t.Errorf("registered %s starts at %v", r.Name, r.StartsAt)
		}
	}
}

// Renaming a consumer keeps its inbox: the new name re-reads the stream and folds
// every intent the old one settled. A new name that backfills explicitly runs them
// all again.
func TestRenameKeepsTheInbox(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	stop := b.consumer(t, "charges", testenv.Subject)
	b.publish(t, testenv.Subject, keys("k", 3)...)
	testenv.Eventually(t, 10*time.Second, "charges settles", func() bool { return b.env.AllEffects(t) == 3 })
	stop()

	ctx := context.Background()
	if err := registry.Rename(ctx, b.env.DB.Pool, "", "charges", "ledger", false); !errors.Is(err, registry.ErrStillRunning) {
		t.Fatalf("rename of a consumer seen a moment ago = %v; want ErrStillRunning", err)
	}
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_consumers SET last_seen_at = now() - interval '1 hour' RETURNING 1) SELECT count(*) FROM u`)
	if err := registry.Rename(ctx, b.env.DB.Pool, "", "charges", "ledger", false); err != nil {
		t.Fatal(err)
	}
	b.consumer(t, "ledger", testenv.Subject)
	testenv.Eventually(t, 10*time.Second, "ledger re-reads the stream", b.env.Drained(t, "ledger"))
	if got := b.env.AllEffects(t); got != 3 {
		t.Fatalf("effects after the rename = %d, want 3: the renamed inbox folds the history", got)
	}
	b.passUntil(t, "proven under the new name", func(r reconcile.Report) bool { return r.Completed == 3 })

	// A new name told to backfill beside ledger: another consumer of the same
	// messages, which runs them all.
	b.consumer(t, "other", testenv.Subject, func(c *consumer.Config) { c.Start = consumer.StartBackfill })
	testenv.Eventually(t, 10*time.Second, "other reads the history", func() bool { return b.env.AllEffects(t) == 6 })
	if regs, _ := registry.Registered(ctx, b.env.DB.Pool, ""); len(regs) != 2 {
		t.Errorf("registered after the rename = %v; want ledger and other", regs)
	}
}

// A copy of the database (the same token, an older epoch) whose original bound
// the durable since: the copy's reconciler does not take the original's acks for
// its own consumer's, or it would re-drive every row of the copy the original's
// consumer acked.
func TestACopysReconcilerIgnoresTheOriginalsAcks(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	before, err := installation.Load(context.Background(), b.env.DB.Pool, "")
	if err != nil {
		t.Fatal(err)
	}
	b.consumer(t, "shared", testenv.Subject) // the original binds: its epoch passes the copy's

	cp := pgtest.New(t)
	if _, err := cp.Pool.Exec(context.Background(), `UPDATE idem_installation SET token = $1::uuid, epoch = $2, bound_by = NULLIF($3, '')::uuid`, before.Token, before.Epoch, before.Binding); err != nil {
		t.Fatal(err)
	}
	cpInst, err := install.New(cp.Pool, b.env.NC, install.Config{Stream: b.inst.Stream()})
	if err != nil {
		t.Fatal(err)
	}
	cpRelay, err := relay.New(parts.Of(cpInst), relay.Config{AwaitProof: true})
	if err != nil {
		t.Fatal(err)
	}
	cpRec, err := reconcile.New(parts.Of(cpInst), reconcile.Config{After: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := registry.Register(context.Background(), cp.Pool, "", registry.Consumer{Name: "shared", Stream: testenv.Stream, FilterSubject: testenv.Subject, KeyLifetime: 72 * time.Hour}, false); err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(context.Background(), cp.Pool, func(tx pgx.Tx) error {
		return b.ob.Enqueue(context.Background(), tx, idem.Message{Key: "k-copy", Subject: testenv.Subject, Payload: []byte(`{}`)})
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := cpRelay.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "the original consumes it", func() bool { return b.env.Effects(t, "k-copy") == 1 })
	testenv.Eventually(t, 10*time.Second, "acked", b.env.Drained(t, "shared"))
	rep, err := cpRec.Pass(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Redriven != 0 || rep.Lagging != 1 {
		t.Fatalf("the copy's reconciler: %+v; want lagging, not re-driven on the original's acks", rep)
	}
}

// startOrRefusal runs a consumer of testenv.Subject named name until Run returns
// (a refused start) or it has read what the stream holds, and returns Run's error.
func (b *bundle) startOrRefusal(t *testing.T, name string, edit ...func(*consumer.Config)) error {
	t.Helper()
	cfg := testenv.ConsumerConfig(name)
	cfg.Start = consumer.StartDefault // what a refusal is about
	for _, e := range edit {
		e(&cfg)
	}
	c, err := consumer.New(b.inst, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var runErr error
	returned := false
	testenv.Eventually(t, 20*time.Second, name+" refused, or caught up with the stream", func() bool {
		select {
		case runErr = <-done:
			returned = true
			return true
		default:
			return b.env.Drained(t, name)()
		}
	})
	if !returned {
		cancel()
		runErr = <-done
	}
	return runErr
}

// The rename done in configuration: charges settles k-1…k-5 and stops; ledger,
// with the same stream and filter, starts at once. Backfilling would run the five
// effects again under a name whose inbox is empty; it is refused instead, naming
// charges and what to do, and runs nothing. After Rename it folds the history.
func TestARenameInConfigurationIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	stop := b.consumer(t, "charges", testenv.Subject)
	b.publish(t, testenv.Subject, "k-1", "k-2", "k-3", "k-4", "k-5")
	testenv.Eventually(t, 10*time.Second, "charges settles", func() bool { return b.env.AllEffects(t) == 5 })
	testenv.Eventually(t, 10*time.Second, "charges acked", b.env.Drained(t, "charges"))
	stop()

	err := b.startOrRefusal(t, "ledger")
	if got := b.env.AllEffects(t); !errors.Is(err, consumer.ErrLikelyRenamed) || got != 5 {
		t.Fatalf("ledger deployed in place of charges: Run = %v, effects after the renamed deploy = %d; want ErrLikelyRenamed and 5", err, got)
	}
	for _, want := range []string{"charges", "worker consumers rename charges ledger", "consumer.Rename", "Start", "forget"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not say %q", err, want)
		}
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_consumers WHERE name = 'ledger'`); n != 0 {
		t.Errorf("a refused consumer is registered (%d rows): its restart would not be refused", n)
	}
	if _, err := b.env.JS.Consumer(context.Background(), testenv.Stream, "ledger"); !errors.Is(err, jetstream.ErrConsumerNotFound) {
		t.Errorf("a refused consumer's durable: %v; want none", err)
	}

	if err := consumer.Rename(context.Background(), b.inst, "charges", "ledger", true); err != nil {
		t.Fatal(err)
	}
	if err := b.startOrRefusal(t, "ledger"); err != nil {
		t.Fatalf("ledger after Rename: %v", err)
	}
	if got := b.env.AllEffects(t); got != 5 {
		t.Fatalf("effects after Rename = %d, want 5: the renamed inbox folds the history", got)
	}
	if err := b.startOrRefusal(t, "ledger"); err != nil {
		t.Fatalf("ledger restarted: %v; a restart of a registered name is never refused", err)
	}
}

// What a likely rename does not refuse: new consumers of the same messages while
// none has settled anything (a first deploy of two consumers), a name whose
// durable consumer exists (a restart), and a new name once the old one is
// forgotten. Once they have settled, the next new name is refused.
func TestALikelyRenameRefusesOnlyANewNameBesideSettlements(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	byDefault := func(c *consumer.Config) { c.Start = consumer.StartDefault }
	b.consumer(t, "a", testenv.Subject, byDefault)
	b.consumer(t, "b", testenv.Subject, byDefault)
	b.publish(t, testenv.Subject, "k-1")
	testenv.Eventually(t, 10*time.Second, "a and b settle", func() bool { return b.env.Effects(t, "k-1") == 2 })

	err := b.startOrRefusal(t, "c")
	if !errors.Is(err, consumer.ErrLikelyRenamed) || !strings.Contains(err.Error(), "filter of a, b,") || !strings.Contains(err.Error(), "worker consumers rename OLD c") {
		t.Fatalf("c beside a and b = %v; want ErrLikelyRenamed naming a and b", err)
	}

	// A durable consumer of the name exists (its registration was forgotten
	// while it ran): a restart.
	cfg := testenv.ConsumerConfig("d")
	if _, err := b.env.JS.CreateConsumer(context.Background(), testenv.Stream, jetstream.ConsumerConfig{Durable: "d", FilterSubject: cfg.Subject, AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	if err := b.startOrRefusal(t, "d"); err != nil {
		t.Fatalf("d with its durable consumer: %v; want it started", err)
	}

	// The old names forgotten (retired), a new name backfills.
	ctx := context.Background()
	for _, name := range []string{"a", "b", "d"} {
		if _, err := consumer.Forget(ctx, b.inst, name); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.startOrRefusal(t, "c"); err != nil {
		t.Fatalf("c after forget: %v; want it started", err)
	}
	if got := b.env.Effects(t, "k-1"); got != 4 {
		t.Fatalf("effects of k-1 = %d, want 4: a, b, d, and c's backfill", got)
	}
}
