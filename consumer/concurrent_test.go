package consumer_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// meeting holds the first handler call for a key until a second worker has
// reached the same key: its handler was called too (a plain inbox, where both
// copies find the delivery new), or it waits on a lock (a partitioned inbox, where
// the second waits in its claim on the key's lock). Either way the two copies are
// processed at the same moment.
type meeting struct {
	env   *testenv.Env
	calls atomic.Int32
	met   chan struct{}
	once  sync.Once
	// locked says the second was found waiting on a lock, not in the handler.
	locked atomic.Bool
}

func newMeeting(env *testenv.Env) *meeting { return &meeting{env: env, met: make(chan struct{})} }

func (m *meeting) wrap(inner consumer.BatchHandler) consumer.BatchHandler {
	return batchFunc(func(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
		if m.calls.Add(1) == 1 {
			m.wait(ctx)
		} else {
			m.once.Do(func() { close(m.met) })
		}
		return inner.HandleBatch(ctx, tx, ds)
	})
}

// wait blocks until the second copy arrives or is seen waiting on a lock (at most
// 30s, after which the test's counts show the race was not exercised).
func (m *meeting) wait(ctx context.Context) {
	deadline := time.After(30 * time.Second)
	for {
		select {
		case <-m.met:
			return
		case <-deadline:
			return
		case <-time.After(20 * time.Millisecond):
		}
		var waiting int
		_ = m.env.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		if waiting > 0 {
			m.locked.Store(true)
			return
		}
	}
}

// uniqueEffect writes test_unique, whose primary key is the delivery's key: the
// effect of a handler with a unique constraint of its own, which a concurrent copy
// of the delivery violates inside the handler, before the inbox sees it.
type uniqueEffect struct{}

func (uniqueEffect) HandleBatch(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
	for _, d := range ds {
		if _, err := tx.Exec(ctx, `INSERT INTO public.test_unique (key) VALUES ($1)`, d.Key); err != nil {
			return nil, consumer.BatchError(0, fmt.Errorf("unique effect: %w", err))
		}
	}
	return testenv.Effect{}.HandleBatch(ctx, tx, ds)
}

// Two copies of one delivery (one key, one subject, distinct Nats-Msg-Ids, so the
// broker keeps both), each taken by its own worker at the same moment: one effect.
// On a plain inbox both copies find the delivery new and both handlers run; the
// inbox's primary key lets one settle, and the other batch rolls back and runs
// again, folding its copy. On a partitioned inbox the second waits in its claim
// and folds its copy without running the handler. A handler with a unique key of
// its own fails on the copy instead of the settlement; the copy is folded too,
// not charged as a failure. The negative control runs without the claim: two
// effects.
func TestConcurrentCopiesOfADeliveryLandOnce(t *testing.T) {
	for _, tc := range []struct {
		name      string
		handler   consumer.BatchHandler
		skipClaim bool
	}{
		{"effect", testenv.Effect{}, false},
		{"handler with a unique key", uniqueEffect{}, false},
		{"negative control: no claim", testenv.Effect{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t)
			if _, err := b.env.DB.Pool.Exec(context.Background(), `CREATE TABLE public.test_unique (key text PRIMARY KEY)`); err != nil {
				t.Fatal(err)
			}
			const key = "k-copies"
			for i := range 2 {
				b.env.Publish(t, testenv.Subject, key, fmt.Sprintf("copy-%d", i), payload(1))
			}
			m := newMeeting(b.env)
			cfg := b.config()
			cfg.BatchHandler = m.wrap(tc.handler)
			cfg.BatchSize, cfg.Concurrency = 1, 2 // one copy per worker, both at once
			cfg.AckWait = 30 * time.Second        // no redelivery while the first holds its copy
			ctx := context.Background()
			if tc.skipClaim {
				ctx = faults.With(ctx, faults.New().Switch(faults.SkipInboxClaim))
			}
			b.startCtx(t, ctx, cfg)
			drained := b.env.Drained(t, effectName)
			testenv.Eventually(t, 45*time.Second, "both copies settled", func() bool {
				return b.out.Get(idem.OutcomeProcessed)+b.out.Get(idem.OutcomeDuplicate) >= 2 && drained()
			})
			raced := m.calls.Load() == 2 || m.locked.Load()
			if !raced {
				t.Fatalf("the copies were not processed at the same moment (handler calls %d, no lock wait): the race was not exercised", m.calls.Load())
			}
			effects := b.env.Effects(t, key)
			t.Logf("handler calls=%d lock wait=%v effects=%d processed=%d duplicates=%d failed=%d",
				m.calls.Load(), m.locked.Load(), effects, b.out.Get(idem.OutcomeProcessed), b.out.Get(idem.OutcomeDuplicate), b.out.Get(idem.OutcomeFailed))
			if tc.skipClaim {
				if effects != 2 {
					t.Fatalf("effects without the claim = %d, want 2 (the negative control must double)", effects)
				}
				return
			}
			if effects != 1 {
				t.Fatalf("effects = %d, want 1", effects)
			}
			if n := b.out.Get(idem.OutcomeProcessed); n != 1 {
				t.Errorf("processed = %d, want 1", n)
			}
			if n := b.out.Get(idem.OutcomeDuplicate); n != 1 {
				t.Errorf("duplicates folded = %d, want 1", n)
			}
			if n := b.out.Get(idem.OutcomeFailed); n != 0 {
				t.Errorf("failures = %d, want none: a copy is folded, not retried", n)
			}
			if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_attempts`); n != 0 {
				t.Errorf("attempts charged = %d, want none", n)
			}
			if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = $1`, key); n != 1 {
				t.Errorf("inbox rows = %d, want 1", n)
			}
		})
	}
}
