// Package testenv bundles what most integration tests need: a fresh Postgres
// database with idem's schema, an embedded JetStream server with a test stream, a
// test-local effect table, and helpers to publish and to wait on conditions (never
// on sleeps).
//
// The library's own tests run on this topology, not on the reference
// application's: stream Stream on subjects "test.>", and the effect table
// test_effects, which — like the reference app's ledger — has no unique constraint
// on the key, so a double effect shows up as a second row.
package testenv

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

// The test topology.
const (
	// Stream is the test stream.
	Stream = "TEST"
	// Subjects is its subject filter.
	Subjects = "test.>"
	// Subject is the subject most tests publish on.
	Subject = "test.effects"
)

// Env is one test's world.
type Env struct {
	DB   *pgtest.DB
	NATS *natstest.Server
	NC   *nats.Conn
	JS   jetstream.JetStream
	// Inst is the installation of DB's schema on the test stream.
	Inst *install.Installation

	schema string
}

// New starts a database and a JetStream server for t, creates the test stream and
// the test_effects table.
func New(t testing.TB) *Env {
	t.Helper()
	return NewWith(t, pgtest.Options{})
}

// NewWith is New with the database shaped by opts (another schema for idem's tables,
// say). test_effects always lives in public.
func NewWith(t testing.TB, opts pgtest.Options) *Env {
	t.Helper()
	e := &Env{DB: pgtest.NewWith(t, opts), NATS: natstest.Start(t), schema: opts.Schema}
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
	e.Inst = e.Install(t, nil)
	if _, err := e.Inst.EnsureStream(context.Background()); err != nil {
		t.Fatalf("testenv: %v", err)
	}
	if _, err := e.DB.Pool.Exec(context.Background(), sqlCreateEffects); err != nil {
		t.Fatalf("testenv: create test_effects: %v", err)
	}
	return e
}

// Install returns an installation of the test's database and stream, with edit
// (when not nil) changing its configuration first: an Observer, another stream.
func (e *Env) Install(t testing.TB, edit func(*install.Config)) *install.Installation {
	t.Helper()
	cfg := install.Config{Schema: e.schema, Stream: install.Stream{Name: Stream, Subjects: []string{Subjects}}}
	if edit != nil {
		edit(&cfg)
	}
	inst, err := install.New(e.DB.Pool, e.NC, cfg)
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	return inst
}

// Observed is the test's installation with obs told every event.
func (e *Env) Observed(t testing.TB, obs idem.Observer) *install.Installation {
	t.Helper()
	return e.Install(t, func(c *install.Config) { c.Observer = obs })
}

const sqlCreateEffects = `
CREATE TABLE public.test_effects (
    id         bigserial   PRIMARY KEY,
    key        text        NOT NULL,
    payload    bytea       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)`

// Effect is the test effect: one test_effects row per delivery it runs for, written
// with one statement per batch inside the inbox transaction.
type Effect struct{}

var _ consumer.BatchHandler = Effect{}

// HandleBatch implements consumer.BatchHandler.
func (Effect) HandleBatch(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
	keys := make([]string, len(ds))
	payloads := make([][]byte, len(ds))
	for i, d := range ds {
		keys[i], payloads[i] = d.Key, d.Payload
	}
	if _, err := tx.Exec(ctx, `INSERT INTO public.test_effects (key, payload) SELECT * FROM unnest($1::text[], $2::bytea[])`, keys, payloads); err != nil {
		return nil, fmt.Errorf("test effect: %w", err)
	}
	return make([][]byte, len(ds)), nil
}

// Effects counts test_effects rows for key.
func (e *Env) Effects(t testing.TB, key string) int {
	t.Helper()
	return e.DB.Count(t, `SELECT count(*) FROM public.test_effects WHERE key = $1`, key)
}

// AllEffects counts every test_effects row.
func (e *Env) AllEffects(t testing.TB) int {
	t.Helper()
	return e.DB.Count(t, `SELECT count(*) FROM public.test_effects`)
}

