package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testkit/tcpproxy"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// proxiedPool is a pool to the test's database through a TCP proxy, so one
// consumer's database can fail while the test's own connections keep working.
func proxiedPool(t *testing.T, env *testenv.Env) (*pgxpool.Pool, *tcpproxy.Proxy) {
	t.Helper()
	u, err := url.Parse(env.DB.URL)
	if err != nil {
		t.Fatal(err)
	}
	p, err := tcpproxy.New(u.Host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	u.Host = p.Addr()
	q := u.Query()
	q.Set("connect_timeout", "2")
	u.RawQuery = q.Encode()
	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, p
}

// A database outage is not the messages' fault. Twenty messages arrive while
// the consumer's Postgres refuses every connection for several AckWaits; the
// consumer holds them and waits, instead of naking them into redeliveries that use
// up MaxDeliver. When the database is back every one of them takes effect, once,
// and none is dead-lettered.
func TestDatabaseOutageDeadLettersNothing(t *testing.T) {
	b := setup(t)
	pool, proxy := proxiedPool(t, b.env)
	cfg := b.config()
	cfg.MaxDeliver, cfg.AckWait = 3, time.Second
	c, err := consumer.New(b.through(t, pool, b.env.NC), cfg)
	if err != nil {
		t.Fatal(err)
	}
	proxy.Refuse()
	testenv.Go(t, "consumer", c.Run)
	for i := range 20 {
		b.env.Publish(t, testenv.Subject, fmt.Sprintf("k-outage-%02d", i), "", payload(i))
	}
	// Five AckWaits with the database gone: a consumer that naked each message
	// every Backoff(1) would dead-letter them all past MaxDeliver.
	time.Sleep(5 * time.Second) // the outage itself: what is being waited out, not a condition
	proxy.Restore()
	drained := b.env.Drained(t, effectName)
	testenv.Eventually(t, 60*time.Second, "all twenty processed after the outage", func() bool {
		return b.env.AllEffects(t) == 20 && drained()
	})
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d healthy messages dead-lettered by a database outage", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(DISTINCT key) FROM test_effects`); n != 20 {
		t.Fatalf("distinct effects = %d, want 20", n)
	}
	if n := b.out.Get(idem.OutcomeFailed); n != 0 {
		t.Errorf("%d naks while the database was down, want none: the consumer waits, it does not storm", n)
	}
}

// For external effects: the lease cannot be taken while the database is down;
// the delivery waits for it instead of being naked, and the effect happens once.
func TestDatabaseOutageDelaysAnExternalEffect(t *testing.T) {
	b := setup(t)
	pool, proxy := proxiedPool(t, b.env)
	var performed atomic.Int32
	cfg := consumer.Config{
		Name: "mail", Subject: testenv.Subject, MaxDeliver: 2,
		AckWait: time.Second, LeaseFor: time.Second, Backoff: func(int) time.Duration { return 50 * time.Millisecond },
		External: consumer.ExternalHandlerFunc(func(context.Context, *consumer.Effect) ([]byte, error) {
			performed.Add(1)
			return nil, nil
		}),
	}
	c, err := consumer.New(b.through(t, pool, b.env.NC), cfg)
	if err != nil {
		t.Fatal(err)
	}
	proxy.Refuse()
	testenv.Go(t, "consumer", c.Run)
	b.env.Publish(t, testenv.Subject, "k-ext-outage", "", payload(1))
	time.Sleep(4 * time.Second) // the outage
	proxy.Restore()
	testenv.Eventually(t, 45*time.Second, "the effect performed after the outage", func() bool {
		return b.out.Get(idem.OutcomeProcessed) == 1
	})
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters`); n != 0 {
		t.Fatalf("%d dead letters after a database outage", n)
	}
	if n := b.out.Get(idem.OutcomeFailed); n != 0 {
		t.Errorf("%d naks while the database was down, want none: the consumer waits, it does not storm", n)
	}
	if n := performed.Load(); n != 1 {
		t.Fatalf("performed %d times, want 1", n)
	}
}

// A handler that panics is recovered. Its message fails alone (charged, then
// dead-lettered past MaxDeliver, with the panic as the reason) and its batch-mates
// are processed; the worker keeps running.
func TestPanickingHandlerFailsAlone(t *testing.T) {
	b := setup(t)
	var calls atomic.Int32
	cfg := b.config()
	cfg.MaxDeliver = 2
	consumer.SetLinger(&cfg, 200*time.Millisecond) // one batch for all six
	cfg.BatchHandler = batchFunc(func(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
		calls.Add(1)
		for _, d := range ds {
			if d.Key == "k-panic" {
				panic("the handler's bug")
			}
		}
		return testenv.Effect{}.HandleBatch(ctx, tx, ds)
	})
	for i := range 5 {
		b.env.Publish(t, testenv.Subject, fmt.Sprintf("k-mate-%d", i), "", payload(i))
	}
	b.env.Publish(t, testenv.Subject, "k-panic", "", payload(99))
	b.start(t, cfg)
	drained := b.env.Drained(t, effectName)
	testenv.Eventually(t, 45*time.Second, "the batch-mates processed and the panicking one dead-lettered", func() bool {
		return b.env.AllEffects(t) == 5 && drained()
	})
	var reason string
	if err := b.env.DB.Pool.QueryRow(context.Background(), `SELECT reason FROM idem_dead_letters WHERE key = 'k-panic'`).Scan(&reason); err != nil {
		t.Fatalf("the panicking message is not dead-lettered: %v", err)
	}
	if !strings.Contains(reason, "panicked") {
		t.Errorf("reason %q does not say the handler panicked", reason)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters`); n != 1 {
		t.Errorf("dead letters = %d, want only the panicking message", n)
	}
}

