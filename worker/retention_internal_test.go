package worker

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// fakeMono is a monotonic clock the test moves by hand.
type fakeMono struct {
	mu sync.Mutex
	d  time.Duration
}

func (f *fakeMono) now() time.Duration  { f.mu.Lock(); defer f.mu.Unlock(); return f.d }
func (f *fakeMono) set(d time.Duration) { f.mu.Lock(); f.d = d; f.mu.Unlock() }

// When the database's clock runs ahead of the worker's by much more than the time
// between two collector rounds (a forward step of the database host's clock), the
// collector holds: no expired key is deleted, the hold is an error and a metric,
// and it lasts until the clocks agree again. Postgres's now() cannot be moved, so
// the worker's clock moves back instead: the same disagreement.
func TestCollectorHoldsWhenTheDatabaseClockJumps(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	db := env.DB
	ctx := context.Background()
	w, err := New(env.Inst, Config{})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	if err := w.RegisterMetrics(reg); err != nil {
		t.Fatal(err)
	}
	mono := &fakeMono{}
	w.collector.clock.mono = mono.now
	held := func() float64 {
		t.Helper()
		n, err := testutil.GatherAndCount(reg, "idem_collector_clock_held")
		if err != nil || n != 1 {
			t.Fatalf("idem_collector_clock_held: %d series, %v", n, err)
		}
		mfs, _ := reg.Gather()
		for _, mf := range mfs {
			if mf.GetName() == "idem_collector_clock_held" {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		return -1
	}

	// The first round takes the database's clock as it finds it.
	if _, err := w.CollectOnce(ctx); err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	// Expired days ago: on a partitioned inbox (IDEM_TEST_PARTITIONED=1) they
	// land in the default partition, which is collected row by row too.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
	      SELECT 'c', 'k-' || g, 'test.x', '\x00', 'done', now() - interval '2 days' FROM generate_series(1, 10) g`); err != nil {
		t.Fatal(err)
	}

	// The database's clock is now three days ahead of the worker's.
	mono.set(-72 * time.Hour)
	_, err = w.CollectOnce(ctx)
	if err == nil || !strings.Contains(err.Error(), "held") || !strings.Contains(err.Error(), "72h0m") {
		t.Fatalf("a round after the jump: err %v, want the collector held, naming the jump", err)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox`); got != 10 {
		t.Fatalf("%d of 10 expired keys left by a held round, want all", got)
	}
	if v := held(); v != 1 {
		t.Fatalf("idem_collector_clock_held = %v while held, want 1", v)
	}
	// Still ahead at the next round: still held.
	mono.set(-72*time.Hour + time.Minute)
	if _, err := w.CollectOnce(ctx); err == nil {
		t.Fatal("the second round after the jump collected")
	}

	// The clocks agree again (the database's was stepped back).
	mono.set(time.Since(started))
	if _, err := w.CollectOnce(ctx); err != nil {
		t.Fatalf("a round once the clocks agree: %v", err)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox`); got != 0 {
		t.Fatalf("%d expired keys left once the clocks agree, want 0", got)
	}
	if v := held(); v != 0 {
		t.Fatalf("idem_collector_clock_held = %v after the hold, want 0", v)
	}
}
