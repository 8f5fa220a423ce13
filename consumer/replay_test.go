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
	"github.com/idemkit/idem/outbox"
)

// A message dead-lettered because its handler kept failing is replayed once the
// handler is fixed: it runs once. Replaying it again is a duplicate, folded by key,
// although the relay publishes it (a new Msg-Id generation gets it past the
// broker's duplicate window).
func TestReplayDeadLetter(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	// The original goes the way production messages go, through the outbox and
	// the relay, so it carries the relay's headers (the replay must not copy them).
	// The relay reports to the test's installation, not the bundle's observed one,
	// so its outcomes are not counted as the consumer's.
	rl, err := relay.New(parts.Of(b.env.Inst), relay.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ob := outbox.New(b.env.Inst)
	if err := pgx.BeginFunc(ctx, b.env.DB.Pool, func(tx pgx.Tx) error {
		return ob.Enqueue(ctx, tx, idem.Message{Key: "k-replay", Subject: testenv.Subject, Payload: payload(42)})
	}); err != nil {
		t.Fatal(err)
	}
	if n, err := rl.Drain(ctx); err != nil || n != 1 {
		t.Fatalf("relay Drain = %d, %v; want 1", n, err)
	}

	var broken atomic.Bool
	broken.Store(true)
	cfg := b.config()
	cfg.BatchHandler = nil
	cfg.MaxDeliver = 2
	cfg.Handler = consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		if broken.Load() {
			return nil, errors.New("bug in handler")
		}
		return effectThen(ctx, tx, d, nil)
	})
	b.start(t, cfg)
	testenv.Eventually(t, 45*time.Second, "dead letter", func() bool { return b.out.Get(idem.OutcomeDeadLettered) == 1 })

	dls := deadletter.New(b.inst)
	list, err := dls.List(ctx, 10)
	if err != nil || len(list) != 1 {
		t.Fatalf("List = %v, %v", list, err)
	}
	dl := list[0]
	if dl.Key != "k-replay" || dl.Subject != testenv.Subject || dl.Deliveries != 2 || dl.ReplayedAt != nil || string(dl.Payload) != string(payload(42)) {
		t.Fatalf("dead letter = %+v", dl)
	}
	if got, err := dls.Get(ctx, dl.ID); err != nil || got.Key != dl.Key || got.Reason != dl.Reason {
		t.Fatalf("Get(%d) = %+v, %v; want the listed dead letter", dl.ID, got, err)
	}

	if dl.Headers[idem.HeaderEnqueuedAt] == "" {
		t.Fatalf("the dead letter lacks the relay's %s header: %v", idem.HeaderEnqueuedAt, dl.Headers)
	}
	// The delivered headers can hold the broker's own (a publish option's
	// Nats-Expected-Stream): instructions to the stream for that publish, which a
	// replay must not repeat.
	b.env.DB.Count(t, `WITH u AS (UPDATE idem_dead_letters SET headers = headers || '{"Nats-Expected-Stream": "IDEM"}'::jsonb RETURNING 1) SELECT count(*) FROM u`)
	broken.Store(false) // the handler is fixed
	if _, err := dls.ReplayID(ctx, dl.ID, deadletter.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'k-replay' AND published_at IS NULL AND headers ? 'Nats-Expected-Stream'`); n != 0 {
		t.Errorf("replay rows carrying the broker's Nats-Expected-Stream: %d, want 0", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'k-replay' AND published_at IS NULL`); n != 1 {
		t.Fatalf("outbox rows waiting after the replay = %d, want 1", n)
	}
	if n, err := rl.Drain(ctx); err != nil || n != 1 {
		t.Fatalf("relay Drain = %d, %v; want 1", n, err)
	}
	testenv.Eventually(t, 45*time.Second, "replay processed", func() bool { return b.out.Get(idem.OutcomeProcessed) == 1 })
	if n := b.env.Effects(t, "k-replay"); n != 1 {
		t.Fatalf("effects after replay = %d, want 1", n)
	}

	// A second replay of the same dead letter: the effect already happened.
	if _, err := dls.ReplayID(ctx, dl.ID, deadletter.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	if n, err := rl.Drain(ctx); err != nil || n != 1 {
		t.Fatalf("relay Drain = %d, %v; want 1", n, err)
	}
	drained := b.env.Drained(t, effectName)
	testenv.Eventually(t, 45*time.Second, "second replay settled", func() bool {
		return b.out.Get(idem.OutcomeDuplicate)+b.out.Get(idem.OutcomeProcessed) >= 2 && drained()
	})
	if n := b.env.Effects(t, "k-replay"); n != 1 {
		t.Fatalf("effects after a second replay = %d, want 1", n)
	}
	if n := b.out.Get(idem.OutcomeDuplicate); n < 1 {
		t.Errorf("duplicates = %d, want the second replay folded", n)
	}
	// Both replays reached the stream: the original and two generations.
	if n := b.env.StreamMsgs(t, testenv.Stream); n != 3 {
		t.Errorf("stream messages = %d, want 3 (each replay under its own Msg-Id)", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(DISTINCT msg_id) FROM idem_outbox WHERE key = 'k-replay' AND msg_id LIKE $1 || chr(29) || 'replay-%'`, idem.MsgID(testenv.Subject, "k-replay")); n != 2 {
		t.Errorf("distinct replay Msg-Ids = %d, want 2", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NOT NULL`); n != 1 {
		t.Fatalf("replayed_at not recorded")
	}
	if _, err := dls.ReplayID(ctx, 9999, deadletter.ReplayOptions{}); err == nil {
		t.Fatal("replaying a dead letter that does not exist succeeded")
	}
	if _, err := dls.Get(ctx, 9999); err == nil {
		t.Fatal("getting a dead letter that does not exist succeeded")
	}
}

// A dead letter without a valid key cannot be replayed: nothing is enqueued.
func TestReplayRefusesKeylessDeadLetter(t *testing.T) {
	b := setup(t)
	b.env.Publish(t, testenv.Subject, "", "no-key", payload(1))
	b.start(t, b.config())
	testenv.Eventually(t, 45*time.Second, "dead letter", func() bool { return b.out.Get(idem.OutcomeDeadLettered) == 1 })
	dls := deadletter.New(b.inst)
	list, err := dls.List(context.Background(), 10)
	if err != nil || len(list) != 1 {
		t.Fatalf("List = %v, %v", list, err)
	}
	if _, err := dls.ReplayID(context.Background(), list[0].ID, deadletter.ReplayOptions{}); !errors.Is(err, idem.ErrMissingKey) {
		t.Fatalf("Replay of a keyless dead letter: err = %v, want ErrMissingKey", err)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox`); n != 0 {
		t.Errorf("outbox rows = %d, want 0", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NOT NULL`); n != 0 {
		t.Errorf("a refused replay was recorded as replayed")
	}
}