// ConsumerConfig is a consumer of Subject on the test stream running Effect, with
// test-friendly timings; tests change what they need.
func ConsumerConfig(name string) consumer.Config {
	return consumer.Config{
		Name:         name,
		Subject:      Subject,
		BatchHandler: Effect{},
		AckWait:      2 * time.Second,
		Backoff:      func(int) time.Duration { return 50 * time.Millisecond },
		// Explicit, so that a test starting consumers of one subject one by one
		// (each Run registering it) is not refused as a rename of one that
		// settled first; the tests of that refusal ask for StartDefault.
		Start: consumer.StartBackfill,
	}
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

// Drained reports whether the durable consumer name of the test stream has nothing
// left to do; see DrainedOn.
func (e *Env) Drained(t testing.TB, name string) func() bool {
	return e.DrainedOn(t, Stream, name)
}

// DrainedOn reports whether the durable consumer name on stream has nothing left to
// do: no message waiting to be delivered and none delivered but unacknowledged (a
// nak with a delay counts as unacknowledged until it is redelivered and settled).
// Wait on it rather than on outcome counts being exactly N: under load a message
// can be redelivered after its AckWait and counted twice, which is correct
// behaviour (the copy folds) but makes "count == N" wait forever.
func (e *Env) DrainedOn(t testing.TB, stream, name string) func() bool {
	return func() bool {
		c, err := e.JS.Consumer(context.Background(), stream, name)
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

// StreamMsgs is how many messages the stream holds.
func (e *Env) StreamMsgs(t testing.TB, stream string) uint64 {
	t.Helper()
	s, err := e.JS.Stream(context.Background(), stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

// Ctx is a context cancelled when the test ends.
func Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return ctx
}

// Go runs run (a consumer's or relay's Run) in the background until the returned
// stop is called or the test ends; stop waits for run to return and fails the test
// if it returned an error. ctx's values (fault points) reach run.
func Go(t testing.TB, name string, run func(ctx context.Context) error) (stop func()) {
	t.Helper()
	return GoCtx(t, context.Background(), name, run)
}

// GoCtx is Go with run's context derived from parent.
func GoCtx(t testing.TB, parent context.Context, name string, run func(ctx context.Context) error) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(parent)
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("%s: %v", name, err)
				}
			case <-time.After(60 * time.Second):
				t.Errorf("%s: did not stop within 60s", name)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// Outcomes counts events by outcome; its Observe is an idem.Observer.
type Outcomes struct {
	mu sync.Mutex
	n  map[idem.Outcome]int
}

// Observe implements idem.Observer.
func (o *Outcomes) Observe(e idem.Event) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n == nil {
		o.n = map[idem.Outcome]int{}
	}
	o.n[e.Outcome] += e.Count
}

// Get returns the count of outcome.
func (o *Outcomes) Get(outcome idem.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.n[outcome]
}

// World is an Example function's throwaway world: a fresh database with idem's
// tables (and the example's own) and a JetStream server of its own, without the
// test stream. Close it when done.
type World struct {
	Pool        *pgxpool.Pool
	DatabaseURL string
	NC          *nats.Conn
	JS          jetstream.JetStream

	db   *pgtest.DB
	nats *natstest.Server
}

// Open starts a World; migrate, when not nil, creates the example's own tables.
func Open(ctx context.Context, migrate func(ctx context.Context, pool *pgxpool.Pool) error) (*World, error) {
	db, err := pgtest.Create(ctx, pgtest.Options{})
	if err != nil {
		return nil, fmt.Errorf("testenv: %w", err)
	}
	w := &World{db: db, Pool: db.Pool, DatabaseURL: db.URL}
	if w.nats, err = natstest.Run(natstest.Options{}); err != nil {
		return nil, errors.Join(err, w.Close())
	}
	if w.NC, err = nats.Connect(w.nats.URL()); err != nil {
		return nil, errors.Join(fmt.Errorf("testenv: connect: %w", err), w.Close())
	}
	if w.JS, err = jetstream.New(w.NC); err != nil {
		return nil, errors.Join(fmt.Errorf("testenv: %w", err), w.Close())
	}
	if migrate != nil {
		if err := migrate(ctx, w.Pool); err != nil {
			return nil, errors.Join(fmt.Errorf("testenv: migrate: %w", err), w.Close())
		}
	}
	return w, nil
}

// Close stops the server and drops the database.
func (w *World) Close() error {
	if w.NC != nil {
		w.NC.Close()
	}
	if w.nats != nil {
		w.nats.Close()
	}
	return w.db.Drop()
}
