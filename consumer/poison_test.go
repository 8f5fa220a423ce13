package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// decodingEffect is testenv.Effect behind a payload check, as a real handler
// decodes its messages: a payload that is not {"n": <non-negative number>} can never
// succeed, so it is a Permanent error for that delivery alone.
type decodingEffect struct{}

func (decodingEffect) HandleBatch(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
	for i, d := range ds {
		var p struct {
			N *int `json:"n"`
		}
		if err := json.Unmarshal(d.Payload, &p); err != nil {
			return nil, consumer.BatchError(i, consumer.Permanent(fmt.Errorf("decode: %w", err)))
		}
		if p.N == nil || *p.N < 0 {
			return nil, consumer.BatchError(i, consumer.Permanent(errors.New("n must be a non-negative number")))
		}
	}
	return testenv.Effect{}.HandleBatch(ctx, tx, ds)
}

// effectThen is a Handler that writes the test effect through tx and then returns
// err (nil: succeed): the write must commit or roll back with the claim.
func effectThen(ctx context.Context, tx pgx.Tx, d *consumer.Delivery, err error) ([]byte, error) {
	if _, werr := (testenv.Effect{}).HandleBatch(ctx, tx, []*consumer.Delivery{d}); werr != nil {
		return nil, werr
	}
	return []byte(`"ok"`), err
}

// Every kind of poison is dead-lettered with its reason while normal traffic keeps
// flowing, and nothing is retried forever.
func TestPoisonIsDeadLetteredWhileTrafficContinues(t *testing.T) {
	b := setup(t)
	good := payload(100)
	mismatched := payload(999)
	cases := []struct {
		name, key string
		payload   []byte
		reason    string
	}{
		{"no key", "", good, "missing Idempotency-Key"},
		{"key too long", strings.Repeat("k", 300), good, "malformed Idempotency-Key"},
		{"empty scope before the separator", "\x1fk-scoped", good, "malformed Idempotency-Key"},
		{"undecodable payload", "k-garbage", []byte(`{"n": 12`), "permanent handler error"},
		{"invalid payload", "k-negative", []byte(`{"n":-5}`), "permanent handler error"},
		{"fingerprint mismatch", "k-good-0", mismatched, "fingerprint mismatch"},
	}
	// A good message first, processed before the rest is published, so the
	// mismatch case has a first arrival to mismatch. (Published together, a batch
	// that a poison message splits can settle the good copy after the mismatched
	// one, which then is the first arrival.)
	cfg := b.config()
	cfg.BatchHandler = decodingEffect{}
	b.start(t, cfg)
	b.env.Publish(t, testenv.Subject, "k-good-0", "good-0", good)
	testenv.Eventually(t, 45*time.Second, "the first good message processed", func() bool {
		return b.env.DB.Count(t, `SELECT count(*) FROM test_effects WHERE key = 'k-good-0'`) == 1
	})
	for i, tc := range cases {
		b.env.Publish(t, testenv.Subject, tc.key, "poison-"+tc.name, tc.payload)
		b.env.Publish(t, testenv.Subject, fmt.Sprintf("k-good-%d", i+1), "good-"+tc.name, good)
	}

	drained := b.env.Drained(t, effectName)
	testenv.Eventually(t, 45*time.Second, "every message settled", func() bool {
		return b.out.Get(idem.OutcomeProcessed)+b.out.Get(idem.OutcomeDeadLettered) >= 2*len(cases)+1 && drained()
	})
	if n := b.out.Get(idem.OutcomeProcessed); n != len(cases)+1 {
		t.Errorf("processed = %d, want the %d good messages", n, len(cases)+1)
	}
	for _, tc := range cases {
		n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = $1 AND reason LIKE $2 || '%'`, tc.key, tc.reason)
		if n != 1 {
			t.Errorf("%s: %d dead letters with reason %q, want 1", tc.name, n, tc.reason)
		}
	}
	if n := b.out.Get(idem.OutcomeDeadLettered); n != len(cases) {
		t.Errorf("dead-lettered outcomes = %d, want %d", n, len(cases))
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM test_effects WHERE key LIKE 'k-good-%'`); n != len(cases)+1 {
		t.Errorf("good effects = %d, want %d", n, len(cases)+1)
	}
	// The mismatched payload did not overwrite or add to the first.
	if n := b.env.DB.Count(t, `SELECT count(*) FROM test_effects WHERE payload = $1`, mismatched); n != 0 {
		t.Errorf("mismatched payload produced %d effects, want 0", n)
	}
	if n := b.env.AllEffects(t); n != len(cases)+1 {
		t.Errorf("effects = %d, want only the %d good ones", n, len(cases)+1)
	}
}