// batchFunc adapts a function to consumer.BatchHandler.
type batchFunc func(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error)

func (f batchFunc) HandleBatch(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
	return f(ctx, tx, ds)
}

// Under a crash loop: one message kills its worker every time it runs (here the
// fault point abandons its batch as a SIGKILL would). Its redeliveries run alone and
// are charged in Postgres; it is dead-lettered past MaxDeliver, and the messages that
// shared its first, crashed batch are processed on their next delivery instead of
// being dead-lettered with it.
func TestCrashLoopChargesOnlyTheCrasher(t *testing.T) {
	b := setup(t)
	cfg := b.config()
	cfg.MaxDeliver, cfg.AckWait = 3, 500*time.Millisecond
	consumer.SetLinger(&cfg, 200*time.Millisecond)
	var crashes atomic.Int32
	ctx := faults.With(context.Background(), faults.New().Func(faults.EffectBeforeCommit, func(_ context.Context, keys []string) error {
		for _, k := range keys {
			if k == "k-crash" {
				crashes.Add(1)
				return errors.New("fault: the worker dies on this message")
			}
		}
		return nil
	}))
	for i := range 4 {
		b.env.Publish(t, testenv.Subject, fmt.Sprintf("k-mate-%d", i), "", payload(i))
	}
	b.env.Publish(t, testenv.Subject, "k-crash", "", payload(99))
	b.startCtx(t, ctx, cfg)
	testenv.Eventually(t, 60*time.Second, "the crasher dead-lettered", func() bool {
		return b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'k-crash'`) == 1
	})
	testenv.Eventually(t, 45*time.Second, "the batch-mates processed", func() bool {
		return b.env.AllEffects(t) == 4
	})
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters`); n != 1 {
		t.Errorf("dead letters = %d, want only the crasher", n)
	}
	if n := b.env.DB.Count(t, `SELECT attempts FROM idem_attempts WHERE consumer = $1 AND key = 'k-crash'`, effectName); n != cfg.MaxDeliver+1 {
		t.Errorf("charged attempts = %d, want %d (MaxDeliver crashes, then the start that found them used up)", n, cfg.MaxDeliver+1)
	}
	t.Logf("crashes: %d", crashes.Load())
}

// A lease holder cut off from its database (and its broker: a partitioned or
// paused worker) stops its own effect before its lease can have run out, by its own
// clock, so the worker that takes the key over never performs at the same time.
func TestLeaseHolderStopsBeforeItsLeaseEnds(t *testing.T) {
	b := setup(t)
	stalledDB, dbProxy := proxiedPool(t, b.env)
	natsURL, err := url.Parse(b.env.NATS.URL())
	if err != nil {
		t.Fatal(err)
	}
	natsProxy, err := tcpproxy.New(natsURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { natsProxy.Close() })
	natsURL.Host = natsProxy.Addr() // the credential in the URL, if any, stays
	nc, err := nats.Connect(natsURL.String(), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)

	var mu sync.Mutex
	type span struct {
		worker     string
		start, end time.Time
		cause      error
	}
	var spans []span
	started := make(chan string, 4)
	perform := func(worker string) consumer.ExternalHandler {
		return consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
			s := span{worker: worker, start: time.Now()}
			started <- worker
			select {
			case <-ctx.Done(): // the lease was lost or is running out: stop
				s.cause = context.Cause(ctx)
			case <-time.After(4 * time.Second): // the work itself, longer than the lease
			}
			s.end = time.Now()
			mu.Lock()
			spans = append(spans, s)
			mu.Unlock()
			return nil, ctx.Err()
		})
	}
	cfg := func(worker string) consumer.Config {
		return consumer.Config{Name: "provider", Subject: testenv.Subject,
			LeaseFor: time.Second, AckWait: time.Second, Backoff: func(int) time.Duration { return 50 * time.Millisecond },
			External: perform(worker)}
	}
	a, err := consumer.New(b.through(t, stalledDB, nc), cfg("A"))
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, "worker A", a.Run)
	b.env.Publish(t, testenv.Subject, "k-lease", "m1", payload(1))
	if w := <-started; w != "A" {
		t.Fatalf("%s started first", w)
	}
	// A is cut off: no lease extension, no heartbeat reaches anyone.
	dbProxy.Pause()
	natsProxy.Pause()
	t.Cleanup(func() { dbProxy.Resume(); natsProxy.Resume() })
	bw, err := consumer.New(b.inst, cfg("B"))
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, "worker B", bw.Run)
	select {
	case w := <-started:
		if w != "B" {
			t.Fatalf("%s performed again", w)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("B never took over the expired lease")
	}
	testenv.Eventually(t, 30*time.Second, "both performs ended", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(spans) >= 2
	})
	mu.Lock()
	defer mu.Unlock()
	var sa, sb span
	for _, s := range spans {
		if s.worker == "A" {
			sa = s
		} else {
			sb = s
		}
	}
	if !sa.end.Before(sb.start) {
		t.Fatalf("A performed until %s and B started at %s: two workers performed at once", sa.end.Format(time.StampMilli), sb.start.Format(time.StampMilli))
	}
	if sa.cause == nil || !strings.Contains(sa.cause.Error(), "lease") {
		t.Errorf("A stopped with cause %v, want its lease running out", sa.cause)
	}
}

