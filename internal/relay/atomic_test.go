package relay_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// atomicSetup is an installation on a stream of its own (ATOMIC, atomic.>),
// allowing atomic batches or not, and its outbox.
func atomicSetup(t *testing.T, allow bool) (*testenv.Env, *install.Installation, *outbox.Outbox) {
	t.Helper()
	env := testenv.New(t)
	inst := onStream(t, env, install.Stream{Name: "ATOMIC", Subjects: []string{"atomic.>"}, AllowAtomicPublish: allow})
	return env, inst, outbox.New(inst)
}

func atomicMsgs(prefix string, n int) []idem.Message {
	out := make([]idem.Message, n)
	for i := range out {
		out[i] = idem.Message{Key: fmt.Sprintf("%s-%03d", prefix, i), Subject: "atomic.charges", Payload: []byte(`{}`)}
	}
	return out
}

// checkStoredWhereRecorded reads every row's message back at the stream sequence
// the relay recorded for it (which the reconciler trusts) and compares its
// Msg-Id. batched says whether the stored messages must carry a batch id.
func checkStoredWhereRecorded(t *testing.T, env *testenv.Env, stream string, want int, batched bool) {
	t.Helper()
	ctx := context.Background()
	s, err := env.JS.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := env.DB.Pool.Query(ctx, `SELECT msg_id, stream, stream_seq FROM idem_outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var msgID, recorded string
		var seq int64
		if err := rows.Scan(&msgID, &recorded, &seq); err != nil {
			t.Fatal(err)
		}
		n++
		if recorded != stream {
			t.Fatalf("%s recorded in stream %q, want %q", msgID, recorded, stream)
		}
		m, err := s.GetMsg(ctx, uint64(seq))
		if err != nil {
			t.Fatalf("%s recorded at %d: %v", msgID, seq, err)
		}
		if got := m.Header.Get(jetstream.MsgIDHeader); got != msgID {
			t.Fatalf("sequence %d holds %q, recorded for %q", seq, got, msgID)
		}
		if has := m.Header.Get("Nats-Batch-Id") != ""; has != batched {
			t.Fatalf("%s at %d: carries a batch id %v, want %v", msgID, seq, has, batched)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if n != want {
		t.Fatalf("%d outbox rows, want %d", n, want)
	}
	if got := env.StreamMsgs(t, stream); got != uint64(want) {
		t.Fatalf("stream holds %d messages, want %d", got, want)
	}
}

// With AtomicPublish every batch goes as one atomic batch, and each row records
// the sequence its message really took.
func TestRelayAtomicPublish(t *testing.T) {
	t.Parallel()
	env, inst, ob := atomicSetup(t, true)
	stream := inst.Stream().Name
	enqueue(t, env.DB, ob, atomicMsgs("a", 250)...)
	r := newRelay(t, inst, relay.Config{BatchSize: 100, AtomicPublish: true})
	if n, err := r.Drain(context.Background()); err != nil || n != 250 {
		t.Fatalf("Drain = %d, %v; want 250", n, err)
	}
	checkStoredWhereRecorded(t, env, stream, 250, true)
}

// A relay that died between publishing an atomic batch and marking it publishes
// the batch again. The broker refuses a batch holding stored Msg-Ids whole, so the
// relay publishes it message by message: folded, and recorded where the first
// copies are.
func TestRelayAtomicRepublishAfterCrash(t *testing.T) {
	t.Parallel()
	env, inst, ob := atomicSetup(t, true)
	stream := inst.Stream().Name
	enqueue(t, env.DB, ob, atomicMsgs("c", 40)...)
	dying := faults.With(context.Background(), faults.New().Func(faults.RelayAfterPublish, func(_ context.Context, keys []string) error {
		return fmt.Errorf("fault: relay died before marking %d rows", len(keys))
	}))
	r := newRelay(t, inst, relay.Config{BatchSize: 100, AtomicPublish: true})
	if _, err := r.Drain(dying); err == nil {
		t.Fatal("the dying relay reported success")
	}
	if got := env.StreamMsgs(t, stream); got != 40 {
		t.Fatalf("after the crash the stream holds %d, want 40", got)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL`); n != 40 {
		t.Fatalf("unpublished rows after the crash = %d, want 40", n)
	}
	if n, err := r.Drain(context.Background()); err != nil || n != 40 {
		t.Fatalf("second Drain = %d, %v; want 40", n, err)
	}
	checkStoredWhereRecorded(t, env, stream, 40, true)
}

