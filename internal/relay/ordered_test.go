package relay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// The ordered tests' topology: ordering keys hashed over partitions of ordSubject
// (test.ord.0, ...), which the relays order.
const ordSubject = "test.ord"

var ordFilters = []string{ordSubject + ".*"}

// ordMsg is the seq-th message (from 1) of an ordering key.
type ordMsg struct {
	Key string `json:"k"`
	Seq int    `json:"s"`
}

func (m ordMsg) idemKey() string { return fmt.Sprintf("%s-%d", m.Key, m.Seq) }

func (m ordMsg) message(parts int) idem.Message {
	body, _ := json.Marshal(m)
	return idem.Message{Key: m.idemKey(), Subject: outbox.Partition(ordSubject, m.Key, parts), Payload: body}
}

// ordEffect records each message applied with the key's highest seq applied before
// it: applied in order and once, every row has prev = seq-1, (key, seq) unique.
var ordEffect = consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
	var m ordMsg
	if err := json.Unmarshal(d.Payload, &m); err != nil {
		return nil, consumer.Permanent(err)
	}
	_, err := tx.Exec(ctx, `INSERT INTO public.ord_effects (key, seq, prev)
		SELECT $1, $2, COALESCE((SELECT max(seq) FROM public.ord_effects WHERE key = $1), 0)`, m.Key, m.Seq)
	return nil, err
})

func newOrdEnv(t *testing.T) *testenv.Env {
	t.Helper()
	env := testenv.New(t)
	if _, err := env.DB.Pool.Exec(context.Background(), `CREATE TABLE public.ord_effects (key text NOT NULL, seq int NOT NULL, prev int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return env
}

// Many keys interleaved over a few partitions, several producers, two relays and,
// for each partition, an ordered consumer run by two workers: every key's messages
// are applied in the order they were enqueued, each exactly once, while an
// unordered subject shares the relays.
//
// Mutation checks: with the relays' OrderedSubjects removed (two relays publishing
// concurrent SKIP LOCKED batches of 8), or the consumers not Ordered, keys are
// applied out of order and this fails.
func TestOrderedEndToEnd(t *testing.T) {
	t.Parallel()
	env := newOrdEnv(t)
	const (
		parts     = 4
		producers = 4
		keys      = 32 // keys%producers == 0: each key has one producer, its writer
		rounds    = 12
	)
	ob := outbox.New(env.Inst)
	for i := range 2 {
		// Each relay on its own connection and installation, as two processes
		// would be.
		nc, err := nats.Connect(env.NATS.URL())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		inst, err := install.New(env.DB.Pool, nc, install.Config{Stream: env.Inst.Stream()})
		if err != nil {
			t.Fatal(err)
		}
		r := newRelay(t, inst, relay.Config{BatchSize: 8, PollInterval: 20 * time.Millisecond, OrderedSubjects: ordFilters})
		testenv.Go(t, fmt.Sprintf("relay %d", i), r.Run)
	}
	cfgs, err := consumer.Partitioned(consumer.Config{Name: "ord", Subject: ordSubject,
		Handler: ordEffect, AckWait: 5 * time.Second}, parts)
	if err != nil {
		t.Fatal(err)
	}
	for _, cfg := range cfgs {
		for range 2 {
			c, err := consumer.New(env.Inst, cfg)
			if err != nil {
				t.Fatal(err)
			}
			testenv.Go(t, "consumer "+cfg.Name, c.Run)
		}
	}
	unordered := startConsumer(t, env, "unordered")

	// Each producer writes its keys' messages in bursts, one to three messages of
	// a key in a row (so a key's rows lie close together and two relays' batches
	// would split them), one or two messages per transaction, while the others
	// write theirs.
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, producers)
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var pending []idem.Message
			flush := func() error {
				if len(pending) == 0 {
					return nil
				}
				err := pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, pending...) })
				pending = pending[:0]
				return err
			}
			seq := map[int]int{}
			for s := 1; s <= rounds; s++ {
				for k := p; k < keys; k += producers {
					for range 1 + (k+s)%3 {
						if seq[k] == rounds {
							break
						}
						seq[k]++
						pending = append(pending, ordMsg{Key: fmt.Sprintf("order-%d", k), Seq: seq[k]}.message(parts))
						if len(pending) >= 1+(k+seq[k])%2 {
							if err := flush(); err != nil {
								errs <- err
								return
							}
						}
					}
				}
				if s%4 == 0 {
					pending = append(pending, idem.Message{Key: fmt.Sprintf("plain-%d-%d", p, s), Subject: testenv.Subject, Payload: []byte(`{}`)})
				}
			}
			if err := flush(); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	total := keys * rounds
	testenv.Eventually(t, 120*time.Second, "every ordered message applied", func() bool {
		return env.DB.Count(t, `SELECT count(DISTINCT (key, seq)) FROM public.ord_effects`) == total
	})
	testenv.Eventually(t, 60*time.Second, "the unordered subject consumed", func() bool {
		return unordered.Get(idem.OutcomeProcessed) >= producers*rounds/4
	})
	if n := env.DB.Count(t, `SELECT count(*) FROM public.ord_effects WHERE prev <> seq - 1`); n != 0 {
		rows, _ := env.DB.Pool.Query(ctx, `SELECT key, seq, prev FROM public.ord_effects WHERE prev <> seq - 1 ORDER BY key, seq LIMIT 5`)
		bad, _ := pgx.CollectRows(rows, pgx.RowToMap)
		t.Errorf("%d messages applied out of order, e.g. %v", n, bad)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM public.ord_effects`); n != total {
		t.Errorf("%d effects for %d messages: not exactly once", n, total)
	}
}

