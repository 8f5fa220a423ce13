package consumer_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testenv"
)

// Every kind of poison is dead-lettered with its reason while normal traffic keeps
// flowing, and nothing is retried forever.
func TestPoisonIsDeadLetteredWhileTrafficContinues(t *testing.T) {
	b := setup(t)
	good := testenv.ChargePayload("acct_ok", 100)
	cases := []struct {
		name, key string
		payload   []byte
		reason    string
	}{
		{"no key", "", good, "missing Idempotency-Key"},
		{"key too long", strings.Repeat("k", 300), good, "malformed Idempotency-Key"},
		{"undecodable payload", "k-garbage", []byte(`{"account": 12`), "permanent handler error"},
		{"invalid amount", "k-negative", []byte(`{"account":"a","amount_cents":-5}`), "permanent handler error"},
		{"fingerprint mismatch", "k-good-0", testenv.ChargePayload("acct_ok", 999), "fingerprint mismatch"},
	}
	// A good message first, so the mismatch case has something to mismatch.
	b.env.Publish(t, idem.SubjectCharge, "k-good-0", "good-0", good)
	for i, tc := range cases {
		b.env.Publish(t, idem.SubjectCharge, tc.key, "poison-"+tc.name, tc.payload)
		b.env.Publish(t, idem.SubjectCharge, "k-good-"+string(rune('1'+i)), "good-"+tc.name, good)
	}
	b.start(t, b.chargeConfig())

	drained := b.env.Drained(t, "charges")
	testenv.Eventually(t, 45*time.Second, "all good processed and every message settled", func() bool {
		return b.out.get(consumer.OutcomeProcessed) == len(cases)+1 && drained()
	})
	for _, tc := range cases {
		n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = $1 AND reason LIKE $2 || '%'`, tc.key, tc.reason)
		if n != 1 {
			t.Errorf("%s: %d dead letters with reason %q, want 1", tc.name, n, tc.reason)
		}
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM ledger_entries WHERE account = 'acct_ok'`); n != len(cases)+1 {
		t.Errorf("good ledger rows = %d, want %d", n, len(cases)+1)
	}
	// The mismatched payload did not overwrite or add to the first.
	if n := b.env.DB.Count(t, `SELECT count(*) FROM ledger_entries WHERE amount_cents = 999`); n != 0 {
		t.Errorf("mismatched payload produced %d ledger rows, want 0", n)
	}
}

// A handler that keeps failing is retried up to MaxDeliver times, then dead-lettered
// with the last error; its claim is rolled back each time, so a fixed handler could
// still run it from a replay.
func TestFailingHandlerDeadLettersAfterMaxDeliver(t *testing.T) {
	b := setup(t)
	b.env.Publish(t, idem.SubjectCharge, "k-flaky", "k-flaky", testenv.ChargePayload("a", 1))
	var calls atomic.Int32
	cfg := b.chargeConfig()
	cfg.BatchHandler = nil
	cfg.MaxDeliver = 3
	cfg.Handler = consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		calls.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ($1, 'a', 1)`, d.Key); err != nil {
			return nil, err
		}
		return nil, errors.New("downstream unavailable")
	})
	b.start(t, cfg)
	testenv.Eventually(t, 45*time.Second, "dead letter after 3 deliveries", func() bool {
		return b.out.get(consumer.OutcomeDeadLettered) == 1
	})
	if n := calls.Load(); n != 3 {
		t.Errorf("handler calls = %d, want 3 (MaxDeliver)", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'k-flaky' AND deliveries = 3 AND reason LIKE '%downstream unavailable%'`); n != 1 {
		t.Errorf("dead letters = %d, want 1 with deliveries=3 and the last error", n)
	}
	if n := b.env.LedgerRows(t, "k-flaky"); n != 0 {
		t.Errorf("ledger rows = %d, want 0: each failed attempt must roll back", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = 'k-flaky'`); n != 0 {
		t.Errorf("inbox rows = %d, want 0: a failed handler must leave no claim", n)
	}
}

// A failing message in a batch does not take the batch down: the others commit.
func TestOneFailureDoesNotSinkItsBatch(t *testing.T) {
	b := setup(t)
	for _, k := range []string{"b-1", "b-2", "b-bad", "b-3", "b-4"} {
		b.env.Publish(t, idem.SubjectCharge, k, k, testenv.ChargePayload("acct_b", 10))
	}
	cfg := b.chargeConfig()
	cfg.BatchHandler = nil
	cfg.BatchSize = 10
	cfg.Linger = 500 * time.Millisecond // gather all five in one batch
	cfg.MaxDeliver = 1
	cfg.Handler = consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		if d.Key == "b-bad" {
			return nil, errors.New("boom")
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ($1, 'acct_b', 10)`, d.Key)
		return []byte(`"ok"`), err
	})
	b.start(t, cfg)
	drained := b.env.Drained(t, "charges")
	testenv.Eventually(t, 45*time.Second, "4 processed and every message settled", func() bool {
		return b.out.get(consumer.OutcomeProcessed) == 4 && drained()
	})
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'b-bad'`); n != 1 {
		t.Errorf("dead letters for b-bad = %d, want 1", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM ledger_entries`); n != 4 {
		t.Errorf("ledger rows = %d, want 4", n)
	}
}
