package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/deadletter"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// bundle is what each test sets up: the test topology and an outcome counter,
// which observes the bundle's installation.
type bundle struct {
	env  *testenv.Env
	out  *testenv.Outcomes
	inst *install.Installation // env's, observed by out
}

func setup(t *testing.T) *bundle {
	t.Helper()
	t.Parallel()
	env, out := testenv.New(t), &testenv.Outcomes{}
	return &bundle{env: env, out: out, inst: env.Observed(t, out.Observe)}
}

// through is the bundle's installation reached through pool and nc: another path
// to the same database and server, which a test can cut.
func (b *bundle) through(t *testing.T, pool *pgxpool.Pool, nc *nats.Conn) *install.Installation {
	t.Helper()
	inst, err := install.New(pool, nc, install.Config{Stream: b.inst.Stream(), Observer: b.out.Observe})
	if err != nil {
		t.Fatal(err)
	}
	return inst
}

// effectName is the in-transaction consumer of most tests.
const effectName = "effects"

// config is an in-transaction consumer running testenv.Effect.
func (b *bundle) config() consumer.Config {
	return testenv.ConsumerConfig(effectName)
}

// start runs a consumer until the returned stop is called (or the test ends).
func (b *bundle) start(t *testing.T, cfg consumer.Config) (stop func()) {
	t.Helper()
	return b.startCtx(t, context.Background(), cfg)
}