// A handler that keeps failing is retried up to MaxDeliver times, then dead-lettered
// with the last error; its claim is rolled back each time, so a fixed handler could
// still run it from a replay.
func TestFailingHandlerDeadLettersAfterMaxDeliver(t *testing.T) {
	b := setup(t)
	b.env.Publish(t, testenv.Subject, "k-flaky", "k-flaky", payload(1))
	var calls atomic.Int32
	cfg := b.config()
	cfg.BatchHandler = nil
	cfg.MaxDeliver = 3
	cfg.Handler = consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		calls.Add(1)
		return effectThen(ctx, tx, d, errors.New("downstream unavailable"))
	})
	b.start(t, cfg)
	testenv.Eventually(t, 45*time.Second, "dead letter after 3 deliveries", func() bool {
		return b.out.Get(idem.OutcomeDeadLettered) == 1
	})
	if n := calls.Load(); n != 3 {
		t.Errorf("handler calls = %d, want 3 (MaxDeliver)", n)
	}
	if n := b.out.Get(idem.OutcomeFailed); n != 2 {
		t.Errorf("failed outcomes = %d, want 2 (the attempts before the last)", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'k-flaky' AND deliveries = 3 AND reason LIKE '%downstream unavailable%'`); n != 1 {
		t.Errorf("dead letters = %d, want 1 with deliveries=3 and the last error", n)
	}
	if n := b.env.Effects(t, "k-flaky"); n != 0 {
		t.Errorf("effects = %d, want 0: each failed attempt must roll back", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = 'k-flaky'`); n != 0 {
		t.Errorf("inbox rows = %d, want 0: a failed handler must leave no claim", n)
	}
}

// A failing message in a batch does not take the batch down: the others commit.
func TestOneFailureDoesNotSinkItsBatch(t *testing.T) {
	b := setup(t)
	for _, k := range []string{"b-1", "b-2", "b-bad", "b-3", "b-4"} {
		b.env.Publish(t, testenv.Subject, k, k, payload(10))
	}
	cfg := b.config()
	cfg.BatchHandler = nil
	cfg.BatchSize = 10
	consumer.SetLinger(&cfg, 500*time.Millisecond) // gather all five in one batch
	cfg.MaxDeliver = 1
	cfg.Handler = consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		if d.Key == "b-bad" {
			return effectThen(ctx, tx, d, errors.New("boom"))
		}
		return effectThen(ctx, tx, d, nil)
	})
	b.start(t, cfg)
	drained := b.env.Drained(t, effectName)
	testenv.Eventually(t, 45*time.Second, "4 processed and every message settled", func() bool {
		return b.out.Get(idem.OutcomeProcessed) == 4 && drained()
	})
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'b-bad'`); n != 1 {
		t.Errorf("dead letters for b-bad = %d, want 1", n)
	}
	if n := b.env.AllEffects(t); n != 4 {
		t.Errorf("effects = %d, want 4", n)
	}
	if n := b.env.Effects(t, "b-bad"); n != 0 {
		t.Errorf("effects of the failing message = %d, want 0 (rolled back)", n)
	}
	// Results of the committed ones are stored as their first results.
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE result = '"ok"'`); n != 4 {
		t.Errorf("inbox rows with the stored result = %d, want 4", n)
	}
}

// A message whose data the database refuses (SQLSTATE class 22: here a NUL in a
// text value) is dead-lettered at its first failure, with the reason: no retry can
// change its data.
func TestDataTheDatabaseRefusesIsDeadLetteredAtOnce(t *testing.T) {
	b := setup(t)
	b.env.Publish(t, testenv.Subject, "k-nul", "k-nul", []byte("acct\x00x"))
	var calls atomic.Int32
	cfg := b.config()
	cfg.BatchHandler = nil
	cfg.Handler = consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		calls.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO public.test_effects (key, payload) VALUES ($1, convert_to($2::text, 'UTF8'))`, d.Key, string(d.Payload))
		return nil, err
	})
	b.start(t, cfg)
	testenv.Eventually(t, 45*time.Second, "dead-lettered", func() bool { return b.out.Get(idem.OutcomeDeadLettered) == 1 })
	if n := calls.Load(); n != 1 {
		t.Errorf("handler calls = %d, want 1: a data error is not retried", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'k-nul' AND reason LIKE 'permanent handler error: the database refuses%22021%'`); n != 1 {
		t.Errorf("dead letters naming the data error = %d, want 1", n)
	}
}

// A changed payload under a settled key and a copy of the settled message, met in
// one batch with the change first: the copy is the duplicate it is, and only the
// change is dead-lettered. (Judged against the batch's first copy instead of the
// inbox, the copy would be dead-lettered as a change too.)
func TestCopyBesideAChangedPayloadInOneBatchIsADuplicate(t *testing.T) {
	b := setup(t)
	cfg := b.config()
	stop := b.start(t, cfg)
	first, changed := payload(1), payload(2)
	b.env.Publish(t, testenv.Subject, "k-1", "m-1", first)
	testenv.Eventually(t, 30*time.Second, "k-1 settled", func() bool { return b.env.Effects(t, "k-1") == 1 })
	stop()
	// Both wait in the stream for the consumer's next start, the change first.
	b.env.Publish(t, testenv.Subject, "k-1", "m-1-changed", changed)
	b.env.Publish(t, testenv.Subject, "k-1", "m-1-copy", first)
	b.start(t, cfg)
	drained := b.env.Drained(t, effectName)
	testenv.Eventually(t, 30*time.Second, "both settled", func() bool {
		return b.out.Get(idem.OutcomeDuplicate)+b.out.Get(idem.OutcomeDeadLettered) >= 2 && drained()
	})
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'k-1' AND payload = $1 AND reason LIKE 'fingerprint mismatch%'`, changed); n != 1 {
		t.Errorf("dead letters of the change = %d, want 1", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'k-1' AND payload = $1`, first); n != 0 {
		t.Errorf("dead letters of the settled message's copy = %d, want 0: it is a duplicate", n)
	}
	if n := b.env.Effects(t, "k-1"); n != 1 {
		t.Errorf("effects of k-1 = %d, want 1", n)
	}
}