// A stream that does not allow atomic batches refuses the first; the relay
// publishes it message by message, and every batch after it too.
func TestRelayAtomicPublishOnAStreamThatRefusesIt(t *testing.T) {
	t.Parallel()
	env, inst, ob := atomicSetup(t, false)
	stream := inst.Stream().Name
	enqueue(t, env.DB, ob, atomicMsgs("d", 30)...)
	r := newRelay(t, inst, relay.Config{BatchSize: 10, AtomicPublish: true})
	if n, err := r.Drain(context.Background()); err != nil || n != 30 {
		t.Fatalf("Drain = %d, %v; want 30", n, err)
	}
	checkStoredWhereRecorded(t, env, stream, 30, false)
}

func TestRelayAtomicPublishConfig(t *testing.T) {
	t.Parallel()
	if _, err := relay.New(parts.Installation{}, relay.Config{AtomicPublish: true, BatchSize: relay.MaxAtomicBatch + 1}); err == nil {
		t.Fatal("New accepted a BatchSize over MaxAtomicBatch with AtomicPublish")
	}
	// An atomic batch expects its stream: a relay always has one, since an
	// installation without a stream name is refused.
	refusedInstall(t, pgtest.New(t), "no stream name", install.Config{Stream: install.Stream{Subjects: []string{"atomic.>"}}})
}

// A batch holding a row another stream stores: with AtomicPublish the expected
// stream refuses the whole batch before anything is stored, and the relay then
// publishes it message by message, so each row gets the broker's verdict alone,
// as without AtomicPublish: the good rows land in the stream, the misrouted one
// fails with its error, and the other stream took nothing.
func TestRelayAtomicPublishWithAMisroutedRow(t *testing.T) {
	t.Parallel()
	env, inst, ob := atomicSetup(t, true)
	stream := inst.Stream().Name
	ctx := context.Background()
	// The outbox of an installation of the same tables on OTHER writes the
	// misrouted row, between the good ones, in one transaction.
	other := outbox.New(onStream(t, env, install.Stream{Name: "OTHER", Subjects: []string{"other.>"}, AllowAtomicPublish: true}))
	msgs := atomicMsgs("m", 5)
	if err := pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error {
		if err := ob.Enqueue(ctx, tx, msgs[:2]...); err != nil {
			return err
		}
		if err := other.Enqueue(ctx, tx, idem.Message{Key: "m-misrouted", Subject: "other.x", Payload: []byte("{}")}); err != nil {
			return err
		}
		return ob.Enqueue(ctx, tx, msgs[2:]...)
	}); err != nil {
		t.Fatal(err)
	}
	r := newRelay(t, inst, relay.Config{BatchSize: 100, AtomicPublish: true})
	if n, err := r.Drain(ctx); err != nil || n != 5 {
		t.Fatalf("Drain = %d, %v; want 5 published", n, err)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL AND attempts = 1 AND last_error IS NOT NULL AND key = 'm-misrouted'`); n != 1 {
		t.Fatalf("the misrouted row pending with its error = %d, want 1", n)
	}
	if got := env.StreamMsgs(t, "OTHER"); got != 0 {
		t.Fatalf("the other stream took %d messages, want 0", got)
	}
	if got := env.StreamMsgs(t, stream); got != 5 {
		t.Fatalf("the stream holds %d messages, want 5", got)
	}
}