// startCtx is start with Run's context derived from ctx, which may carry faults.
func (b *bundle) startCtx(t *testing.T, ctx context.Context, cfg consumer.Config) (stop func()) {
	t.Helper()
	c, err := consumer.New(b.inst, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return testenv.GoCtx(t, ctx, "consumer "+cfg.Name, c.Run)
}

func payload(i int) []byte { return fmt.Appendf(nil, `{"n":%d}`, i) }

// Validation needs neither store: the installation's pool and connection lead
// nowhere, so a New that queried Postgres or asked JetStream would fail the
// valid cases.
func TestConfigValidate(t *testing.T) {
	t.Parallel()
	pool, nc := pgtest.Unreachable(t), natstest.Unreachable(t)
	stream := install.Stream{Name: testenv.Stream, Subjects: []string{testenv.Subjects}}
	inst, err := install.New(pool, nc, install.Config{Stream: stream})
	if err != nil {
		t.Fatal(err)
	}
	bh := testenv.Effect{}
	h := consumer.HandlerFunc(func(context.Context, pgx.Tx, *consumer.Delivery) ([]byte, error) { return nil, nil })
	ext := consumer.ExternalHandlerFunc(func(context.Context, *consumer.Effect) ([]byte, error) { return nil, nil })
	base := func(mut func(*consumer.Config)) consumer.Config {
		c := consumer.Config{Name: "n", Subject: "test.x", BatchHandler: bh}
		mut(&c)
		return c
	}
	cases := []struct {
		name string
		cfg  consumer.Config
		want string // "" means valid; otherwise a fragment of the error
	}{
		{"minimal batch handler", base(func(*consumer.Config) {}), ""},
		{"handler", base(func(c *consumer.Config) { c.BatchHandler, c.Handler = nil, h }), ""},
		{"external", base(func(c *consumer.Config) { c.BatchHandler, c.External = nil, ext }), ""},
		{"wildcard filter", base(func(c *consumer.Config) { c.Subject = "test.*.created" }), ""},
		{"tail wildcard filter", base(func(c *consumer.Config) { c.Subject = "test.>" }), ""},
		{"no name", base(func(c *consumer.Config) { c.Name = "" }), "Name is required"},
		{"no subject", base(func(c *consumer.Config) { c.Subject = "" }), "Subject is required"},
		{"no handler", base(func(c *consumer.Config) { c.BatchHandler = nil }), "exactly one of Handler, BatchHandler and External"},
		{"handler and batch handler", base(func(c *consumer.Config) { c.Handler = h }), "exactly one"},
		{"batch handler and external", base(func(c *consumer.Config) { c.External = ext }), "exactly one"},
		{"all three", base(func(c *consumer.Config) { c.Handler, c.External = h, ext }), "exactly one"},
		{"empty filter token", base(func(c *consumer.Config) { c.Subject = "test..x" }), "bad subject"},
		{"> not last", base(func(c *consumer.Config) { c.Subject = "test.>.x" }), "bad subject"},
		{"space in filter", base(func(c *consumer.Config) { c.Subject = "test x" }), "bad subject"},
		{"negative batch", base(func(c *consumer.Config) { c.BatchSize = -1 }), "must not be negative"},
		{"negative concurrency", base(func(c *consumer.Config) { c.Concurrency = -1 }), "must not be negative"},
		{"negative lease", base(func(c *consumer.Config) { c.BatchHandler, c.External, c.LeaseFor = nil, ext, -time.Second }), "must not be negative"},
		{"negative ack wait", base(func(c *consumer.Config) { c.AckWait = -time.Second }), "must not be negative"},
		{"external batch", base(func(c *consumer.Config) { c.BatchHandler, c.External, c.BatchSize = nil, ext, 10 }), "one effect at a time"},
	}
	for _, tc := range cases {
		_, err := consumer.New(inst, tc.cfg)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: rejected: %v", tc.name, err)
		case tc.want != "" && err == nil:
			t.Errorf("%s: accepted, want an error about %q", tc.name, tc.want)
		case tc.want != "" && !strings.Contains(err.Error(), tc.want):
			t.Errorf("%s: err = %v, want it to mention %q", tc.name, err, tc.want)
		}
	}
	// The pool, the schema and the stream are the installation's, which refuses
	// what no consumer could use; a consumer refuses an installation without a
	// NATS connection.
	for name, tc := range map[string]struct {
		pool *pgxpool.Pool
		cfg  install.Config
		want string
	}{
		"other schema": {pool, install.Config{Schema: "idem_app", Stream: stream}, ""},
		"nil pool":     {nil, install.Config{Stream: stream}, "pool is required"},
		"bad schema":   {pool, install.Config{Schema: "Idem-App", Stream: stream}, "schema"},
		"no stream":    {pool, install.Config{Stream: install.Stream{Subjects: stream.Subjects}}, "Stream.Name is required"},
	} {
		_, err := install.New(tc.pool, nc, tc.cfg)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("installation %s: rejected: %v", name, err)
		case tc.want != "" && err == nil:
			t.Errorf("installation %s: accepted, want an error about %q", name, tc.want)
		case tc.want != "" && !strings.Contains(err.Error(), tc.want):
			t.Errorf("installation %s: err = %v, want it to mention %q", name, err, tc.want)
		}
	}
	tablesOnly, err := install.New(pool, nil, install.Config{Stream: stream})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := consumer.New(tablesOnly, cases[0].cfg); err == nil || !strings.Contains(err.Error(), "no NATS connection") {
		t.Errorf("an installation without JetStream: err = %v, want a refusal", err)
	}

	// Defaults: an External performs one effect at a time.
	x := consumer.Config{Name: "n", Subject: "test.x", External: ext}.WithDefaults()
	if x.LeaseFor != consumer.DefaultLeaseFor || x.AckWait != consumer.DefaultAckWait || x.MaxDeliver != consumer.DefaultMaxDeliver ||
		x.Concurrency != consumer.DefaultExternalConcurrency || x.BatchSize != 1 || x.KeyLifetime <= 0 || x.Backoff == nil {
		t.Errorf("external defaults not filled in: %+v", x)
	}
	in := cases[0].cfg.WithDefaults()
	if in.BatchSize != consumer.DefaultBatchSize || in.Concurrency != consumer.DefaultConcurrency {
		t.Errorf("in-transaction defaults not filled in: %+v", in)
	}
	c, err := consumer.New(inst, cases[0].cfg)
	if err != nil {
		t.Fatal(err)
	}
	if n := c.JetStreamConfig().MaxAckPending; n < 1000 {
		t.Errorf("in-transaction MaxAckPending = %d, want at least 1000", n)
	}
}

