package idemwatermill_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/idemtest"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/outbox"
	idemwatermill "github.com/idemkit/idem/watermill"
)

// The test topology: the user's, not idem's. The Watermill topic the tests'
// handlers subscribe to is the subject of the orders a producer announces; produced
// messages go to subjectConfirmed; both lie on the stream ORDERS ("orders.>").
const (
	topic            = "orders.created"
	subjectConfirmed = "orders.confirmed"
	streamName       = "ORDERS"
	streamSubjects   = "orders.>"
)

// consumerName is the inbox consumer of the middleware under test.
const consumerName = "billing"

// deadline bounds every wait on a condition; a test that hits it has hung.
const deadline = 30 * time.Second

// quiet is the middleware's logger in tests: rejections are asserted, not logged.
func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// newPubSub returns an in-process pub/sub whose Publish returns only once the
// subscriber acked the message, after every nack-and-resend. A test that publishes
// therefore knows the message is fully processed when Publish returns, without
// sleeping. (A subscriber must exist, or gochannel drops the message.)
func newPubSub() *gochannel.GoChannel {
	return gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
}

// startRouter runs a real Watermill router with one consumer handler on topic and
// the given router-level middlewares (first is outermost). It returns once the
// handler has subscribed, and closes the router when the test ends.
func startRouter(t *testing.T, ps *gochannel.GoChannel, handler message.NoPublishHandlerFunc, mws ...message.HandlerMiddleware) {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: deadline}, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("new router: %v", err)
	}
	r.AddMiddleware(mws...)
	r.AddConsumerHandler(consumerName, topic, ps, handler)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("close router: %v", err)
		}
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("router run: %v", err)
			}
		case <-time.After(deadline):
			t.Errorf("router did not stop within %v", deadline)
		}
	})
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped before running: %v", err)
	case <-time.After(deadline):
		t.Fatalf("router not running within %v", deadline)
	}
}

// publish publishes msgs to topic and waits until each was acked by the router.
func publish(t *testing.T, ps message.Publisher, msgs ...*message.Message) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- ps.Publish(topic, msgs...) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("publish: %v", err)
		}
	case <-time.After(deadline):
		t.Fatalf("messages not acked within %v: the handler keeps failing", deadline)
	}
}

// orderPayload is the test order body.
type orderPayload struct {
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
}

// order builds a Watermill message carrying an order to bill. An empty key leaves
// the Idempotency-Key metadata unset.
func order(key, account string, cents int64) *message.Message {
	body, err := json.Marshal(orderPayload{Account: account, AmountCents: cents})
	if err != nil {
		panic(err) // a struct of a string and an int always marshals
	}
	m := message.NewMessage(watermill.NewUUID(), body)
	if key != "" {
		m.Metadata.Set(idem.HeaderKey, key)
	}
	return m
}

// testDB is a test's own database, from the public test kit.
type testDB struct{ *idemtest.Env }

// Count runs a query that returns one count and fails t if it does not.
func (db testDB) Count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// newDB returns a fresh database with idem's tables (in schema, default public) and
// the test-local effect table order_effects, which has no unique constraint on the
// key, so a double effect shows up as a second row. It has no broker.
func newDB(t *testing.T, schema string) testDB {
	t.Helper()
	return testDB{idemtest.New(t, idemtest.Config{Schema: schema, Migrate: func(ctx context.Context, pool *pgxpool.Pool) error {
		_, err := pool.Exec(ctx, sqlCreateEffects)
		return err
	}})}
}

const sqlCreateEffects = `
CREATE TABLE public.order_effects (
    id              bigserial PRIMARY KEY,
    idempotency_key text      NOT NULL,
    account         text      NOT NULL,
    amount_cents    bigint    NOT NULL
)`

// effects counts the effect rows.
func effects(t *testing.T, db testDB) int {
	t.Helper()
	return db.Count(t, `SELECT count(*) FROM public.order_effects`)
}

// newInst returns the service's installation on db: idem's tables in schema, the
// ORDERS stream, a quiet logger. It has no NATS connection: the middleware and the
// outbox only read and write the tables.
func newInst(t *testing.T, db testDB, schema string) *install.Installation {
	t.Helper()
	return installOn(t, db.Pool, schema)
}

// installOn is newInst on any pool: unreachablePool's, for a test that shows a
// setup step queries nothing.
func installOn(t *testing.T, pool *pgxpool.Pool, schema string) *install.Installation {
	t.Helper()
	inst, err := install.New(pool, nil, install.Config{Schema: schema,
		Stream: install.Stream{Name: streamName, Subjects: []string{streamSubjects}}, Logger: quiet()})
	if err != nil {
		t.Fatalf("new installation: %v", err)
	}
	return inst
}

// unreachablePool is a pool of a server that is not there (port 1 of the
// loopback), closed at cleanup: any query on it fails.
func unreachablePool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://idem@127.0.0.1:1/none?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// newOutbox returns the service's outbox on db (idem's tables in public): messages
// refused unless they lie on the ORDERS stream.
func newOutbox(t *testing.T, db testDB) *outbox.Outbox {
	t.Helper()
	return outbox.New(newInst(t, db, ""))
}

// execer is a pool or a transaction.
type execer = dedupe.Querier

// insertEffect is the side effect: one row in order_effects.
func insertEffect(ctx context.Context, db execer, msg *message.Message) error {
	var p orderPayload
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return fmt.Errorf("decode order: %w", err)
	}
	_, err := db.Exec(ctx,
		`INSERT INTO public.order_effects (idempotency_key, account, amount_cents) VALUES ($1, $2, $3)`,
		msg.Metadata.Get(idem.HeaderKey), p.Account, p.AmountCents)
	if err != nil {
		return fmt.Errorf("insert effect: %w", err)
	}
	return nil
}

// effectInTx writes the effect through the transaction the idem middleware opened.
func effectInTx(msg *message.Message) error {
	tx, ok := idemwatermill.TxFromContext(msg.Context())
	if !ok {
		return errors.New("no transaction in the message context")
	}
	return insertEffect(msg.Context(), tx, msg)
}

// errTransient is the failure injected by flaky.
var errTransient = errors.New("transient failure: the billing provider timed out")

// flaky wraps a handler: it counts calls and fails the first `failures` of them
// with errTransient before any effect, as a handler whose provider timed out does.
type flaky struct {
	failures int64
	calls    atomic.Int64
	next     message.NoPublishHandlerFunc
}

func (f *flaky) handle(msg *message.Message) error {
	if f.calls.Add(1) <= f.failures {
		return errTransient
	}
	return f.next(msg)
}

// recorder is a message.Publisher that keeps what it is given: the poison queue's
// destination in tests.
type recorder struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (r *recorder) Publish(topic string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, msgs...)
	return nil
}

func (r *recorder) Close() error { return nil }

func (r *recorder) messages() []*message.Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*message.Message(nil), r.msgs...)
}
