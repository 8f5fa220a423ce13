package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// newLogRelay is a log relay of env's outbox, running until the test ends.
func newLogRelay(t *testing.T, env *testenv.Env, cfg relay.Config) *relay.LogRelay {
	t.Helper()
	env.RequireLogRelay(t)
	l, err := relay.NewLog(parts.Of(env.Inst), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// startLog runs l until the test ends and waits until it reads its slot, so
// that the outbox's new rows are its own.
func startLog(t *testing.T, env *testenv.Env, l *relay.LogRelay) (stop func()) {
	t.Helper()
	stop = testenv.Go(t, "log relay", l.Run)
	testenv.Eventually(t, 20*time.Second, "the log relay reads its slot", l.Reading)
	return stop
}

// The log relay publishes what the slot streams, with the polling relay's
// headers, writes down where each row landed once per window, and never updates
// an outbox row.
func TestLogRelayPublishesWithoutRewritingTheOutbox(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	l := newLogRelay(t, env, relay.Config{})
	startLog(t, env, l)
	ob := outbox.New(env.Inst)
	other := idem.Message{Key: "k-1", Subject: "test.receipts", Payload: []byte(`{"r":1}`), Headers: map[string]string{"X-Trace": "t1"}, Name: "receipt"}
	// Each transaction records its xid, to tell the rows' versions by.
	if _, err := env.DB.Pool.Exec(context.Background(), `CREATE TABLE enqueued (xid bigint)`); err != nil {
		t.Fatal(err)
	}
	enqueueRecorded(t, env, ob, msg("k-1"), msg("k-2"), other)
	enqueueRecorded(t, env, ob, msg("k-3"))

	testenv.Eventually(t, 20*time.Second, "4 messages in the stream", func() bool { return env.StreamMsgs(t, testenv.Stream) == 4 })
	testenv.Eventually(t, 20*time.Second, "4 rows in windows", func() bool {
		return env.DB.Count(t, `SELECT COALESCE(sum(cardinality(ids)), 0) FROM idem_outbox_published`) == 4
	})
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE relay = 'log' AND published_at IS NULL AND attempts = 0`); n != 4 {
		t.Errorf("log rows as written = %d, want 4", n)
	}
	// Each row's sequence is where the stream holds its message.
	s, err := env.JS.Stream(context.Background(), testenv.Stream)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := env.DB.Pool.Query(context.Background(), `
		SELECT o.msg_id, s.seq FROM idem_outbox_published w, unnest(w.ids, w.seqs) AS s(id, seq) JOIN idem_outbox o ON o.id = s.id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var msgID string
		var seq uint64
		if err := rows.Scan(&msgID, &seq); err != nil {
			t.Fatal(err)
		}
		m, err := s.GetMsg(context.Background(), seq)
		if err != nil {
			t.Fatalf("get %d: %v", seq, err)
		}
		if got := m.Header.Get(idem.HeaderMsgID); got != msgID {
			t.Errorf("seq %d holds Msg-Id %q, the window says %q", seq, got, msgID)
		}
		if m.Header.Get(idem.HeaderKey) == "" || m.Header.Get(idem.HeaderEnqueuedAt) == "" {
			t.Errorf("seq %d lacks the relay's headers: %v", seq, m.Header)
		}
		if m.Subject == "test.receipts" && (m.Header.Get("X-Trace") != "t1" || m.Header.Get(idem.HeaderMessage) != "receipt") {
			t.Errorf("the receipt's headers were not carried: %v", m.Header)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	// Nothing the log relay published was rewritten, or even locked: every row is
	// the version its transaction wrote.
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE xmax::text <> '0' OR xmin::text::bigint NOT IN (SELECT xid FROM enqueued)`); n != 0 {
		t.Errorf("outbox rows rewritten or locked since they were written: %d, want 0", n)
	}
}

// enqueueRecorded enqueues msgs in one transaction and records its xid in the
// table enqueued.
func enqueueRecorded(t *testing.T, env *testenv.Env, ob *outbox.Outbox, msgs ...idem.Message) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error {
		if err := ob.Enqueue(ctx, tx, msgs...); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO enqueued SELECT pg_current_xact_id()::text::bigint % 4294967296`)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// walPosition is the server's WAL insert position now: every transaction
// committed before it ends before it.
func walPosition(t *testing.T, env *testenv.Env) string {
	t.Helper()
	var lsn string
	if err := env.DB.Pool.QueryRow(context.Background(), `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	return lsn
}

// confirmedPast reports whether the slot's confirmed position is at or past lsn.
func confirmedPast(t *testing.T, env *testenv.Env, lsn string) bool {
	t.Helper()
	return env.DB.Count(t, `SELECT count(*) FROM pg_replication_slots WHERE database = current_database() AND confirmed_flush_lsn >= $1::pg_lsn`, lsn) == 1
}

// While the broker does not answer, the log relay confirms nothing past the rows
// it could not publish, charges them nothing and hands nothing over; they are
// published once it is back. The negative control (relay.confirm-on-read)
// confirms them as they are read, before any PubAck: the slot moves past rows
// the stream never stored.
func TestLogRelayConfirmsOnlyAfterThePubAck(t *testing.T) {
	t.Parallel()
	for _, control := range []bool{false, true} {
		t.Run(map[bool]string{false: "as shipped", true: "confirm on read"}[control], func(t *testing.T) {
			t.Parallel()
			env := testenv.New(t)
			failed := make(chan struct{}, 100)
			inst := env.Observed(t, func(e idem.Event) {
				if e.Component == idem.ComponentRelay && e.Outcome == idem.OutcomeFailed {
					failed <- struct{}{}
				}
			})
			env.RequireLogRelay(t)
			l, err := relay.NewLog(parts.Of(inst), relay.Config{PublishTimeout: 500 * time.Millisecond, PollInterval: 100 * time.Millisecond}, nil)
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			if control {
				ctx = faults.With(ctx, faults.New().Switch(faults.ConfirmOnRead))
			}
			testenv.GoCtx(t, ctx, "log relay", l.Run)
			testenv.Eventually(t, 20*time.Second, "the log relay reads its slot", l.Reading)
			ob := outbox.New(env.Inst)
			enqueue(t, env.DB, ob, msg("k-1"))
			testenv.Eventually(t, 20*time.Second, "k-1 published", func() bool { return env.StreamMsgs(t, testenv.Stream) == 1 })

			env.NATS.Stop()
			enqueue(t, env.DB, ob, msg("k-2"), msg("k-3"))
			after := walPosition(t, env)
			select {
			case <-failed:
			case <-time.After(30 * time.Second):
				t.Fatal("the log relay never tried to publish k-2 and k-3")
			}
			if control {
				testenv.Eventually(t, 10*time.Second, "the control confirms past rows the broker never stored", func() bool { return confirmedPast(t, env, after) })
				return
			}
			if confirmedPast(t, env, after) {
				t.Fatal("the slot was confirmed past rows whose publish failed")
			}
			if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE attempts > 0 OR relay IS NULL`); n != 0 {
				t.Errorf("rows charged or handed over while the broker was down: %d, want 0", n)
			}
			env.NATS.Resume(t)
			testenv.Eventually(t, 30*time.Second, "k-2 and k-3 published once the broker is back", func() bool { return env.StreamMsgs(t, testenv.Stream) == 3 })
			testenv.Eventually(t, 10*time.Second, "the slot moves past them", func() bool { return confirmedPast(t, env, after) })
		})
	}
}

