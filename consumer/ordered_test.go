package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// The ordered tests' topology: ordering keys hashed over ordParts partitions of
// ordSubject (test.ord.0, test.ord.1, ...).
const (
	ordSubject = "test.ord"
	ordParts   = 3
)

// ordMsg is one message of an ordering key: its seq-th, counted from 1.
type ordMsg struct {
	Key string `json:"k"`
	Seq int    `json:"s"`
}

func (m ordMsg) idemKey() string { return fmt.Sprintf("%s-%d", m.Key, m.Seq) }
func (m ordMsg) subject() string { return outbox.Partition(ordSubject, m.Key, ordParts) }

// ordEffect applies a message by recording, in one row, its key, its seq and the
// key's highest seq applied before it (prev): applied in order and once, every row
// has prev = seq-1 and (key, seq) is unique. hook, when set, runs first and may
// fail the delivery.
type ordEffect struct {
	hook func(m ordMsg) error
}

const sqlCreateOrdEffects = `CREATE TABLE public.ord_effects (key text NOT NULL, seq int NOT NULL, prev int NOT NULL)`

func (e ordEffect) Handle(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
	var m ordMsg
	if err := json.Unmarshal(d.Payload, &m); err != nil {
		return nil, consumer.Permanent(err)
	}
	if e.hook != nil {
		if err := e.hook(m); err != nil {
			return nil, err
		}
	}
	_, err := tx.Exec(ctx, `INSERT INTO public.ord_effects (key, seq, prev)
		SELECT $1, $2, COALESCE((SELECT max(seq) FROM public.ord_effects WHERE key = $1), 0)`, m.Key, m.Seq)
	return nil, err
}

// ordWorld is a test environment with the ord_effects table and a publisher.
type ordWorld struct {
	env  *testenv.Env
	msgs []ordMsg // in publish (stream) order
}

func newOrdWorld(t *testing.T) *ordWorld {
	t.Helper()
	t.Parallel()
	w := &ordWorld{env: testenv.New(t)}
	if _, err := w.env.DB.Pool.Exec(context.Background(), sqlCreateOrdEffects); err != nil {
		t.Fatal(err)
	}
	return w
}

// publish publishes rounds messages of every key, interleaved: round 1 of every
// key, then round 2, and so on.
func (w *ordWorld) publish(t *testing.T, keys []string, rounds int) {
	t.Helper()
	for s := 1; s <= rounds; s++ {
		for _, k := range keys {
			m := ordMsg{Key: k, Seq: s}
			body, _ := json.Marshal(m)
			w.env.Publish(t, m.subject(), m.idemKey(), m.idemKey(), body)
			w.msgs = append(w.msgs, m)
		}
	}
}

// start runs the ordered consumers of every partition, each twice (two workers
// sharing each partition's durable consumer), with h as their handler.
func (w *ordWorld) start(t *testing.T, ctx context.Context, h consumer.Handler, tune func(*consumer.Config)) {
	t.Helper()
	base := consumer.Config{Name: "ord", Subject: ordSubject, Handler: h,
		AckWait: 2 * time.Second, Backoff: func(int) time.Duration { return 200 * time.Millisecond }}
	if tune != nil {
		tune(&base)
	}
	cfgs, err := consumer.Partitioned(base, ordParts)
	if err != nil {
		t.Fatal(err)
	}
	for _, cfg := range cfgs {
		for range 2 {
			c, err := consumer.New(w.env.Inst, cfg)
			if err != nil {
				t.Fatal(err)
			}
			testenv.GoCtx(t, ctx, "consumer "+cfg.Name, c.Run)
		}
	}
}

func (w *ordWorld) applied(t *testing.T, m ordMsg) bool {
	return w.env.DB.Count(t, `SELECT count(*) FROM public.ord_effects WHERE key = $1 AND seq = $2`, m.Key, m.Seq) > 0
}

