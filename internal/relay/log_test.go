package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// newLogRelay is a log relay of env's outbox, running until the test ends.
func newLogRelay(t *testing.T, env *testenv.Env, cfg relay.Config) *relay.LogRelay {
	t.Helper()
	env.RequireLogRelay(t)
	l, err := relay.NewLog(env.Inst, cfg, nil)
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
