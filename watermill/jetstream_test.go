package idemwatermill_test

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/embeddednats"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/outbox"
	idemwatermill "github.com/idemkit/idem/watermill"
	"github.com/idemkit/idem/worker"
)

// fromStream reads the last message stored on subject and turns it into a
// Watermill message the way a Watermill NATS subscriber does: every header becomes
// metadata, Nats-Msg-Id and Idempotency-Key included.
func fromStream(t *testing.T, s jetstream.Stream, subject string) (*message.Message, *jetstream.RawStreamMsg) {
	t.Helper()
	raw, err := s.GetLastMsgForSubject(context.Background(), subject)
	if err != nil {
		t.Fatalf("read %s from the stream: %v", subject, err)
	}
	m := message.NewMessage(watermill.NewUUID(), raw.Data)
	for k := range raw.Header {
		m.Metadata.Set(k, raw.Header.Get(k))
	}
	return m, raw
}

// End to end on the user's topology (stream ORDERS, "orders.>"): a producer writes
// an order through OutboxPublisher, idem's relay publishes it, a Watermill handler
// behind the middleware receives it with all its headers as metadata, bills it and
// returns a confirmation carrying a copy of that metadata — Nats-Msg-Id included.
// The confirmation must reach the stream as a message of its own, with the Msg-Id
// derived from its own subject and key, not be folded by the broker into the order
// whose Msg-Id it carried. A redelivery of the order produces nothing more.
func TestProducedMessageReachesTheStreamUnderItsOwnMsgID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := newDB(t, "")
	srv, err := embeddednats.Start(embeddednats.Config{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	// The service's installation, with the broker: a worker's relay publishes.
	inst, err := install.New(db.Pool, nc, install.Config{Stream: install.Stream{Name: streamName, Subjects: []string{streamSubjects}}, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	stream, err := inst.EnsureStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ob := outbox.New(inst)
	w, err := worker.New(inst, worker.Config{DisableReconciler: true, DisableRetention: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := w.Stop(context.Background()); err != nil {
			t.Errorf("stop the worker: %v", err)
		}
	})
	// published waits until the stream holds want messages.
	published := func(want uint64) {
		t.Helper()
		for start := time.Now(); ; time.Sleep(10 * time.Millisecond) {
			info, err := stream.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if info.State.Msgs >= want {
				return
			}
			if time.Since(start) > deadline {
				t.Fatalf("the relay published %d messages in %s, want %d", info.State.Msgs, deadline, want)
			}
		}
	}

	// The producer.
	key := idem.NewKey().String()
	placed := order(key, "acct_1", 1250)
	placed.Metadata.Set("X-Correlation-Id", "corr-1")
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		return idemwatermill.NewOutboxPublisher(ob, tx).Publish(topic, placed)
	}); err != nil {
		t.Fatal(err)
	}
	published(1)

	// The Watermill consumer.
	mw := idemwatermill.Middleware(inst, idemwatermill.Config{
		Consumer: consumerName, OutboxSubject: subjectConfirmed,
	})
	handler := mw(func(m *message.Message) ([]*message.Message, error) {
		confirmed := message.NewMessage(watermill.NewUUID(), []byte(`{"confirmed":true}`))
		confirmed.Metadata = maps.Clone(m.Metadata)
		return []*message.Message{confirmed}, effectInTx(m)
	})
	in, _ := fromStream(t, stream, topic)
	if got := in.Metadata.Get(idem.HeaderMsgID); got != idem.MsgID(topic, key) {
		t.Fatalf("test setup: the incoming message carries Msg-Id %q, want %q", got, idem.MsgID(topic, key))
	}
	for range 2 { // the delivery, then a redelivery
		if produced, err := handler(in.Copy()); err != nil || len(produced) != 0 {
			t.Fatalf("handler: %d messages to the router, err %v; want none, nil", len(produced), err)
		}
	}
	published(2)

	if n := effects(t, db); n != 1 {
		t.Errorf("effect rows = %d, want 1", n)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 2 {
		t.Fatalf("stream holds %d messages, want 2 (the order and its confirmation)", info.State.Msgs)
	}
	_, out := fromStream(t, stream, subjectConfirmed)
	if got, want := out.Header.Get(jetstream.MsgIDHeader), idem.MsgID(subjectConfirmed, key); got != want {
		t.Errorf("confirmation Msg-Id = %q, want %q", got, want)
	}
	if got := out.Header.Get(idem.HeaderKey); got != key {
		t.Errorf("confirmation Idempotency-Key = %q, want the copied %q", got, key)
	}
	if got := out.Header.Get("X-Correlation-Id"); got != "corr-1" {
		t.Errorf("confirmation X-Correlation-Id = %q, want the copied corr-1", got)
	}
}