// checkOrder fails t for any key applied out of order (prev is not the seq before,
// skipping the seqs in gaps: dead-lettered ones) or more than once.
func (w *ordWorld) checkOrder(t *testing.T, gaps map[ordMsg]bool) {
	t.Helper()
	rows, err := w.env.DB.Pool.Query(context.Background(), `SELECT key, seq, prev FROM public.ord_effects ORDER BY key, seq`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		key       string
		seq, prev int
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		return x, r.Scan(&x.key, &x.seq, &x.prev)
	})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[ordMsg]int{}
	for _, r := range got {
		m := ordMsg{r.key, r.seq}
		seen[m]++
		want := r.seq - 1
		for want > 0 && gaps[ordMsg{r.key, want}] {
			want--
		}
		if r.prev != want {
			t.Errorf("key %s: seq %d applied after seq %d, want after %d (out of order)", r.key, r.seq, r.prev, want)
		}
	}
	for _, m := range w.msgs {
		if n := seen[m]; !gaps[m] && n != 1 {
			t.Errorf("key %s seq %d applied %d times, want once", m.Key, m.Seq, n)
		}
	}
}

// keysPerPartition returns n ordering keys for each partition, so that every
// partition carries several keys.
func keysPerPartition(n int) (keys []string, part map[string]string) {
	part = map[string]string{}
	count := map[string]int{}
	for i := 0; len(keys) < n*ordParts; i++ {
		k := fmt.Sprintf("order-%d", i)
		p := outbox.Partition(ordSubject, k, ordParts)
		if count[p] < n {
			count[p]++
			keys, part[k] = append(keys, k), p
		}
	}
	return keys, part
}

