package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/demo"
	"github.com/idemkit/idem/internal/testenv"
)

// outcomes counts consumer outcomes reported through OnOutcome.
type outcomes struct {
	mu sync.Mutex
	n  map[string]int
}

func (o *outcomes) add(_ string, outcome string, n int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n == nil {
		o.n = map[string]int{}
	}
	o.n[outcome] += n
}

func (o *outcomes) get(outcome string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.n[outcome]
}

// bundle is what each test sets up.
type bundle struct {
	env *testenv.Env
	out *outcomes
}

func setup(t *testing.T) *bundle {
	t.Helper()
	t.Parallel()
	return &bundle{env: testenv.New(t), out: &outcomes{}}
}

// chargeConfig is a charge consumer with test-friendly timings.
func (b *bundle) chargeConfig() consumer.Config {
	return consumer.Config{
		Name:         "charges",
		Subject:      idem.SubjectCharge,
		BatchHandler: demo.ChargeHandler{},
		AckWait:      time.Second,
		Backoff:      func(int) time.Duration { return 50 * time.Millisecond },
		OnOutcome:    b.out.add,
	}
}

// start runs a consumer until the returned stop is called (or the test ends).
func (b *bundle) start(t *testing.T, cfg consumer.Config) (stop func()) {
	t.Helper()
	c, err := consumer.New(b.env.DB.Pool, b.env.JS, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return testenv.Go(t, "consumer.Run", c.Run)
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	h := demo.ChargeHandler{}
	cases := []struct {
		name string
		cfg  consumer.Config
		ok   bool
	}{
		{"minimal", consumer.Config{Name: "n", Subject: "idem.x", BatchHandler: h}, true},
		{"no name", consumer.Config{Subject: "idem.x", BatchHandler: h}, false},
		{"no subject", consumer.Config{Name: "n", BatchHandler: h}, false},
		{"no handler", consumer.Config{Name: "n", Subject: "idem.x"}, false},
		{"two handlers", consumer.Config{Name: "n", Subject: "idem.x", BatchHandler: h,
			Handler: consumer.HandlerFunc(func(context.Context, pgx.Tx, *consumer.Delivery) ([]byte, error) { return nil, nil })}, false},
		{"negative batch", consumer.Config{Name: "n", Subject: "idem.x", BatchHandler: h, BatchSize: -1}, false},
	}
	for _, tc := range cases {
		_, err := consumer.New(nil, nil, tc.cfg)
		if (err == nil) != tc.ok {
			t.Errorf("%s: err = %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

// The same charge published three times with distinct Nats-Msg-Ids (so the broker
// cannot fold them) and one Idempotency-Key lands one ledger row.
func TestSameKeyDistinctMsgIDsLandsOnce(t *testing.T) {
	b := setup(t)
	for i := range 3 {
		b.env.Publish(t, idem.SubjectCharge, "k-three", fmt.Sprintf("copy-%d", i), testenv.ChargePayload("acct_1", 1250))
	}
	cfg := b.chargeConfig()
	cfg.BatchSize = 1 // each copy in its own transaction: only the inbox can fold them
	b.start(t, cfg)
	drained := b.env.Drained(t, "charges")
	testenv.Eventually(t, 45*time.Second, "the key processed and all 3 copies acked", func() bool {
		return b.out.get(consumer.OutcomeProcessed) == 1 && drained()
	})
	if n := b.env.LedgerRows(t, "k-three"); n != 1 {
		t.Fatalf("ledger rows = %d, want 1", n)
	}
	// At least: a copy redelivered after its AckWait under load folds once more.
	if got := b.out.get(consumer.OutcomeDuplicate); got < 2 {
		t.Errorf("duplicates folded = %d, want at least 2", got)
	}
}

// Negative control: with the inbox claim switched off, the same three copies land
// three rows. This is the test that goes red for the mechanism above.
func TestWithoutInboxClaimCopiesDouble(t *testing.T) {
	b := setup(t)
	for i := range 3 {
		b.env.Publish(t, idem.SubjectCharge, "k-unsafe", fmt.Sprintf("copy-%d", i), testenv.ChargePayload("acct_1", 1250))
	}
	cfg := b.chargeConfig()
	cfg.UnsafeSkipInboxClaim = true
	cfg.BatchSize = 1 // one copy per transaction, as three separate deliveries would be
	b.start(t, cfg)
	testenv.Eventually(t, 45*time.Second, "3 deliveries processed", func() bool {
		return b.out.get(consumer.OutcomeProcessed) == 3
	})
	if n := b.env.LedgerRows(t, "k-unsafe"); n != 3 {
		t.Fatalf("ledger rows without the claim = %d, want 3 (the negative control must double)", n)
	}
}

// The consumer dies after COMMIT and before the ack: JetStream redelivers to the
// next worker, which finds the key claimed and folds the delivery.
func TestRedeliveryAfterCommitBeforeAckIsDuplicate(t *testing.T) {
	b := setup(t)
	b.env.Publish(t, idem.SubjectCharge, "k-crash", "k-crash", testenv.ChargePayload("acct_1", 500))

	var died atomic.Bool
	cfg := b.chargeConfig()
	cfg.AfterCommit = func(context.Context, []*consumer.Delivery) error {
		died.Store(true)
		return errors.New("fault: worker died after commit, before ack")
	}
	stop := b.start(t, cfg)
	testenv.Eventually(t, 45*time.Second, "first worker to commit and die", died.Load)
	stop()
	if n := b.env.LedgerRows(t, "k-crash"); n != 1 {
		t.Fatalf("after the crash: ledger rows = %d, want 1 (committed)", n)
	}

	b.start(t, b.chargeConfig()) // the next worker, same durable consumer
	testenv.Eventually(t, 45*time.Second, "redelivery folded as duplicate", func() bool {
		return b.out.get(consumer.OutcomeDuplicate) == 1
	})
	if n := b.env.LedgerRows(t, "k-crash"); n != 1 {
		t.Fatalf("after redelivery: ledger rows = %d, want 1", n)
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
			b.env.Publish(t, idem.SubjectCharge, key, fmt.Sprintf("%s/%d", key, c), testenv.ChargePayload("acct_race", k+1))
		}
	}
	var abandoned atomic.Int64
	cfg := b.chargeConfig()
	cfg.BatchSize = 20
	cfg.AckWait = 500 * time.Millisecond
	cfg.AfterCommit = func(_ context.Context, ds []*consumer.Delivery) error {
		if abandoned.Add(1)%4 == 0 {
			return errors.New("fault: batch left unacked")
		}
		return nil
	}
	b.start(t, cfg)
	b.start(t, cfg)
	testenv.Eventually(t, 60*time.Second, "every copy acked", func() bool {
		return b.out.get(consumer.OutcomeProcessed)+b.out.get(consumer.OutcomeDuplicate) >= keys*copies &&
			b.env.DB.Count(t, `SELECT count(DISTINCT idempotency_key) FROM ledger_entries`) == keys
	})
	if n := b.env.DB.Count(t, `SELECT count(*) FROM ledger_entries`); n != keys {
		t.Fatalf("ledger rows = %d, want %d (one per key)", n, keys)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM (SELECT 1 FROM ledger_entries GROUP BY idempotency_key HAVING count(*) > 1) d`); n != 0 {
		t.Fatalf("%d keys have more than one ledger row", n)
	}
	t.Logf("processed=%d duplicates=%d abandoned batches=%d", b.out.get(consumer.OutcomeProcessed), b.out.get(consumer.OutcomeDuplicate), abandoned.Load()/4)
}