// partitionOrder returns the keys of the stream's messages on subject, in stream
// order.
func partitionOrder(t *testing.T, env *testenv.Env, subject string) []string {
	t.Helper()
	s, err := env.JS.Stream(context.Background(), testenv.Stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(context.Background(), seq)
		if err != nil {
			t.Fatal(err)
		}
		if m.Subject == subject {
			keys = append(keys, m.Header.Get(idem.HeaderKey))
		}
	}
	return keys
}

func pending(t *testing.T, env *testenv.Env, key string) bool {
	return env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = $1 AND published_at IS NULL AND dead_lettered_at IS NULL`, key) == 1
}

// A row the broker refuses (while otherwise up) blocks only its partition: the
// rows behind it wait, uncharged, through its backoff, while the other partitions
// and the unordered subjects are published; once it is dead-lettered (MaxAttempts)
// its partition continues, in order.
//
// Mutation check: with the ordered claim replaced by the plain SKIP LOCKED claim
// (the partition rule gone), the rows behind the refused one are published at the
// first Drain and this fails.
func TestOrderedRelayFailedRowBlocksOnlyItsPartition(t *testing.T) {
	t.Parallel()
	env := newOrdEnv(t)
	ob := outbox.New(env.Inst)
	const a, b = ordSubject + ".0", ordSubject + ".1"
	row := func(key, subject string, h map[string]string) idem.Message {
		return idem.Message{Key: key, Subject: subject, Payload: []byte(`{}`), Headers: h}
	}
	enqueue(t, env.DB, ob, row("a1", a, nil), row("b1", b, nil))
	enqueue(t, env.DB, ob, row("a2", a, nil), row("b2", b, nil), row("plain-1", testenv.Subject, nil))
	// The broker refuses a2 every time: the subject's last sequence is not the one
	// it expects. Enqueue refuses the broker's headers, so the row gets its own
	// past the check.
	env.DB.Count(t, `WITH u AS (UPDATE idem_outbox SET headers = headers || '{"Nats-Expected-Last-Subject-Sequence": "999999"}' WHERE key = 'a2' RETURNING 1) SELECT count(*) FROM u`)
	enqueue(t, env.DB, ob, row("a3", a, nil), row("b3", b, nil))
	enqueue(t, env.DB, ob, row("a4", a, nil), row("plain-2", testenv.Subject, nil))

	r := newRelay(t, env.Inst, relay.Config{MaxAttempts: 2, OrderedSubjects: ordFilters,
		Backoff: func(int) time.Duration { return time.Hour }})
	ctx := context.Background()
	for range 2 { // the second Drain finds a's partition still blocked
		if _, err := r.Drain(ctx); err != nil {
			t.Fatal(err)
		}
		if got := partitionOrder(t, env, a); !slices.Equal(got, []string{"a1"}) {
			t.Fatalf("partition %s in the stream = %v, want [a1] while a2 is in its backoff", a, got)
		}
		if got := partitionOrder(t, env, b); !slices.Equal(got, []string{"b1", "b2", "b3"}) {
			t.Fatalf("partition %s in the stream = %v, want all of it", b, got)
		}
		if got := partitionOrder(t, env, testenv.Subject); !slices.Equal(got, []string{"plain-1", "plain-2"}) {
			t.Fatalf("unordered subject in the stream = %v, want all of it", got)
		}
		for _, k := range []string{"a2", "a3", "a4"} {
			if !pending(t, env, k) {
				t.Fatalf("%s is no longer pending", k)
			}
		}
		if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE key IN ('a3', 'a4') AND attempts > 0`); n != 0 {
			t.Fatalf("%d rows behind the refused one were charged an attempt", n)
		}
	}

	// Its backoff passes; the second refusal uses up MaxAttempts: dead-lettered,
	// and the partition continues in the same Drain.
	if _, err := env.DB.Pool.Exec(ctx, `UPDATE idem_outbox SET next_attempt_at = now() WHERE key = 'a2'`); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if got := partitionOrder(t, env, a); !slices.Equal(got, []string{"a1", "a3", "a4"}) {
		t.Fatalf("partition %s in the stream = %v, want [a1 a3 a4] after a2 was dead-lettered", a, got)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'a2' AND consumer = $1 AND reason LIKE '%wrong last sequence%'`, outbox.RelayConsumer); n != 1 {
		var reason string
		_ = env.DB.Pool.QueryRow(ctx, `SELECT COALESCE(max(reason), '') FROM idem_dead_letters`).Scan(&reason)
		t.Fatalf("a2's dead letters = %d, want 1 (reason %q)", n, reason)
	}
}

// Two relays never publish one partition at once: while one holds a partition
// (mid-batch, after its publish, before its commit), the other publishes every
// other partition and nothing of that one; after the first commits, the rest of
// the partition follows, in order.
//
// Mutation check: with the advisory lock removed from the partition claim, the
// second relay waits on the first's row locks (or, with SKIP LOCKED, takes the rows
// behind them) and this fails.
func TestOrderedRelaysDoNotShareAPartition(t *testing.T) {
	t.Parallel()
	env := newOrdEnv(t)
	ob := outbox.New(env.Inst)
	const a, b = ordSubject + ".0", ordSubject + ".1"
	for i := 1; i <= 3; i++ {
		enqueue(t, env.DB, ob, idem.Message{Key: fmt.Sprintf("a%d", i), Subject: a, Payload: []byte(`{}`)},
			idem.Message{Key: fmt.Sprintf("b%d", i), Subject: b, Payload: []byte(`{}`)})
	}
	held, release := make(chan struct{}), make(chan struct{})
	var once, released sync.Once
	unblock := func() { released.Do(func() { close(release) }) }
	t.Cleanup(unblock) // a failing test must not leave the first relay's transaction open
	fs := faults.New().Func(faults.RelayAfterPublish, func(_ context.Context, keys []string) error {
		if slices.Contains(keys, "a1") {
			once.Do(func() { close(held); <-release })
		}
		return nil
	})
	first := newRelay(t, env.Inst, relay.Config{BatchSize: 1, OrderedSubjects: ordFilters})
	second := newRelay(t, env.Inst, relay.Config{OrderedSubjects: ordFilters})
	done := make(chan error, 1)
	go func() {
		_, err := first.Drain(faults.With(context.Background(), fs))
		done <- err
	}()
	<-held // the first relay published a1 and holds partition a

	drained := make(chan error, 1)
	go func() {
		_, err := second.Drain(context.Background())
		drained <- err
	}()
	testenv.Eventually(t, 30*time.Second, "the second relay to publish partition b", func() bool {
		return !pending(t, env, "b1") && !pending(t, env, "b2") && !pending(t, env, "b3")
	})
	select {
	case err := <-drained:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the second relay's Drain did not return: it waited on the first's partition")
	}
	if got := partitionOrder(t, env, a); !slices.Equal(got, []string{"a1"}) {
		t.Fatalf("partition %s = %v while the first relay holds it, want [a1]", a, got)
	}
	if !pending(t, env, "a2") || !pending(t, env, "a3") {
		t.Fatal("the second relay took rows of a partition the first relay holds")
	}
	unblock()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := second.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := partitionOrder(t, env, a); !slices.Equal(got, []string{"a1", "a2", "a3"}) {
		t.Fatalf("partition %s = %v, want [a1 a2 a3]", a, got)
	}
}

// Partition is the hash nats-server's subject mapping uses for
// {{partition(n,1)}}: the same key lands in the same partition either way. The
// server's mapping is read back from a stream that transforms what it stores.
func TestPartitionMatchesTheServersMapping(t *testing.T) {
	t.Parallel()
	const n, keys = 7, 300
	ctx := context.Background()
	env := testenv.New(t)
	st, err := env.JS.CreateStream(ctx, jetstream.StreamConfig{Name: "PART", Subjects: []string{"orders.*"},
		SubjectTransform: &jetstream.SubjectTransformConfig{Source: "orders.*", Destination: fmt.Sprintf("orders.{{partition(%d,1)}}", n)}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range keys {
		if _, err := env.JS.Publish(ctx, fmt.Sprintf("orders.order_%d", i), nil); err != nil {
			t.Fatal(err)
		}
	}
	for i := range keys {
		m, err := st.GetMsg(ctx, uint64(i+1))
		if err != nil {
			t.Fatal(err)
		}
		if got := outbox.Partition("orders", fmt.Sprintf("order_%d", i), n); got != m.Subject {
			t.Fatalf("Partition(order_%d) = %s, the server maps it to %s", i, got, m.Subject)
		}
	}
	if got := outbox.PartitionSubjects("orders", 3); !slices.Equal(got, []string{"orders.0", "orders.1", "orders.2"}) {
		t.Fatalf("PartitionSubjects = %v", got)
	}
}

func TestRelayRefusesBadOrderedSubjects(t *testing.T) {
	t.Parallel()
	if _, err := relay.New(parts.Installation{}, relay.Config{OrderedSubjects: []string{"bad..subject"}}); err == nil {
		t.Fatal("New accepted an invalid OrderedSubjects filter")
	}
}

// The ordered claim runs in any schema (its statements are qualified like the
// others).
func TestOrderedRelayInAnotherSchema(t *testing.T) {
	t.Parallel()
	env := testenv.NewWith(t, pgtest.Options{Schema: "idem_app"})
	ob := outbox.New(env.Inst)
	for i := 1; i <= 3; i++ {
		enqueue(t, env.DB, ob, idem.Message{Key: fmt.Sprintf("a%d", i), Subject: ordSubject + ".0", Payload: []byte(`{}`)},
			idem.Message{Key: fmt.Sprintf("u%d", i), Subject: testenv.Subject, Payload: []byte(`{}`)})
	}
	r := newRelay(t, env.Inst, relay.Config{BatchSize: 2, OrderedSubjects: ordFilters})
	if n, err := r.Drain(context.Background()); err != nil || n != 6 {
		t.Fatalf("Drain = %d, %v; want 6", n, err)
	}
	if got := partitionOrder(t, env, ordSubject+".0"); !slices.Equal(got, []string{"a1", "a2", "a3"}) {
		t.Fatalf("partition = %v", got)
	}
}