// The redelivery horizon sums, over MaxDeliver attempts, the wait before each
// redelivery and its backoff. An External's crashed message is performed again only
// once its lease ends, so it counts the longer of AckWait and LeaseFor; an
// in-transaction consumer holds no lease and counts AckWait alone.
func TestRedeliveryHorizon(t *testing.T) {
	t.Parallel()
	ext := consumer.ExternalHandlerFunc(func(context.Context, *consumer.Effect) ([]byte, error) { return nil, nil })
	minute := func(int) time.Duration { return time.Minute }
	cases := []struct {
		name string
		cfg  consumer.Config
		want time.Duration
	}{
		{"external, lease longer", consumer.Config{External: ext, LeaseFor: time.Hour, AckWait: time.Second, MaxDeliver: 2, Backoff: minute}, 2 * (time.Hour + time.Minute)},
		{"external, ack wait longer", consumer.Config{External: ext, LeaseFor: time.Second, AckWait: time.Hour, MaxDeliver: 2, Backoff: minute}, 2 * (time.Hour + time.Minute)},
		{"in-transaction ignores LeaseFor", consumer.Config{BatchHandler: testenv.Effect{}, LeaseFor: time.Hour, AckWait: time.Second, MaxDeliver: 2, Backoff: minute}, 2 * (time.Second + time.Minute)},
		{"growing backoff", consumer.Config{BatchHandler: testenv.Effect{}, AckWait: time.Second, MaxDeliver: 3,
			Backoff: func(n int) time.Duration { return time.Duration(n) * time.Minute }}, 3*time.Second + 6*time.Minute},
	}
	for _, tc := range cases {
		if got := tc.cfg.RedeliveryHorizon(); got != tc.want {
			t.Errorf("%s: RedeliveryHorizon = %s, want %s", tc.name, got, tc.want)
		}
	}
	// Defaults: 10 attempts of 30s plus DefaultBackoff (1s, 2s, ... capped at 1m).
	d := consumer.Config{BatchHandler: testenv.Effect{}}
	want := time.Duration(0)
	for n := 1; n <= consumer.DefaultMaxDeliver; n++ {
		want += consumer.DefaultAckWait + consumer.DefaultBackoff(n)
	}
	if got := d.RedeliveryHorizon(); got != want {
		t.Errorf("default RedeliveryHorizon = %s, want %s", got, want)
	}
}

// The same message published three times with distinct Nats-Msg-Ids (so the broker
// cannot fold them) and one Idempotency-Key lands one effect.
func TestSameKeyDistinctMsgIDsLandsOnce(t *testing.T) {
	b := setup(t)
	for i := range 3 {
		b.env.Publish(t, testenv.Subject, "k-three", fmt.Sprintf("copy-%d", i), payload(1))
	}
	cfg := b.config()
	cfg.BatchSize = 1 // each copy in its own transaction: only the inbox can fold them
	b.start(t, cfg)
	drained := b.env.Drained(t, effectName)
	testenv.Eventually(t, 45*time.Second, "all 3 copies settled", func() bool {
		return b.out.Get(idem.OutcomeProcessed)+b.out.Get(idem.OutcomeDuplicate) >= 3 && drained()
	})
	if n := b.env.Effects(t, "k-three"); n != 1 {
		t.Fatalf("effects = %d, want 1", n)
	}
	if n := b.out.Get(idem.OutcomeProcessed); n != 1 {
		t.Errorf("processed = %d, want 1", n)
	}
	// At least: a copy redelivered after its AckWait under load folds once more.
	if got := b.out.Get(idem.OutcomeDuplicate); got < 2 {
		t.Errorf("duplicates folded = %d, want at least 2", got)
	}
}

// Copies of one key inside one batch are folded too: the first is claimed and run,
// the others are duplicates of it.
func TestSameKeyInOneBatchLandsOnce(t *testing.T) {
	b := setup(t)
	for i := range 3 {
		b.env.Publish(t, testenv.Subject, "k-batch", fmt.Sprintf("copy-%d", i), payload(1))
	}
	b.env.Publish(t, testenv.Subject, "k-other", "other", payload(2))
	cfg := b.config()
	cfg.BatchSize = 10
	consumer.SetLinger(&cfg, 500*time.Millisecond) // gather all four in one batch
	b.start(t, cfg)
	drained := b.env.Drained(t, effectName)
	testenv.Eventually(t, 45*time.Second, "every copy settled", func() bool {
		return b.out.Get(idem.OutcomeProcessed)+b.out.Get(idem.OutcomeDuplicate) >= 4 && drained()
	})
	if n := b.out.Get(idem.OutcomeProcessed); n != 2 {
		t.Errorf("processed = %d, want 2", n)
	}
	if n, m := b.env.Effects(t, "k-batch"), b.env.Effects(t, "k-other"); n != 1 || m != 1 {
		t.Fatalf("effects k-batch=%d k-other=%d, want 1 and 1", n, m)
	}
	if got := b.out.Get(idem.OutcomeDuplicate); got < 2 {
		t.Errorf("duplicates folded = %d, want at least 2", got)
	}
}