// Batches are bounded by bytes as well as by count.
func TestBatchesAreBoundedByBytes(t *testing.T) {
	b := setup(t)
	var biggest atomic.Int64
	cfg := b.config()
	cfg.MaxBatchBytes = 300 << 10
	consumer.SetLinger(&cfg, 300*time.Millisecond)
	cfg.BatchHandler = batchFunc(func(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
		var n int64
		for _, d := range ds {
			n += int64(len(d.Payload))
		}
		if n > biggest.Load() {
			biggest.Store(n)
		}
		return testenv.Effect{}.HandleBatch(ctx, tx, ds)
	})
	big := []byte(strings.Repeat("x", 100<<10))
	for i := range 12 {
		b.env.Publish(t, testenv.Subject, fmt.Sprintf("k-big-%d", i), "", big)
	}
	b.start(t, cfg)
	testenv.Eventually(t, 45*time.Second, "all processed", func() bool { return b.env.AllEffects(t) == 12 })
	if n := biggest.Load(); n > 300<<10 {
		t.Fatalf("a batch held %d payload bytes, MaxBatchBytes is %d", n, 300<<10)
	}
}

// A performed effect is recorded even when the lease's safety timer cancelled it
// while the database stalled: nobody took the key over, so the holder's token still
// holds, and the completion is written once the database answers. Recording nothing
// would let the next delivery take the expired lease over and perform the effect a
// second time.
func TestPerformedEffectIsRecordedAfterTheFenceFired(t *testing.T) {
	b := setup(t)
	stalledDB, dbProxy := proxiedPool(t, b.env)
	t.Cleanup(dbProxy.Resume)
	var log effectLog
	cancelled := make(chan error, 4)
	h := consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		log.record(e)
		if len(log.of(e.Key)) == 1 {
			dbProxy.Pause() // the database stalls once the effect has happened
			<-ctx.Done()    // no extension gets through: the fence cancels Perform
			cancelled <- context.Cause(ctx)
		}
		return []byte(`"sent"`), nil // the effect did happen
	})
	cfg := b.extConfig(h)
	cfg.LeaseFor, cfg.AckWait = time.Second, 10*time.Second
	c, err := consumer.New(b.through(t, stalledDB, b.env.NC), cfg)
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, "worker", c.Run)
	b.env.Publish(t, testenv.Subject, "k-fenced", "m1", payload(1))
	select {
	case cause := <-cancelled:
		if cause == nil || !strings.Contains(cause.Error(), "lease") {
			t.Fatalf("Perform cancelled with %v, want the lease running out", cause)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the fence never cancelled Perform")
	}
	// The lease has run out by the database's clock before the database answers.
	testenv.Eventually(t, 10*time.Second, "the lease expired", func() bool {
		return b.env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = 'k-fenced' AND lease_until < now()`) == 1
	})
	dbProxy.Resume()

	drained := b.env.Drained(t, extName)
	testenv.Eventually(t, 45*time.Second, "recorded and acked", func() bool {
		status, _, _ := inboxRow(t, b, "k-fenced")
		return status == "done" && drained()
	})
	if n := log.count("k-fenced"); n != 1 {
		t.Fatalf("performs = %d, want 1: the performed effect was not recorded, and was performed again", n)
	}
}
