package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/deadletter"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// effectAs is testenv.Effect recording its rows under name/key, so the effects of
// two consumers of one subject can be told apart.
type effectAs string

func (name effectAs) HandleBatch(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
	for _, d := range ds {
		if _, err := tx.Exec(ctx, `INSERT INTO public.test_effects (key, payload) VALUES ($1, $2)`, string(name)+"/"+d.Key, d.Payload); err != nil {
			return nil, err
		}
	}
	return make([][]byte, len(ds)), nil
}

// A replay reaches only the consumer that dead-lettered the message. Two consumers
// read one subject; "billing" dead-letters a message that "audit" processed. Days
// later audit's inbox row has expired (deleted here) and billing's handler is
// fixed: the replay runs billing's effect once, and audit, which no longer
// remembers the key, skips it instead of running its effect a second time.
func TestReplayReachesOnlyTheDeadLetteringConsumer(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := context.Background()
	var broken atomic.Bool
	broken.Store(true)

	billingOut, auditOut := &testenv.Outcomes{}, &testenv.Outcomes{}
	billing := testenv.ConsumerConfig("billing")
	billing.BatchHandler = nil
	billing.Handler = consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		if broken.Load() {
			return nil, consumer.Permanent(errors.New("bug in billing"))
		}
		if _, err := effectAs("billing").HandleBatch(ctx, tx, []*consumer.Delivery{d}); err != nil {
			return nil, err
		}
		return nil, nil
	})
	audit := testenv.ConsumerConfig("audit")
	audit.BatchHandler = effectAs("audit")
	for _, run := range []struct {
		cfg consumer.Config
		out *testenv.Outcomes
	}{{billing, billingOut}, {audit, auditOut}} {
		c, err := consumer.New(env.Observed(t, run.out.Observe), run.cfg)
		if err != nil {
			t.Fatal(err)
		}
		testenv.Go(t, "consumer "+run.cfg.Name, c.Run)
	}
	rl, err := relay.New(parts.Of(env.Inst), relay.Config{})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, "relay", rl.Run)

	env.Publish(t, testenv.Subject, "k-shared", "k-shared", payload(7))
	billingDrained, auditDrained := env.Drained(t, "billing"), env.Drained(t, "audit")
	testenv.Eventually(t, 45*time.Second, "billing dead-lettered and audit processed", func() bool {
		return billingOut.Get(idem.OutcomeDeadLettered) == 1 && auditOut.Get(idem.OutcomeProcessed) == 1 && billingDrained() && auditDrained()
	})
	effects := func(name string) int { return env.Effects(t, name+"/k-shared") }
	if effects("audit") != 1 || effects("billing") != 0 {
		t.Fatalf("effects before the replay: audit %d, billing %d; want 1 and 0", effects("audit"), effects("billing"))
	}
	// Audit's inbox forgets the key, as it does once KeyLifetime has passed.
	if _, err := env.DB.Pool.Exec(ctx, `DELETE FROM idem_inbox WHERE consumer = 'audit'`); err != nil {
		t.Fatal(err)
	}

	dls := deadletter.New(env.Inst)
	list, err := dls.List(ctx, 10)
	if err != nil || len(list) != 1 || list[0].Consumer != "billing" {
		t.Fatalf("List = %+v, %v; want billing's one dead letter", list, err)
	}
	broken.Store(false)
	if _, err := dls.ReplayID(ctx, list[0].ID, deadletter.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'k-shared' AND headers->>$1 = 'billing'`, idem.HeaderReplayFor); n != 1 {
		t.Errorf("replayed outbox rows naming billing in %s = %d, want 1", idem.HeaderReplayFor, n)
	}
	testenv.Eventually(t, 45*time.Second, "the replay settled at both consumers", func() bool {
		return billingOut.Get(idem.OutcomeProcessed) == 1 &&
			auditOut.Get(idem.OutcomeProcessed)+auditOut.Get(idem.OutcomeSkipped) >= 2 &&
			billingDrained() && auditDrained()
	})
	if n := effects("billing"); n != 1 {
		t.Errorf("billing effects after the replay = %d, want 1", n)
	}
	if n := effects("audit"); n != 1 {
		t.Errorf("audit effects after the replay = %d, want still 1: the replay was not meant for audit", n)
	}
	if n := auditOut.Get(idem.OutcomeSkipped); n != 1 {
		t.Errorf("audit skipped %d messages, want the replay", n)
	}
	if n := billingOut.Get(idem.OutcomeSkipped); n != 0 {
		t.Errorf("billing skipped %d messages, want 0", n)
	}
}

// A dead letter records when its consumer's inbox may forget the key: now plus the
// consumer's KeyLifetime, or sooner when the inbox already holds the key (a
// fingerprint mismatch: the first payload's row expires first). A replay after that
// horizon, or of a dead letter filed before the horizon was recorded, is refused
// unless forced: it could run an effect the inbox no longer remembers.
func TestReplayRefusesPastTheInboxHorizon(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	cfg := b.config()
	cfg.BatchHandler = decodingEffect{}
	cfg.KeyLifetime = time.Hour
	b.start(t, cfg)

	b.env.Publish(t, testenv.Subject, "k-poison", "k-poison", []byte(`{"n":-1}`))
	// The mismatch case: k-first is done, and its inbox row expires in 10 minutes.
	b.env.Publish(t, testenv.Subject, "k-first", "k-first-1", payload(1))
	testenv.Eventually(t, 45*time.Second, "poison dead-lettered, k-first processed", func() bool {
		return b.out.Get(idem.OutcomeDeadLettered) == 1 && b.out.Get(idem.OutcomeProcessed) == 1
	})
	var firstExpires time.Time
	if err := b.env.DB.Pool.QueryRow(ctx, `UPDATE idem_inbox SET expires_at = now() + interval '10 minutes' WHERE key = 'k-first' RETURNING expires_at`).Scan(&firstExpires); err != nil {
		t.Fatal(err)
	}
	b.env.Publish(t, testenv.Subject, "k-first", "k-first-2", payload(2))
	testenv.Eventually(t, 45*time.Second, "mismatch dead-lettered", func() bool { return b.out.Get(idem.OutcomeDeadLettered) == 2 })

	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'k-poison' AND inbox_expires_at = created_at + interval '1 hour'`); n != 1 {
		t.Fatalf("k-poison: %d dead letters with inbox_expires_at = created_at + KeyLifetime, want 1", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'k-first' AND inbox_expires_at = $1`, firstExpires); n != 1 {
		t.Fatalf("k-first: %d dead letters whose horizon is the inbox row's expiry, want 1", n)
	}

	dls := deadletter.New(b.inst)
	var id int64
	if err := b.env.DB.Pool.QueryRow(ctx, `SELECT id FROM idem_dead_letters WHERE key = 'k-poison'`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	outboxRows := func() int { return b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'k-poison'`) }
	refused := func(what string) {
		t.Helper()
		_, err := dls.ReplayID(ctx, id, deadletter.ReplayOptions{})
		if !errors.Is(err, deadletter.ErrReplayRefused) {
			t.Fatalf("%s: Replay err = %v, want ErrReplayRefused", what, err)
		}
		t.Logf("%s: %v", what, err)
	}
	setHorizon := func(sql string) {
		t.Helper()
		if _, err := b.env.DB.Pool.Exec(ctx, `UPDATE idem_dead_letters SET inbox_expires_at = `+sql+` WHERE id = $1`, id); err != nil {
			t.Fatal(err)
		}
	}

	setHorizon(`now() - interval '1 second'`)
	refused("past the horizon")
	// The replay would stay in the stream (MaxAge 24h) past the horizon: a
	// consumer lagging that long would read it after forgetting the key.
	setHorizon(`now() + interval '12 hours'`)
	refused("the horizon nearer than the stream's MaxAge")
	setHorizon(`NULL`)
	refused("horizon unknown (filed before schema v3)")
	if n := outboxRows(); n != 0 {
		t.Fatalf("outbox rows after refused replays = %d, want 0", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NOT NULL`); n != 0 {
		t.Fatalf("a refused replay was recorded as replayed")
	}
	if _, err := dls.ReplayID(ctx, id, deadletter.ReplayOptions{DryRun: true, Force: true}); err != nil {
		t.Fatalf("forced dry run: %v", err)
	}
	if n := outboxRows(); n != 0 {
		t.Fatalf("a dry run wrote %d outbox rows", n)
	}
	if _, err := dls.ReplayID(ctx, id, deadletter.ReplayOptions{Force: true}); err != nil {
		t.Fatalf("forced replay: %v", err)
	}
	if n := outboxRows(); n != 1 {
		t.Fatalf("outbox rows after a forced replay = %d, want 1", n)
	}
	setHorizon(`now() + interval '2 days'`)
	if _, err := dls.ReplayID(ctx, id, deadletter.ReplayOptions{}); err != nil {
		t.Fatalf("replay inside the horizon: %v", err)
	}
	if n := outboxRows(); n != 2 {
		t.Fatalf("outbox rows after a replay inside the horizon = %d, want 2", n)
	}
}
