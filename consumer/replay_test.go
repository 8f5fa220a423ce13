package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testenv"
)

// A message dead-lettered because its handler kept failing is replayed once the
// handler is fixed: it runs once. Replaying it again is a duplicate, folded by key.
func TestReplayDeadLetter(t *testing.T) {
	b := setup(t)
	b.env.Publish(t, idem.SubjectCharge, "k-replay", "k-replay", testenv.ChargePayload("acct_r", 42))

	var broken atomic.Bool
	broken.Store(true)
	cfg := b.chargeConfig()
	cfg.BatchHandler = nil
	cfg.MaxDeliver = 2
	cfg.Handler = consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		if broken.Load() {
			return nil, errors.New("bug in handler")
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ($1, 'acct_r', 42)`, d.Key)
		return nil, err
	})
	b.start(t, cfg)
	testenv.Eventually(t, 45*time.Second, "dead letter", func() bool { return b.out.get(consumer.OutcomeDeadLettered) == 1 })

	dls, err := consumer.ListDeadLetters(context.Background(), b.env.DB.Pool, 10)
	if err != nil || len(dls) != 1 {
		t.Fatalf("ListDeadLetters = %v, %v", dls, err)
	}
	dl := dls[0]
	if dl.Key != "k-replay" || dl.Deliveries != 2 || dl.ReplayedAt != nil {
		t.Fatalf("dead letter = %+v", dl)
	}

	broken.Store(false) // the handler is fixed
	if _, err := consumer.ReplayDeadLetter(context.Background(), b.env.DB.Pool, b.env.JS, dl.ID); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 45*time.Second, "replay processed", func() bool { return b.out.get(consumer.OutcomeProcessed) == 1 })
	if n := b.env.LedgerRows(t, "k-replay"); n != 1 {
		t.Fatalf("ledger rows after replay = %d, want 1", n)
	}

	// A second replay of the same dead letter: the effect already happened.
	if _, err := consumer.ReplayDeadLetter(context.Background(), b.env.DB.Pool, b.env.JS, dl.ID); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 45*time.Second, "second replay folded", func() bool { return b.out.get(consumer.OutcomeDuplicate) == 1 })
	if n := b.env.LedgerRows(t, "k-replay"); n != 1 {
		t.Fatalf("ledger rows after a second replay = %d, want 1", n)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NOT NULL`); n != 1 {
		t.Fatalf("replayed_at not recorded")
	}
	if _, err := consumer.ReplayDeadLetter(context.Background(), b.env.DB.Pool, b.env.JS, 9999); err == nil {
		t.Fatal("replaying a dead letter that does not exist succeeded")
	}
}
