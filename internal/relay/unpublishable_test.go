package relay_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/deadletter"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/ops"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/registry"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// smallBroker is a real JetStream server whose max_payload is small, so tests can
// make messages it refuses without megabytes of data, and an installation on it
// with the test stream.
type smallBroker struct {
	db   *pgtest.DB
	srv  *natstest.Server
	nc   *nats.Conn
	inst *install.Installation
}

const smallMaxPayload = 4096

func newSmallBroker(t *testing.T) *smallBroker {
	t.Helper()
	srv := natstest.StartWith(t, natstest.Options{MaxPayload: smallMaxPayload})
	nc, err := nats.Connect(srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	db := pgtest.New(t)
	inst, err := install.New(db.Pool, nc, install.Config{Stream: install.Stream{Name: testenv.Stream, Subjects: []string{testenv.Subjects}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := inst.EnsureStream(context.Background()); err != nil {
		t.Fatal(err)
	}
	return &smallBroker{db: db, srv: srv, nc: nc, inst: inst}
}

// relay is a relay of the broker's installation, obs (when not nil) told its
// events.
func (b *smallBroker) relay(t *testing.T, cfg relay.Config, obs idem.Observer) *relay.Relay {
	t.Helper()
	return newRelay(t, b.inst.Observing(obs), cfg)
}

// otherStream creates stream OTHER on "other.>" beside the test stream.
func (b *smallBroker) otherStream(t *testing.T) {
	t.Helper()
	if _, err := b.inst.JetStream().CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "OTHER", Subjects: []string{"other.>"}, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
}

// insertRaw writes outbox rows the way an older version (or another writer) could
// have, bypassing Enqueue's checks: the relay must cope with whatever is there.
func (b *smallBroker) insertRaw(t *testing.T, n int, prefix, subject string, payloadBytes int) {
	t.Helper()
	_, err := b.db.Pool.Exec(context.Background(), `
INSERT INTO idem_outbox (key, subject, msg_id, payload)
SELECT $1 || g, $2, $2 || ' ' || $1 || g, convert_to(repeat('x', $3), 'UTF8') FROM generate_series(1, $4) g`,
		prefix, subject, payloadBytes, n)
	if err != nil {
		t.Fatal(err)
	}
}

// C1 at the door: Enqueue refuses what the broker could never take, counting the
// payload and the headers exactly as NATS does, before anything is written.
func TestEnqueueRefusesWhatTheBrokerCannotTake(t *testing.T) {
	t.Parallel()
	b := newSmallBroker(t)
	ob := outbox.New(b.inst) // bounded by the broker's max_payload
	// The header block for this key and subject: "NATS/1.0\r\n" + the lines the
	// relay adds (the enqueue time is fixed-width) + "\r\n".
	key, subject := "k-size", "test.size"
	header := len("NATS/1.0\r\n") + len("Idempotency-Key: "+key+"\r\n") + len("Nats-Msg-Id: "+idem.MsgID(subject, key)+"\r\n") +
		len("Nats-Expected-Stream: "+testenv.Stream+"\r\n") + len("Idem-Enqueued-At: 2026-12-01T12:00:00.000000Z\r\n") + len("\r\n")
	fits := smallMaxPayload - header
	ctx := context.Background()
	try := func(k string, size int) error {
		return pgx.BeginFunc(ctx, b.db.Pool, func(tx pgx.Tx) error {
			return ob.Enqueue(ctx, tx, idem.Message{Key: k, Subject: subject, Payload: []byte(strings.Repeat("x", size))})
		})
	}
	if err := try(key, fits+1); !errors.Is(err, outbox.ErrTooLarge) {
		t.Fatalf("one byte over max_payload: %v, want ErrTooLarge", err)
	}
	if n := b.db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 0 {
		t.Fatalf("%d rows written for a refused message", n)
	}
	if err := try(key, fits); err != nil {
		t.Fatalf("exactly max_payload: %v", err)
	}
	// And the broker agrees: the message that fits is published.
	if n, err := b.relay(t, relay.Config{}, nil).Drain(ctx); err != nil || n != 1 {
		var last string
		_ = b.db.Pool.QueryRow(ctx, `SELECT COALESCE(last_error, '') FROM idem_outbox`).Scan(&last)
		t.Fatalf("Drain = %d, %v; want the message that fits published (last error %q)", n, err, last)
	}
}

// C1 at the relay: a row the broker refuses (written before the check existed, or
// by another writer) is dead-lettered at once with the broker's reason, and the
// row behind it is published in the same Drain.
func TestRelayDeadLettersARowTheBrokerRefuses(t *testing.T) {
	t.Parallel()
	b := newSmallBroker(t)
	b.insertRaw(t, 1, "big-", "test.big", 2*smallMaxPayload)
	b.insertRaw(t, 1, "ok-", "test.ok", 10)
	var dead atomic.Int64
	r := b.relay(t, relay.Config{}, func(e idem.Event) {
		if e.Outcome == idem.OutcomeDeadLettered {
			dead.Add(int64(e.Count))
		}
	})
	if n, err := r.Drain(context.Background()); err != nil || n != 1 {
		t.Fatalf("Drain = %d, %v; want the good row published", n, err)
	}
	if got := dead.Load(); got != 1 {
		t.Errorf("dead-lettered events count %d, want 1", got)
	}
	var reason, consumer string
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT consumer, reason FROM idem_dead_letters WHERE key = 'big-1'`).Scan(&consumer, &reason); err != nil {
		t.Fatalf("no dead letter for the refused row: %v", err)
	}
	if consumer != outbox.RelayConsumer || !strings.Contains(reason, "maximum payload") {
		t.Errorf("dead letter = %q %q, want the relay's with the broker's reason", consumer, reason)
	}
	if n := b.db.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'big-1' AND dead_lettered_at IS NOT NULL AND published_at IS NULL`); n != 1 {
		t.Errorf("the refused row is not marked dead-lettered")
	}
	// It is not pending any more: the backlog says nothing waits.
	if bl, err := ops.ReadBacklog(context.Background(), b.db.Pool, parts.Of(b.inst).Store); err != nil || bl.Pending != 0 {
		t.Errorf("backlog = %+v, %v; want nothing pending", bl, err)
	}
}

// 500 rows that can never be published (one full relay
// batch) ahead of a good one. The good row is published by the first Drain: the
// bad rows do not hold it up, whether the broker refuses them for good (too large)
// or fails them one by one (a subject stored by another stream).
func TestRelayBadRowsDoNotDelayAGoodOne(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		insert func(b *smallBroker)
		setup  func(t *testing.T, b *smallBroker)
	}{
		{"too large", func(b *smallBroker) { b.insertRaw(t, 500, "big-", "test.big", 2*smallMaxPayload) }, nil},
		{"misrouted", func(b *smallBroker) { b.insertRaw(t, 500, "mis-", "other.x", 10) }, func(t *testing.T, b *smallBroker) { b.otherStream(t) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := newSmallBroker(t)
			if tc.setup != nil {
				tc.setup(t, b)
			}
			tc.insert(b)
			b.insertRaw(t, 1, "good-", "test.good", 10)
			r := b.relay(t, relay.Config{BatchSize: 500}, nil)
			start := time.Now()
			n, err := r.Drain(context.Background())
			if err != nil || n != 1 {
				t.Fatalf("Drain = %d, %v; want the good row published behind 500 bad ones", n, err)
			}
			if n := b.db.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'good-1' AND published_at IS NOT NULL`); n != 1 {
				t.Fatal("the good row is not published")
			}
			t.Logf("good row published after %s", time.Since(start).Round(time.Millisecond))
		})
	}
}

// A row that keeps failing while the broker is up is charged one attempt per
// publish and dead-lettered after MaxAttempts, with the last reason.
func TestRelayDeadLettersAfterMaxAttempts(t *testing.T) {
	t.Parallel()
	b := newSmallBroker(t)
	b.otherStream(t)
	b.insertRaw(t, 1, "mis-", "other.x", 10)
	r := b.relay(t, relay.Config{MaxAttempts: 3, Backoff: func(int) time.Duration { return 0 }}, nil)
	for i := range 3 {
		if _, err := r.Drain(context.Background()); err != nil {
			t.Fatalf("Drain %d: %v", i, err)
		}
	}
	var reason string
	var deliveries int
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT reason, deliveries FROM idem_dead_letters WHERE key = 'mis-1'`).Scan(&reason, &deliveries); err != nil {
		t.Fatalf("no dead letter after MaxAttempts: %v", err)
	}
	if deliveries != 3 || !strings.Contains(reason, "failed 3 publishes") || !strings.Contains(reason, "expected stream does not match") {
		t.Errorf("dead letter: %d attempts, %q", deliveries, reason)
	}
}

// While the broker is down nothing is charged: the rows keep their attempts and
// wait, and Drain says why. The same rows are published once it is back.
func TestRelayChargesNothingWhileTheBrokerIsDown(t *testing.T) {
	t.Parallel()
	b := newSmallBroker(t)
	b.insertRaw(t, 3, "k-", "test.x", 10)
	r := b.relay(t, relay.Config{PublishTimeout: 300 * time.Millisecond, MaxAttempts: 1}, nil)
	b.srv.Stop()
	if _, err := r.Drain(context.Background()); !errors.Is(err, relay.ErrBrokerDown) {
		t.Fatalf("Drain with the broker down = %v, want ErrBrokerDown", err)
	}
	if n := b.db.Count(t, `SELECT count(*) FROM idem_outbox WHERE attempts = 0 AND published_at IS NULL AND dead_lettered_at IS NULL`); n != 3 {
		t.Fatalf("rows untouched = %d, want 3 (MaxAttempts is 1: one charge would dead-letter them)", n)
	}
	b.srv.Restart(t) // same port, same store
	testenv.Eventually(t, 30*time.Second, "the rows published once the broker is back", func() bool {
		_, err := r.Drain(context.Background())
		return err == nil && b.db.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL`) == 3
	})
}

// Every publish has its own deadline. A subject that a core subscriber takes
// but no stream stores never gets a PubAck; both rows fail within PublishTimeout
// (one timer for the whole batch would fire once and leave the second wait hanging).
func TestRelayPublishHasADeadline(t *testing.T) {
	t.Parallel()
	b := newSmallBroker(t)
	sub, err := b.nc.SubscribeSync("hang.>") // answers nothing
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe() //nolint:errcheck
	b.insertRaw(t, 2, "hang-", "hang.x", 10)
	r := b.relay(t, relay.Config{PublishTimeout: 100 * time.Millisecond}, nil)
	done := make(chan error, 1)
	go func() { _, err := r.Drain(context.Background()); done <- err }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Drain: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Drain did not return: a PubAck wait is unbounded")
	}
	if n := b.db.Count(t, `SELECT count(*) FROM idem_outbox WHERE attempts = 1 AND last_error LIKE '%no PubAck within PublishTimeout%'`); n != 2 {
		t.Fatalf("rows failed with the deadline = %d, want 2", n)
	}
}

// A batch holds at most MaxBatchBytes of payload in memory (a single bigger
// row is still taken alone).
func TestRelayBatchIsBoundedByBytes(t *testing.T) {
	t.Parallel()
	b := newSmallBroker(t)
	b.insertRaw(t, 10, "k-", "test.x", 1000)
	var batches, biggest atomic.Int64
	r := b.relay(t, relay.Config{MaxBatchBytes: 3500}, func(e idem.Event) {
		if e.Outcome == idem.OutcomePublished {
			batches.Add(1)
			if int64(e.Count) > biggest.Load() {
				biggest.Store(int64(e.Count))
			}
		}
	})
	if n, err := r.Drain(context.Background()); err != nil || n != 10 {
		t.Fatalf("Drain = %d, %v", n, err)
	}
	if biggest.Load() > 3 || batches.Load() < 4 {
		t.Fatalf("batches = %d, the biggest with %d rows; want at most 3 rows of ~1 kB per 3.5 kB batch", batches.Load(), biggest.Load())
	}
}

// A publish that failed because the connection dropped is the broker's fault even
// when the broker is back by the time the relay asks it: nothing is charged.
func TestRelayChargesNothingForAConnectionThatDropped(t *testing.T) {
	t.Parallel()
	b := newSmallBroker(t)
	b.insertRaw(t, 3, "k-", "test.x", 10)
	r := b.relay(t, relay.Config{PublishTimeout: 2 * time.Second, MaxAttempts: 1}, nil)
	b.srv.Stop()
	testenv.Eventually(t, 10*time.Second, "the client to notice", func() bool { return b.nc.Status() != nats.CONNECTED })
	// After the publishes failed and before the relay judges them, the broker
	// comes back and the client reconnects.
	back := faults.New().Func(faults.RelayAfterPublish, func(context.Context, []string) error {
		b.srv.Restart(t)
		testenv.Eventually(t, 10*time.Second, "the client to reconnect", func() bool { return b.nc.Status() == nats.CONNECTED })
		return nil
	})
	_, err := r.Drain(faults.With(context.Background(), back))
	if n := b.db.Count(t, `SELECT count(*) FROM idem_outbox WHERE attempts = 0 AND dead_lettered_at IS NULL`); n != 3 {
		var lastErr *string
		_ = b.db.Pool.QueryRow(context.Background(), `SELECT max(last_error) FROM idem_outbox`).Scan(&lastErr)
		t.Fatalf("rows uncharged = %d, want 3 (MaxAttempts is 1: one charge dead-letters a row); Drain: %v; last error: %v", n, err, deref(lastErr))
	}
}

func deref(s *string) string {
	if s == nil {
		return "<nil>"
	}
	return *s
}

// A row dead-lettered after its publishes went unanswered may have been stored
// after all, and read: its dead letter carries the replay horizon of the
// registered consumers that read its subject (the shortest key lifetime), so a
// replay past it needs --force. A row the broker refused was never stored, and
// has none.
func TestRelayDeadLetterCarriesTheReadersHorizon(t *testing.T) {
	t.Parallel()
	b := newSmallBroker(t)
	ctx := context.Background()
	for name, c := range map[string]registry.Consumer{
		"long":  {Name: "long", Stream: testenv.Stream, FilterSubject: "hang.x", KeyLifetime: 5 * time.Hour},
		"short": {Name: "short", Stream: testenv.Stream, FilterSubject: "hang.>", KeyLifetime: 2 * time.Hour},
		"other": {Name: "other", Stream: testenv.Stream, FilterSubject: "test.>", KeyLifetime: time.Hour},
	} {
		if _, err := registry.Register(ctx, b.db.Pool, "", c, false); err != nil {
			t.Fatalf("register %s: %v", name, err)
		}
	}
	sub, err := b.nc.SubscribeSync("hang.>") // takes the publishes, answers nothing
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe() //nolint:errcheck
	b.insertRaw(t, 1, "hang-", "hang.x", 10)
	b.otherStream(t)
	b.insertRaw(t, 1, "mis-", "other.x", 10)
	r := b.relay(t, relay.Config{MaxAttempts: 1, PublishTimeout: 100 * time.Millisecond}, nil)
	if _, err := r.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if n := b.db.Count(t, `SELECT count(*) FROM idem_dead_letters d JOIN idem_outbox o ON o.key = d.key
		WHERE d.key = 'hang-1' AND d.consumer = '(relay)' AND d.inbox_expires_at = o.created_at + interval '2 hours'`); n != 1 {
		t.Errorf("the unanswered row's dead letter does not carry the shortest reader's horizon")
	}
	if n := b.db.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'mis-1' AND consumer = '(relay)' AND inbox_expires_at IS NULL`); n != 1 {
		t.Errorf("the refused row's dead letter has a horizon; it was never stored")
	}

	dls := deadletter.New(b.inst)
	b.db.Count(t, `WITH u AS (UPDATE idem_dead_letters SET inbox_expires_at = now() - interval '1 second' WHERE key = 'hang-1' RETURNING 1) SELECT count(*) FROM u`)
	rep, err := dls.Replay(ctx, deadletter.Filter{Consumer: outbox.RelayConsumer}, deadletter.ReplayOptions{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, res := range rep.Results {
		want := deadletter.ActionWouldReplay
		if res.Key == "hang-1" {
			want = deadletter.ActionRefused
		}
		if res.Action != want {
			t.Errorf("replay of %s: %s (%s), want %s", res.Key, res.Action, res.Reason, want)
		}
	}
}
