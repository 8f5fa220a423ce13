package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/demo"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
)

func enqueue(t *testing.T, env *testenv.Env, msgs ...idem.Message) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error {
		return outbox.EnqueueBatch(ctx, tx, msgs)
	})
	if err != nil {
		t.Fatal(err)
	}
}

func charge(key string) idem.Message {
	return idem.Message{Key: key, Subject: idem.SubjectCharge, Payload: testenv.ChargePayload("acct_1", 100)}
}

func streamMsgs(t *testing.T, env *testenv.Env) uint64 {
	t.Helper()
	s, err := env.JS.Stream(context.Background(), idem.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

func TestEnqueueRejectsBadMessages(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	cases := map[string]idem.Message{
		"no key":           {Subject: idem.SubjectCharge, Payload: []byte("{}")},
		"subject outside":  {Key: "k", Subject: "orders.created", Payload: []byte("{}")},
		"wildcard subject": {Key: "k", Subject: "idem.>", Payload: []byte("{}")},
		"nil payload":      {Key: "k", Subject: idem.SubjectCharge},
	}
	for name, m := range cases {
		err := pgx.BeginFunc(context.Background(), env.DB.Pool, func(tx pgx.Tx) error {
			return outbox.Enqueue(context.Background(), tx, m)
		})
		if err == nil {
			t.Errorf("%s: Enqueue accepted %+v", name, m)
		}
	}
}

// A rolled-back producer transaction leaves no message: the outbox row lives and
// dies with the business rows.
func TestEnqueueRollsBackWithTheTransaction(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := context.Background()
	boom := errors.New("business failure")
	err := pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error {
		if err := outbox.Enqueue(ctx, tx, charge("k-rollback")); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatal(err)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox`); n != 0 {
		t.Fatalf("outbox rows after rollback = %d, want 0", n)
	}
}

// The relay publishes with Idempotency-Key and a Msg-Id derived from subject and key,
// and marks rows only after the PubAck.
func TestRelayPublishesAndMarks(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	enqueue(t, env, charge("k-1"), charge("k-2"), idem.Message{Key: "k-1", Subject: idem.SubjectEmail, Payload: []byte(`{}`)})
	r, err := outbox.NewRelay(env.DB.Pool, env.JS, outbox.RelayConfig{})
	if err != nil {
		t.Fatal(err)
	}
	n, err := r.Drain(context.Background())
	if err != nil || n != 3 {
		t.Fatalf("Drain = %d, %v; want 3", n, err)
	}
	if got := streamMsgs(t, env); got != 3 {
		t.Fatalf("stream holds %d messages, want 3 (one intent's charge and email must not fold)", got)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL AND expires_at > now()`); n != 3 {
		t.Fatalf("published rows = %d, want 3", n)
	}
	s, _ := env.JS.Stream(context.Background(), idem.StreamName)
	m, err := s.GetMsg(context.Background(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if m.Header.Get(idem.HeaderKey) != "k-1" || m.Header.Get(idem.HeaderMsgID) != idem.MsgID(idem.SubjectCharge, "k-1") {
		t.Fatalf("headers = %v", m.Header)
	}
}

// LISTEN/NOTIFY wakes the relay: with polling effectively off, a committed row is
// still published promptly.
func TestRelayWakesOnNotify(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	r, err := outbox.NewRelay(env.DB.Pool, env.JS, outbox.RelayConfig{PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, "Relay.Run", r.Run)

	// The first wake-up comes from Run's initial drain; keep enqueueing until the
	// listener is certainly up, then require the last row to be published.
	for i := range 3 {
		enqueue(t, env, charge(fmt.Sprintf("k-notify-%d", i)))
		testenv.Eventually(t, 45*time.Second, "row published via NOTIFY", func() bool {
			return env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL`) == 0
		})
	}
}

// The relay dies between publish and mark: the row stays unpublished and a second
// relay publishes it again. The broker folds the repeat (same Msg-Id) and the
// consumer would fold it anyway: still one ledger row.
func TestRelayDiesBetweenPublishAndMark(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	enqueue(t, env, charge("k-relay"))

	var processed atomic.Int64
	c, err := consumer.New(env.DB.Pool, env.JS, consumer.Config{
		Name: "charges", Subject: idem.SubjectCharge, BatchHandler: demo.ChargeHandler{},
		OnOutcome: func(_, o string, n int) {
			if o == consumer.OutcomeProcessed || o == consumer.OutcomeDuplicate {
				processed.Add(int64(n))
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, "consumer.Run", c.Run)

	dying, _ := outbox.NewRelay(env.DB.Pool, env.JS, outbox.RelayConfig{
		AfterPublish: func(context.Context, []int64) error { return errors.New("fault: relay died before marking") },
	})
	if _, err := dying.Drain(context.Background()); err == nil {
		t.Fatal("the dying relay reported success")
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL`); n != 1 {
		t.Fatalf("unpublished rows after the crash = %d, want 1", n)
	}
	testenv.Eventually(t, 45*time.Second, "first copy consumed", func() bool { return env.LedgerRows(t, "k-relay") == 1 })

	healthy, _ := outbox.NewRelay(env.DB.Pool, env.JS, outbox.RelayConfig{})
	if n, err := healthy.Drain(context.Background()); err != nil || n != 1 {
		t.Fatalf("second relay Drain = %d, %v; want 1", n, err)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL`); n != 1 {
		t.Fatalf("published rows = %d, want 1", n)
	}
	if got := streamMsgs(t, env); got != 1 {
		t.Fatalf("stream messages = %d, want 1: the broker should fold the re-publish by Msg-Id", got)
	}
	if n := env.LedgerRows(t, "k-relay"); n != 1 {
		t.Fatalf("ledger rows = %d, want 1", n)
	}
}

// Two relays drain one outbox concurrently: every row is published, none is lost.
func TestTwoRelaysShareTheOutbox(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	var msgs []idem.Message
	for i := range 1000 {
		msgs = append(msgs, charge(fmt.Sprintf("k-%04d", i)))
	}
	enqueue(t, env, msgs...)
	r1, _ := outbox.NewRelay(env.DB.Pool, env.JS, outbox.RelayConfig{BatchSize: 50})
	r2, _ := outbox.NewRelay(env.DB.Pool, env.JS, outbox.RelayConfig{BatchSize: 50})
	errs := make(chan error, 2)
	for _, r := range []*outbox.Relay{r1, r2} {
		go func() { _, err := r.Drain(context.Background()); errs <- err }()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL`); n != 0 {
		t.Fatalf("%d rows left unpublished", n)
	}
	if got := streamMsgs(t, env); got != 1000 {
		t.Fatalf("stream messages = %d, want 1000", got)
	}
}