// A poison message blocks its partition — every later message of that partition
// waits, whatever its key — while the other partitions proceed; once it is
// dead-lettered (MaxDeliver) the partition continues, in order.
//
// Mutation check: without Ordered (Partitioned not setting it), the messages
// behind the poison are applied while it is still being retried, and this fails.
func TestOrderedPoisonBlocksItsPartitionUntilDeadLettered(t *testing.T) {
	w := newOrdWorld(t)
	keys, part := keysPerPartition(3)
	poison := ordMsg{Key: keys[0], Seq: 2}
	blocked := part[poison.Key]
	w.publish(t, keys, 4)

	var mu sync.Mutex
	calls := 0
	reached := make(chan struct{})
	release := make(chan struct{})
	w.start(t, context.Background(), ordEffect{hook: func(m ordMsg) error {
		if m != poison {
			return nil
		}
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		if n == 2 { // the second attempt holds its partition until the test has looked
			close(reached)
			<-release
		}
		return errors.New("poison: this message always fails")
	}}, func(c *consumer.Config) { c.MaxDeliver = 3 })
	var released sync.Once
	unblock := func() { released.Do(func() { close(release) }) }
	t.Cleanup(unblock) // runs before the consumers are stopped: a failed test must not leave the handler blocked

	// Everything before the poison in its partition, and every other partition,
	// is applied while the poison is being retried.
	var before, after []ordMsg
	for i, m := range w.msgs {
		switch {
		case m.subject() != blocked:
		case i < slices.Index(w.msgs, poison):
			before = append(before, m)
		case m != poison:
			after = append(after, m)
		}
	}
	select {
	case <-reached:
	case <-time.After(60 * time.Second):
		t.Fatal("the poison was not retried")
	}
	testenv.Eventually(t, 60*time.Second, "the other partitions and the poison's predecessors applied", func() bool {
		for _, m := range w.msgs {
			if (m.subject() != blocked || slices.Contains(before, m)) && !w.applied(t, m) {
				return false
			}
		}
		return true
	})
	for _, m := range after {
		if w.applied(t, m) {
			t.Errorf("key %s seq %d (partition %s) applied while the poison ahead of it was still being retried", m.Key, m.Seq, blocked)
		}
	}
	unblock()

	// Dead-lettered after MaxDeliver, then the partition continues.
	testenv.Eventually(t, 60*time.Second, "the blocked partition to continue", func() bool {
		for _, m := range after {
			if !w.applied(t, m) {
				return false
			}
		}
		return true
	})
	if n := w.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = $1 AND consumer = $2`,
		poison.idemKey(), "ord-"+blocked[len(ordSubject)+1:]); n != 1 {
		t.Errorf("poison dead letters = %d, want 1", n)
	}
	w.checkOrder(t, map[ordMsg]bool{poison: true})
}

// A redelivery does not reorder: a handler error then success (the message comes
// back after its backoff, and nothing of its partition runs meanwhile), and a lost
// ack (the effect committed, the ack never sent: JetStream redelivers after
// AckWait and the inbox folds it) both leave every key applied in order, once.
//
// Mutation check: without Ordered, the failed message is retried after its
// batch-mates committed, so its successor is applied first, and this fails.
func TestOrderedRedeliveryDoesNotReorder(t *testing.T) {
	w := newOrdWorld(t)
	keys, _ := keysPerPartition(3)
	w.publish(t, keys, 5)
	flaky := ordMsg{Key: keys[1], Seq: 2}
	ackLost := ordMsg{Key: keys[2], Seq: 3}

	var mu sync.Mutex
	failed, dropped := false, false
	fs := faults.New().Func(faults.ConsumerAfterCommit, func(_ context.Context, ks []string) error {
		mu.Lock()
		defer mu.Unlock()
		if !dropped && slices.Contains(ks, ackLost.idemKey()) {
			dropped = true
			return errors.New("ack lost (fault point)")
		}
		return nil
	})
	w.start(t, faults.With(context.Background(), fs), ordEffect{hook: func(m ordMsg) error {
		mu.Lock()
		defer mu.Unlock()
		if m == flaky && !failed {
			failed = true
			return errors.New("transient: fails once")
		}
		return nil
	}}, func(c *consumer.Config) { c.AckWait = time.Second })

	testenv.Eventually(t, 90*time.Second, "every message applied", func() bool {
		return w.env.DB.Count(t, `SELECT count(DISTINCT (key, seq)) FROM public.ord_effects`) == len(w.msgs)
	})
	for _, p := range outbox.PartitionSubjects(ordSubject, ordParts) {
		testenv.Eventually(t, 60*time.Second, "partition "+p+" drained", w.env.Drained(t, "ord-"+p[len(ordSubject)+1:]))
	}
	mu.Lock()
	if !failed || !dropped {
		t.Errorf("the faults did not fire: handler error %v, ack lost %v", failed, dropped)
	}
	mu.Unlock()
	w.checkOrder(t, nil)
}

// Partitioned builds one ordered consumer per partition subject, on exactly the
// subjects outbox.Partition maps keys to, and refuses what would break the order.
func TestPartitioned(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	h := ordEffect{}
	base := consumer.Config{Name: "orders", Subject: "orders.events", Handler: h}
	cfgs, err := consumer.Partitioned(base, 4)
	if err != nil {
		t.Fatal(err)
	}
	subjects := outbox.PartitionSubjects("orders.events", 4)
	for p, c := range cfgs {
		if c.Name != fmt.Sprintf("orders-%d", p) || c.Subject != subjects[p] || !c.Ordered {
			t.Errorf("partition %d: %s on %s, ordered %v", p, c.Name, c.Subject, c.Ordered)
		}
		pc, err := consumer.New(env.Inst, c)
		if err != nil {
			t.Fatalf("partition %d: %v", p, err)
		}
		if d, ack := c.WithDefaults(), pc.JetStreamConfig().MaxAckPending; ack != 1 || d.Concurrency != 1 || d.BatchSize != 1 {
			t.Errorf("partition %d: MaxAckPending %d, Concurrency %d, BatchSize %d; want 1, 1, 1", p, ack, d.Concurrency, d.BatchSize)
		}
	}
	for i := range 100 {
		k := fmt.Sprintf("key-%d", i)
		if s := outbox.Partition("orders.events", k, 4); !slices.Contains(subjects, s) {
			t.Fatalf("Partition(%s) = %s, not a partition subject", k, s)
		}
	}
	for name, mut := range map[string]func(*consumer.Config){
		"wildcard subject": func(c *consumer.Config) { c.Subject = "orders.*" },
		"batch":            func(c *consumer.Config) { c.BatchSize = 10 },
		"concurrency":      func(c *consumer.Config) { c.Concurrency = 2 },
	} {
		c := base
		mut(&c)
		if _, err := consumer.Partitioned(c, 4); err == nil {
			t.Errorf("%s: Partitioned accepted it", name)
		}
	}
	if _, err := consumer.Partitioned(base, 0); err == nil {
		t.Error("Partitioned accepted 0 partitions")
	}
	if _, err := consumer.New(env.Inst, consumer.Config{Name: "o", Subject: "a.b", Handler: h, Ordered: true, Concurrency: 2}); err == nil {
		t.Error("New accepted an Ordered consumer with Concurrency 2")
	}
}
