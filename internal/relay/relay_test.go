package relay_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// startConsumer runs testenv.Effect on the test subject, counting its outcomes.
func startConsumer(t *testing.T, env *testenv.Env, name string) *testenv.Outcomes {
	t.Helper()
	out := &testenv.Outcomes{}
	c, err := consumer.New(env.Observed(t, out.Observe), testenv.ConsumerConfig(name))
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, "consumer "+name, c.Run)
	return out
}

func TestRelayConfigValidate(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]relay.Config{
		"negative batch":   {BatchSize: -1},
		"negative poll":    {PollInterval: -time.Second},
		"negative timeout": {PublishTimeout: -time.Second},
	} {
		if _, err := relay.New(parts.Installation{}, cfg); err == nil {
			t.Errorf("%s: New accepted %+v", name, cfg)
		}
	}
	// The schema is the installation's: a bad one is refused there.
	refusedInstall(t, pgtest.New(t), "bad schema", install.Config{Schema: "Not-A-Schema",
		Stream: install.Stream{Name: testenv.Stream, Subjects: []string{testenv.Subjects}}})
}

// The relay publishes with Idempotency-Key and a Msg-Id derived from subject and
// key, carries the caller's headers, and marks rows only after the PubAck.
func TestRelayPublishesAndMarks(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ob := outbox.New(env.Inst)
	other := idem.Message{Key: "k-1", Subject: "test.receipts", Payload: []byte(`{}`), Headers: map[string]string{"X-Trace": "t1"}}
	enqueue(t, env.DB, ob, msg("k-1"), msg("k-2"), other)
	var published atomic.Int64
	r := newRelay(t, env.Observed(t, func(e idem.Event) {
		if e.Component == idem.ComponentRelay && e.Outcome == idem.OutcomePublished {
			published.Add(int64(e.Count))
		}
	}), relay.Config{Retention: time.Hour})
	n, err := r.Drain(context.Background())
	if err != nil || n != 3 {
		t.Fatalf("Drain = %d, %v; want 3", n, err)
	}
	if got := env.StreamMsgs(t, testenv.Stream); got != 3 {
		t.Fatalf("stream holds %d messages, want 3 (one intent's two messages must not fold)", got)
	}
	if n := published.Load(); n != 3 {
		t.Errorf("published events count %d rows, want 3", n)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL AND attempts = 1
		AND expires_at BETWEEN now() + interval '59 minutes' AND now() + interval '61 minutes'`); n != 3 {
		t.Fatalf("published rows kept for the Retention = %d, want 3", n)
	}
	s, err := env.JS.Stream(context.Background(), testenv.Stream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := s.GetMsg(context.Background(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if m.Header.Get(idem.HeaderKey) != "k-1" || m.Header.Get(idem.HeaderMsgID) != idem.MsgID(testenv.Subject, "k-1") {
		t.Fatalf("headers = %v", m.Header)
	}
	m, err = s.GetMsg(context.Background(), 3)
	if err != nil {
		t.Fatal(err)
	}
	if m.Subject != "test.receipts" || m.Header.Get("X-Trace") != "t1" || m.Header.Get(idem.HeaderMsgID) != idem.MsgID("test.receipts", "k-1") {
		t.Fatalf("third message %s headers = %v", m.Subject, m.Header)
	}
	if n, err := r.Drain(context.Background()); err != nil || n != 0 {
		t.Fatalf("second Drain = %d, %v; want nothing left", n, err)
	}
}

// LISTEN/NOTIFY wakes the relay: with polling effectively off, a committed row is
// still published promptly — in the default schema and in another one, whose
// channel is its own. The relay is of another Installation value than the outbox,
// as in another process, so nothing but the NOTIFY reaches it.
func TestRelayWakesOnNotify(t *testing.T) {
	t.Parallel()
	for _, schema := range []string{"", "idem_app"} {
		t.Run("schema="+schema, func(t *testing.T) {
			t.Parallel()
			env := testenv.NewWith(t, pgtest.Options{Schema: schema})
			ob := outbox.New(env.Inst)
			r := newRelay(t, env.Install(t, nil), relay.Config{PollInterval: time.Hour})
			testenv.Go(t, "relay", r.Run)
			table := "idem_outbox"
			if schema != "" {
				table = schema + ".idem_outbox"
			}

			// A NOTIFY sent before the relay's LISTEN is lost (the poll would catch
			// it, an hour later): wait until the listening connection is up.
			testenv.Eventually(t, 45*time.Second, "the relay to LISTEN", func() bool {
				return env.DB.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'`) == 1
			})
			for i := range 3 {
				enqueue(t, env.DB, ob, msg(fmt.Sprintf("k-notify-%d", i)))
				testenv.Eventually(t, 45*time.Second, "row published via NOTIFY", func() bool {
					return env.DB.Count(t, `SELECT count(*) FROM `+table+` WHERE published_at IS NULL`) == 0
				})
			}
			if got := env.StreamMsgs(t, testenv.Stream); got != 3 {
				t.Errorf("stream messages = %d, want 3", got)
			}
		})
	}
}