// Negative control: with the inbox claim switched off, the same three copies land
// three effects. This is the test that goes red for the mechanism above.
func TestWithoutInboxClaimCopiesDouble(t *testing.T) {
	b := setup(t)
	for i := range 3 {
		b.env.Publish(t, testenv.Subject, "k-unsafe", fmt.Sprintf("copy-%d", i), payload(1))
	}
	cfg := b.config()
	cfg.BatchSize = 1 // one copy per transaction, as three separate deliveries would be
	b.startCtx(t, faults.With(context.Background(), faults.New().Switch(faults.SkipInboxClaim)), cfg)
	testenv.Eventually(t, 45*time.Second, "3 deliveries processed", func() bool {
		return b.out.Get(idem.OutcomeProcessed) >= 3
	})
	if n := b.env.Effects(t, "k-unsafe"); n < 3 {
		t.Fatalf("effects without the claim = %d, want at least 3 (the negative control must double)", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_inbox`); n != 0 {
		t.Errorf("inbox rows with the claim switched off = %d, want 0", n)
	}
}

// The consumer dies after COMMIT and before the ack: JetStream redelivers to the
// next worker, which finds the key claimed and folds the delivery.
func TestRedeliveryAfterCommitBeforeAckIsDuplicate(t *testing.T) {
	b := setup(t)
	b.env.Publish(t, testenv.Subject, "k-crash", "k-crash", payload(1))

	var died atomic.Bool
	dying := faults.With(context.Background(), faults.New().Func(faults.ConsumerAfterCommit, func(context.Context, []string) error {
		died.Store(true)
		return errors.New("fault: worker died after commit, before ack")
	}))
	stop := b.startCtx(t, dying, b.config())
	testenv.Eventually(t, 45*time.Second, "first worker to commit and die", died.Load)
	stop()
	if n := b.env.Effects(t, "k-crash"); n != 1 {
		t.Fatalf("after the crash: effects = %d, want 1 (committed)", n)
	}
	if n := b.out.Get(idem.OutcomeAbandoned); n < 1 {
		t.Errorf("abandoned outcomes = %d, want at least 1", n)
	}

	b.start(t, b.config()) // the next worker, same durable consumer
	drained := b.env.Drained(t, effectName)
	testenv.Eventually(t, 45*time.Second, "the redelivery settled", func() bool {
		return b.out.Get(idem.OutcomeDuplicate)+b.out.Get(idem.OutcomeProcessed) >= 1 && drained()
	})
	if n := b.env.Effects(t, "k-crash"); n != 1 {
		t.Fatalf("after redelivery: effects = %d, want 1", n)
	}
	if n := b.out.Get(idem.OutcomeDuplicate); n < 1 {
		t.Errorf("duplicates = %d, want the redelivery folded", n)
	}
	if n := b.out.Get(idem.OutcomeProcessed); n != 0 {
		t.Errorf("processed outcomes = %d, want 0: the only commit was abandoned before its ack", n)
	}
}

// The consumer dies after the handler ran and before COMMIT: the claim and the
// effect roll back together, and the redelivery runs the effect, once.
func TestCrashBeforeCommitLosesClaimAndEffect(t *testing.T) {
	b := setup(t)
	b.env.Publish(t, testenv.Subject, "k-before", "k-before", payload(1))

	var hits atomic.Int32
	var seenBefore atomic.Int64
	ctx := faults.With(context.Background(), faults.New().Func(faults.EffectBeforeCommit, func(context.Context, []string) error {
		if hits.Add(1) > 1 {
			return nil
		}
		// What another connection sees at this instant: nothing of this batch.
		var n int64 = -1
		_ = b.env.DB.Pool.QueryRow(context.Background(),
			`SELECT (SELECT count(*) FROM test_effects) + (SELECT count(*) FROM idem_inbox)`).Scan(&n)
		seenBefore.Store(n)
		return errors.New("fault: worker died before commit")
	}))
	b.startCtx(t, ctx, b.config())
	drained := b.env.Drained(t, effectName)
	testenv.Eventually(t, 45*time.Second, "the redelivery processed", func() bool {
		return b.out.Get(idem.OutcomeProcessed) == 1 && drained()
	})
	if n := seenBefore.Load(); n != 0 {
		t.Errorf("rows visible before the commit = %d, want 0", n)
	}
	if n := b.env.Effects(t, "k-before"); n != 1 {
		t.Fatalf("effects = %d, want 1: the rolled-back attempt left nothing, the redelivery ran once", n)
	}
	if n := b.out.Get(idem.OutcomeAbandoned); n != 1 {
		t.Errorf("abandoned outcomes = %d, want 1 (the rolled-back attempt, left for its AckWait)", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = 'k-before'`); n != 1 {
		t.Errorf("inbox rows = %d, want 1", n)
	}
}

// Two workers on one durable consumer race on redelivered copies: several copies of
// each key, short AckWait, and a share of batches abandoned after commit so copies
// are redelivered while the other worker is busy. Every key lands exactly once.
func TestTwoWorkersRacingOnRedeliveries(t *testing.T) {
	b := setup(t)
	const keys, copies = 150, 3
	for c := range copies {
		for k := range keys {
			key := fmt.Sprintf("race-%03d", k)
			b.env.Publish(t, testenv.Subject, key, fmt.Sprintf("%s/%d", key, c), payload(k))
		}
	}
	var batches atomic.Int64
	ctx := faults.With(context.Background(), faults.New().Func(faults.ConsumerAfterCommit, func(context.Context, []string) error {
		if batches.Add(1)%4 == 0 {
			return errors.New("fault: batch left unacked")
		}
		return nil
	}))
	cfg := b.config()
	cfg.BatchSize = 20
	cfg.AckWait = 500 * time.Millisecond
	b.startCtx(t, ctx, cfg)
	b.startCtx(t, ctx, cfg)
	drained := b.env.Drained(t, effectName)
	testenv.Eventually(t, 60*time.Second, "every copy acked", func() bool {
		return b.out.Get(idem.OutcomeProcessed)+b.out.Get(idem.OutcomeDuplicate) >= keys*copies &&
			b.env.DB.Count(t, `SELECT count(DISTINCT key) FROM test_effects`) == keys && drained()
	})
	if n := b.env.AllEffects(t); n != keys {
		t.Fatalf("effects = %d, want %d (one per key)", n, keys)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM (SELECT 1 FROM test_effects GROUP BY key HAVING count(*) > 1) d`); n != 0 {
		t.Fatalf("%d keys have more than one effect", n)
	}
	if n := b.out.Get(idem.OutcomeAbandoned); n == 0 {
		t.Error("no batch was abandoned: the race was not exercised")
	}
	t.Logf("processed=%d duplicates=%d abandoned=%d", b.out.Get(idem.OutcomeProcessed), b.out.Get(idem.OutcomeDuplicate), b.out.Get(idem.OutcomeAbandoned))
}

// idem's tables in a schema of their own, end to end: keys are claimed and poison
// filed in that schema's tables, and nothing is written to public's.
func TestConsumerInOtherSchema(t *testing.T) {
	t.Parallel()
	const schema = "idem_app"
	env := testenv.NewWith(t, pgtest.Options{Schema: schema})
	out := &testenv.Outcomes{}
	for i := range 3 {
		env.Publish(t, testenv.Subject, "k-schema", fmt.Sprintf("copy-%d", i), payload(1))
	}
	env.Publish(t, testenv.Subject, "", "no-key", payload(2)) // poison: no key
	cfg := testenv.ConsumerConfig(effectName)
	cfg.BatchSize = 1
	c, err := consumer.New(env.Observed(t, out.Observe), cfg)
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, "consumer", c.Run)
	drained := env.Drained(t, effectName)
	testenv.Eventually(t, 45*time.Second, "every message settled", func() bool {
		return out.Get(idem.OutcomeProcessed)+out.Get(idem.OutcomeDuplicate) >= 3 && out.Get(idem.OutcomeDeadLettered) == 1 && drained()
	})
	if n := env.Effects(t, "k-schema"); n != 1 {
		t.Fatalf("effects = %d, want 1: the inbox in %s must fold the copies", n, schema)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM `+schema+`.idem_inbox WHERE consumer = $1 AND key = 'k-schema'`, effectName); n != 1 {
		t.Errorf("%s.idem_inbox rows = %d, want 1", schema, n)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM `+schema+`.idem_dead_letters WHERE reason LIKE 'missing Idempotency-Key%'`); n != 1 {
		t.Errorf("%s.idem_dead_letters rows = %d, want 1", schema, n)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE 'idem_%'`); n != 0 {
		t.Errorf("public holds %d idem tables, want none", n)
	}
	dls := deadletter.New(env.Inst)
	if list, err := dls.List(context.Background(), 10); err != nil || len(list) != 1 {
		t.Errorf("DeadLetters(%s).List = %d, %v; want the one dead letter", schema, len(list), err)
	}
}
