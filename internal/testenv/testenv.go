// Package testenv bundles what most integration tests need: a fresh Postgres
// database, an embedded JetStream server with the IDEM stream, and helpers to
// publish and to wait on conditions (never on sleeps).
package testenv

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/embeddednats"
	"github.com/idemkit/idem/internal/natstest"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/outbox"
)

// Env is one test's world.
type Env struct {
	DB   *pgtest.DB
	NATS *embeddednats.Server
	NC   *nats.Conn
	JS   jetstream.JetStream
}

// New starts a database and a JetStream server for t and creates the stream.
func New(t testing.TB) *Env {
	t.Helper()
	e := &Env{DB: pgtest.New(t), NATS: natstest.Start(t)}
	nc, err := nats.Connect(e.NATS.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatalf("testenv: connect: %v", err)
	}
	t.Cleanup(nc.Close)
	e.NC = nc
	e.JS, err = jetstream.New(nc)
	if err != nil {
		t.Fatalf("testenv: jetstream: %v", err)
	}
	if _, err := outbox.EnsureStream(context.Background(), e.JS, outbox.StreamConfig{}); err != nil {
		t.Fatalf("testenv: %v", err)
	}
	return e
}

// Publish publishes payload on subject with Idempotency-Key key and the given
// Nats-Msg-Id (empty: none, so the broker does not de-duplicate).
func (e *Env) Publish(t testing.TB, subject, key, msgID string, payload []byte) {
	t.Helper()
	msg := nats.NewMsg(subject)
	if key != "" {
		msg.Header.Set(idem.HeaderKey, key)
	}
	if msgID != "" {
		msg.Header.Set(jetstream.MsgIDHeader, msgID)
	}
	msg.Data = payload
	if _, err := e.JS.PublishMsg(context.Background(), msg); err != nil {
		t.Fatalf("testenv: publish: %v", err)
	}
}

// ChargePayload is a valid charge body.
func ChargePayload(account string, cents int) []byte {
	return fmt.Appendf(nil, `{"account":%q,"amount_cents":%d}`, account, cents)
}

// Eventually polls cond every 20ms until it returns true or timeout passes.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Drained reports whether the durable consumer name has nothing left to do: no
// message waiting to be delivered and none delivered but unacknowledged (a nak
// with a delay counts as unacknowledged until it is redelivered and settled).
// Wait on it rather than on outcome counts being exactly N: under load a message
// can be redelivered after its AckWait and counted twice, which is correct
// behaviour (the copy folds) but makes "count == N" wait forever.
func (e *Env) Drained(t testing.TB, name string) func() bool {
	return func() bool {
		c, err := e.JS.Consumer(context.Background(), idem.StreamName, name)
		if err != nil {
			return false // not created yet
		}
		info, err := c.Info(context.Background())
		if err != nil {
			t.Logf("testenv: consumer info %s: %v", name, err)
			return false
		}
		return info.NumPending == 0 && info.NumAckPending == 0
	}
}

// LedgerRows counts ledger rows for key.
func (e *Env) LedgerRows(t testing.TB, key string) int {
	return e.DB.Count(t, `SELECT count(*) FROM ledger_entries WHERE idempotency_key = $1`, key)
}

// Ctx is a context cancelled when the test ends.
func Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return ctx
}

// Go runs run (a consumer's or relay's Run) in the background until the returned
// stop is called or the test ends; stop waits for run to return and fails the test
// if it returned an error.
func Go(t testing.TB, name string, run func(ctx context.Context) error) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("%s: %v", name, err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}