// waitListening waits until n relays LISTEN: a NOTIFY sent before is lost.
func waitListening(t *testing.T, env *testenv.Env, n int) {
	t.Helper()
	testenv.Eventually(t, 45*time.Second, "the relay to LISTEN", func() bool {
		return env.DB.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'`) == n
	})
}

// notifies counts the NOTIFYs on the outbox's channel of inst from now on: the
// returned func sends a marker NOTIFY and counts those that came before it
// (Postgres delivers notifications in commit order).
func notifies(t *testing.T, env *testenv.Env, inst *install.Installation) func() int {
	t.Helper()
	ctx := context.Background()
	pc, err := env.DB.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	conn := pc.Hijack()
	t.Cleanup(func() { conn.Close(context.Background()) })
	channel := parts.Of(inst).Store.Outbox.Channel
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	return func() int {
		t.Helper()
		if _, err := env.DB.Pool.Exec(ctx, `SELECT pg_notify($1, 'marker')`, channel); err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		n := 0
		for {
			note, err := conn.WaitForNotification(wctx)
			if err != nil {
				t.Fatalf("waiting for the marker NOTIFY: %v", err)
			}
			if note.Payload == "marker" {
				return n
			}
			n++
		}
	}
}

// Rows written with AddToBatch send no NOTIFY of their own: Wake after the commit
// reaches a relay of the same Installation directly, without a NOTIFY, and a relay
// elsewhere (here: one of another Installation value, as in another process) by
// one NOTIFY. With polling effectively off, both publish promptly.
func TestWakeReachesTheRelay(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		attached bool
		notifies int
	}{
		{"relay of the same installation", true, 0},
		{"relay elsewhere", false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := testenv.New(t)
			ob := outbox.New(env.Inst)
			inst := env.Inst
			if !tc.attached {
				inst = env.Install(t, nil)
			}
			testenv.Go(t, "relay", newRelay(t, inst, relay.Config{PollInterval: time.Hour}).Run)
			waitListening(t, env, 1)

			commitBatched(t, env.DB, ob, msg("k-wake"))
			count := notifies(t, env, env.Inst)
			if err := ob.Wake(context.Background()); err != nil {
				t.Fatal(err)
			}
			testenv.Eventually(t, 45*time.Second, "the row published after Wake", func() bool {
				return env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL`) == 0
			})
			if got := count(); got != tc.notifies {
				t.Errorf("Wake sent %d NOTIFYs, want %d", got, tc.notifies)
			}
		})
	}
}

// The relay dies between publish and mark: the row stays unpublished and a second
// relay publishes it again. The broker folds the repeat (same Msg-Id) and the
// consumer would fold it anyway: still one effect.
func TestRelayDiesBetweenPublishAndMark(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ob := outbox.New(env.Inst)
	enqueue(t, env.DB, ob, msg("k-relay"))
	out := startConsumer(t, env, "effects")

	dying := faults.With(context.Background(), faults.New().Func(faults.RelayAfterPublish, func(_ context.Context, keys []string) error {
		return fmt.Errorf("fault: relay died before marking %v", keys)
	}))
	r := newRelay(t, env.Inst, relay.Config{})
	if _, err := r.Drain(dying); err == nil {
		t.Fatal("the dying relay reported success")
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL AND attempts = 0`); n != 1 {
		t.Fatalf("unpublished, unmarked rows after the crash = %d, want 1", n)
	}
	testenv.Eventually(t, 45*time.Second, "first copy consumed", func() bool { return env.Effects(t, "k-relay") == 1 })

	if n, err := r.Drain(context.Background()); err != nil || n != 1 {
		t.Fatalf("second Drain = %d, %v; want 1", n, err)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL`); n != 1 {
		t.Fatalf("published rows = %d, want 1", n)
	}
	if got := env.StreamMsgs(t, testenv.Stream); got != 1 {
		t.Fatalf("stream messages = %d, want 1: the broker should fold the re-publish by Msg-Id", got)
	}
	drained := env.Drained(t, "effects")
	testenv.Eventually(t, 45*time.Second, "the consumer idle", drained)
	if n := env.Effects(t, "k-relay"); n != 1 {
		t.Fatalf("effects = %d, want 1", n)
	}
	if n := out.Get(idem.OutcomeProcessed); n != 1 {
		t.Errorf("processed = %d, want 1", n)
	}
}

// Republish gets a message past the broker's duplicate window — a new Msg-Id
// generation — while every consumer's inbox still folds it by key. A plain
// Enqueue of the same message again is folded by the broker already.
func TestRepublishPassesTheDuplicateWindowAndTheInboxFoldsIt(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ob := outbox.New(env.Inst)
	r := newRelay(t, env.Inst, relay.Config{})
	ctx := context.Background()
	drain := func(want int) {
		t.Helper()
		if n, err := r.Drain(ctx); err != nil || n != want {
			t.Fatalf("Drain = %d, %v; want %d", n, err, want)
		}
	}

	m := msg("k-again")
	enqueue(t, env.DB, ob, m)
	drain(1)
	enqueue(t, env.DB, ob, m) // the same intent enqueued again: same Msg-Id
	drain(1)
	if got := env.StreamMsgs(t, testenv.Stream); got != 1 {
		t.Fatalf("stream messages = %d, want 1: the broker folds a plain repeat", got)
	}
	for _, gen := range []string{"replay-1", "replay-2"} {
		if err := pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error { return ob.Republish(ctx, tx, gen, "", m) }); err != nil {
			t.Fatal(err)
		}
		drain(1)
	}
	if got := env.StreamMsgs(t, testenv.Stream); got != 3 {
		t.Fatalf("stream messages = %d, want 3: each republish gets past the duplicate window", got)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'k-again' AND msg_id = $1`, idem.MsgID(testenv.Subject, "k-again")+"\x1dreplay-1"); n != 1 {
		t.Errorf("republished row with the generation's Msg-Id = %d, want 1", n)
	}

	out := startConsumer(t, env, "effects")
	drained := env.Drained(t, "effects")
	testenv.Eventually(t, 45*time.Second, "the three copies settled", func() bool {
		return out.Get(idem.OutcomeProcessed)+out.Get(idem.OutcomeDuplicate) >= 3 && drained()
	})
	if n := env.Effects(t, "k-again"); n != 1 {
		t.Fatalf("effects = %d, want 1: the inbox folds republished copies", n)
	}
	if n := out.Get(idem.OutcomeProcessed); n != 1 {
		t.Errorf("processed = %d, want 1", n)
	}

	for _, gen := range []string{"", "two words"} {
		err := pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error { return ob.Republish(ctx, tx, gen, "", m) })
		if err == nil {
			t.Errorf("Republish with generation %q accepted", gen)
		}
	}
}

// The relay expects every publish to land in its installation's stream: a subject
// stored by another stream fails and stays pending with its error, instead of being
// acknowledged by the wrong stream.
func TestRelayStreamRefusesMisroute(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := context.Background()
	// An installation of the same tables on stream OTHER: its outbox writes a row
	// the test stream does not store.
	other := onStream(t, env, install.Stream{Name: "OTHER", Subjects: []string{"other.>"}})
	enqueue(t, env.DB, outbox.New(other), idem.Message{Key: "k-misrouted", Subject: "other.x", Payload: []byte("{}")})
	var failed atomic.Int64
	r := newRelay(t, env.Observed(t, func(e idem.Event) {
		if e.Outcome == idem.OutcomeFailed {
			failed.Add(int64(e.Count))
		}
	}), relay.Config{})
	if n, err := r.Drain(ctx); err != nil || n != 0 {
		t.Fatalf("Drain = %d, %v; want 0 published", n, err)
	}
	if n := failed.Load(); n != 1 {
		t.Errorf("failed events count %d rows, want 1", n)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL AND attempts = 1 AND last_error IS NOT NULL`); n != 1 {
		t.Fatalf("pending rows with the error recorded = %d, want 1", n)
	}
	if got := env.StreamMsgs(t, "OTHER"); got != 0 {
		t.Fatalf("the other stream took %d messages, want 0", got)
	}
	// The failed row steps aside for its backoff instead of being claimed again at
	// once; let the backoff pass.
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE next_attempt_at > now()`); n != 1 {
		t.Fatalf("rows stepping aside = %d, want 1", n)
	}
	if _, err := env.DB.Pool.Exec(ctx, `UPDATE idem_outbox SET next_attempt_at = now()`); err != nil {
		t.Fatal(err)
	}
	// The row itself is publishable: the relay of the installation on OTHER lands
	// it there.
	if n, err := newRelay(t, other, relay.Config{}).Drain(ctx); err != nil || n != 1 {
		t.Fatalf("Drain of the relay on OTHER = %d, %v; want 1", n, err)
	}
	if got := env.StreamMsgs(t, "OTHER"); got != 1 {
		t.Fatalf("the other stream holds %d messages, want 1", got)
	}
}

// Two relays drain one outbox concurrently: every row is published once, none is
// lost.
func TestTwoRelaysShareTheOutbox(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ob := outbox.New(env.Inst)
	var msgs []idem.Message
	for i := range 1000 {
		msgs = append(msgs, msg(fmt.Sprintf("k-%04d", i)))
	}
	enqueue(t, env.DB, ob, msgs...)
	r1 := newRelay(t, env.Inst, relay.Config{BatchSize: 50})
	r2 := newRelay(t, env.Inst, relay.Config{BatchSize: 50})
	type result struct {
		n   int
		err error
	}
	results := make(chan result, 2)
	for _, r := range []*relay.Relay{r1, r2} {
		go func() { n, err := r.Drain(context.Background()); results <- result{n, err} }()
	}
	total := 0
	for range 2 {
		select {
		case res := <-results:
			if res.err != nil {
				t.Fatal(res.err)
			}
			total += res.n
		case <-time.After(60 * time.Second):
			t.Fatal("a relay did not finish draining")
		}
	}
	if total != 1000 {
		t.Errorf("relays published %d rows in all, want 1000 (each row once)", total)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL`); n != 0 {
		t.Fatalf("%d rows left unpublished", n)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE attempts <> 1`); n != 0 {
		t.Errorf("%d rows published more than once", n)
	}
	if got := env.StreamMsgs(t, testenv.Stream); got != 1000 {
		t.Fatalf("stream messages = %d, want 1000", got)
	}
}