// One log relay reads the slot; another stands by and takes over when the first
// stops: every row is published, none lost across the change.
func TestLogRelayFailover(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	first := newLogRelay(t, env, relay.Config{PollInterval: 100 * time.Millisecond})
	stopFirst := startLog(t, env, first)
	second := newLogRelay(t, env, relay.Config{PollInterval: 100 * time.Millisecond})
	testenv.Go(t, "second log relay", second.Run)
	ob := outbox.New(env.Inst)
	for i := range 10 {
		enqueue(t, env.DB, ob, msg(fmt.Sprintf("a-%d", i)))
	}
	testenv.Eventually(t, 20*time.Second, "10 published by the first", func() bool { return env.StreamMsgs(t, testenv.Stream) == 10 })
	if second.Reading() {
		t.Fatal("two log relays read one slot")
	}
	stopFirst()
	for i := range 10 {
		enqueue(t, env.DB, ob, msg(fmt.Sprintf("b-%d", i)))
	}
	testenv.Eventually(t, 20*time.Second, "the second takes the slot over", second.Reading)
	testenv.Eventually(t, 20*time.Second, "all 20 published", func() bool { return env.StreamMsgs(t, testenv.Stream) == 20 })
}

// A row the broker refuses while it answers (here: a subject no stream stores) is
// handed over to the polling relay, which charges it and, past MaxAttempts,
// dead-letters it; the slot moves on past it.
func TestLogRelayHandsOverWhatTheBrokerRefuses(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	env.RequireLogRelay(t)
	r := env.StartRelays(t, env.Inst, relay.Config{MaxAttempts: 2, PollInterval: 50 * time.Millisecond,
		Backoff: func(int) time.Duration { return time.Millisecond }})
	testenv.Go(t, "polling relay", r.Poll.Run)
	// Written past Enqueue's check, as if the stream had lost the subject since.
	env.DB.Count(t, `WITH i AS (INSERT INTO idem_outbox (key, subject, msg_id, headers, payload) VALUES ('k-x', 'elsewhere.x', 'elsewhere.x k-x', '{}', '\x7b7d') RETURNING 1) SELECT count(*) FROM i`)
	enqueue(t, env.DB, outbox.New(env.Inst), msg("k-1"))
	testenv.Eventually(t, 20*time.Second, "k-1 published", func() bool { return env.StreamMsgs(t, testenv.Stream) == 1 })
	testenv.Eventually(t, 20*time.Second, "k-x dead-lettered by the polling relay", func() bool {
		return env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE consumer = '(relay)' AND key = 'k-x'`) == 1
	})
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'k-x' AND relay IS NULL AND attempts >= 2`); n != 1 {
		t.Errorf("k-x handed over and charged: %d rows, want 1", n)
	}
	// The position is taken once: the WAL's end moves on with every other test's
	// writes, and a target that moves with it is never reached on a busy server.
	past := walPosition(t, env)
	testenv.Eventually(t, 20*time.Second, "the slot moves past k-x", func() bool { return confirmedPast(t, env, past) })
}

// A slot that was dropped (or lost) while rows waited in it: the log relay makes
// a new one and hands what no window holds to the polling relay, which publishes
// it. The negative control (relay.skip-slot-hand-over) leaves it unpublished.
func TestLogRelayHandsOverWhatALostSlotNeverPublished(t *testing.T) {
	t.Parallel()
	for _, control := range []bool{false, true} {
		t.Run(map[bool]string{false: "as shipped", true: "no hand-over"}[control], func(t *testing.T) {
			t.Parallel()
			env := testenv.New(t)
			first := newLogRelay(t, env, relay.Config{})
			stop := startLog(t, env, first)
			ob := outbox.New(env.Inst)
			enqueue(t, env.DB, ob, msg("k-1"))
			testenv.Eventually(t, 20*time.Second, "k-1 published", func() bool { return env.StreamMsgs(t, testenv.Stream) == 1 })
			stop()
			enqueue(t, env.DB, ob, msg("k-2"), msg("k-3")) // in the slot, never read
			testenv.Eventually(t, 10*time.Second, "the slot dropped", func() bool {
				return env.DB.Count(t, `SELECT count(*) FROM (SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database() AND NOT active) AS d`) == 1
			})
			ctx := context.Background()
			if control {
				ctx = faults.With(ctx, faults.New().Switch(faults.SkipSlotHandOver))
			}
			poll, err := relay.New(parts.Of(env.Inst), relay.Config{BehindLog: true, PollInterval: 50 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			testenv.Go(t, "polling relay", poll.Run)
			second, err := relay.NewLog(parts.Of(env.Inst), relay.Config{}, poll.Wake)
			if err != nil {
				t.Fatal(err)
			}
			testenv.GoCtx(t, ctx, "second log relay", second.Run)
			testenv.Eventually(t, 20*time.Second, "the second reads a new slot", second.Reading)
			if control {
				if _, err := poll.Drain(context.Background()); err != nil {
					t.Fatal(err)
				}
				if n := env.StreamMsgs(t, testenv.Stream); n != 1 {
					t.Fatalf("the control published %d messages, want 1: without the hand-over k-2 and k-3 stay unpublished", n)
				}
				return
			}
			testenv.Eventually(t, 20*time.Second, "k-2 and k-3 published by the polling relay", func() bool { return env.StreamMsgs(t, testenv.Stream) == 3 })
		})
	}
}
