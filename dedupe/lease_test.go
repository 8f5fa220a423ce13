package dedupe_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

const leaseConsumer = "emails"

var fpA, fpB = []byte("payload A"), []byte("payload B")

func mustLease(t *testing.T, inbox *dedupe.Inbox, db *pgtest.DB, key string, fp []byte, leaseFor time.Duration) dedupe.LeaseResult {
	t.Helper()
	r, err := inbox.Lease(context.Background(), db.Pool, leaseConsumer, dedupe.ID{Key: key, Message: testMessage}, fp, leaseFor, time.Hour)
	if err != nil {
		t.Fatalf("Lease(%q): %v", key, err)
	}
	return r
}

func wantOutcome(t *testing.T, r dedupe.LeaseResult, want dedupe.LeaseOutcome) {
	t.Helper()
	if r.Outcome != want {
		t.Fatalf("outcome = %s, want %s (%+v)", r.Outcome, want, r)
	}
}

// The life of one key: acquired, busy for everyone else while live, done with its
// first result once completed, and a mismatch for a different payload throughout.
func TestLeaseLifecycle(t *testing.T) {
	t.Parallel()
	db, inbox := newInbox(t, pgtest.Options{})
	ctx := context.Background()

	first := mustLease(t, inbox, db, "k1", fpA, time.Minute)
	wantOutcome(t, first, dedupe.LeaseAcquired)
	if first.Attempt != 1 || first.Step != "" || first.StepState != nil {
		t.Fatalf("first acquisition = %+v, want attempt 1 and no recovery point", first)
	}

	busy := mustLease(t, inbox, db, "k1", fpA, time.Minute)
	wantOutcome(t, busy, dedupe.LeaseBusy)
	if busy.RetryIn <= 0 || busy.RetryIn > time.Minute {
		t.Errorf("busy RetryIn = %s, want within (0, 1m]", busy.RetryIn)
	}
	wantOutcome(t, mustLease(t, inbox, db, "k1", fpB, time.Minute), dedupe.LeaseMismatch)

	if err := inbox.CompleteLease(ctx, db.Pool, first.Holder, []byte(`{"sent":true}`)); err != nil {
		t.Fatal(err)
	}
	done := mustLease(t, inbox, db, "k1", fpA, time.Minute)
	wantOutcome(t, done, dedupe.LeaseDone)
	if string(done.Result) != `{"sent":true}` {
		t.Errorf("done result = %q, want the stored first result", done.Result)
	}
	wantOutcome(t, mustLease(t, inbox, db, "k1", fpB, time.Minute), dedupe.LeaseMismatch)

	// Completed means completed: the former holder cannot complete, extend or
	// release it again.
	if err := inbox.CompleteLease(ctx, db.Pool, first.Holder, []byte(`"again"`)); !errors.Is(err, dedupe.ErrLeaseLost) {
		t.Errorf("second CompleteLease: err = %v, want ErrLeaseLost", err)
	}
	if _, err := inbox.ExtendLease(ctx, db.Pool, first.Holder, time.Minute); !errors.Is(err, dedupe.ErrLeaseLost) {
		t.Errorf("ExtendLease after completion: err = %v, want ErrLeaseLost", err)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = 'k1' AND status = 'done' AND lease_owner IS NULL AND lease_until IS NULL AND completed_at IS NOT NULL`); n != 1 {
		t.Errorf("completed row not in the done shape (%d rows)", n)
	}
}

// A worker that dies mid-effect leaves an expired lease: the next acquisition takes
// it over with the recovery point intact, and the dead holder's token is refused.
func TestLeaseTakeoverAfterExpiry(t *testing.T) {
	t.Parallel()
	db, inbox := newInbox(t, pgtest.Options{})
	ctx := context.Background()

	dead := mustLease(t, inbox, db, "k2", fpA, 300*time.Millisecond)
	wantOutcome(t, dead, dedupe.LeaseAcquired)
	if err := inbox.RecordStep(ctx, db.Pool, dead.Holder, "authorize", []byte(`{"auth":"a_1"}`)); err != nil {
		t.Fatal(err)
	}
	// ... and the holder dies. Until the lease runs out, everyone else is told it
	// is busy (TestLeaseLifecycle); then one of them takes over.
	var next dedupe.LeaseResult
	testenv.Eventually(t, 45*time.Second, "the expired lease to be taken over", func() bool {
		next = mustLease(t, inbox, db, "k2", fpA, time.Minute)
		return next.Outcome == dedupe.LeaseAcquired
	})
	if next.Attempt != 2 || next.Step != "authorize" || string(next.StepState) != `{"auth":"a_1"}` {
		t.Fatalf("takeover = attempt %d step %q state %q, want attempt 2 resuming after authorize", next.Attempt, next.Step, next.StepState)
	}
	if next.Holder.Token == dead.Holder.Token {
		t.Fatal("takeover reused the dead holder's token")
	}

	// The old holder wakes up: every holder-only operation refuses it.
	for name, op := range map[string]func() error{
		"RecordStep":    func() error { return inbox.RecordStep(ctx, db.Pool, dead.Holder, "capture", nil) },
		"CompleteLease": func() error { return inbox.CompleteLease(ctx, db.Pool, dead.Holder, []byte(`"stale"`)) },
		"ReleaseLease":  func() error { return inbox.ReleaseLease(ctx, db.Pool, dead.Holder) },
		"ExtendLease": func() error {
			_, err := inbox.ExtendLease(ctx, db.Pool, dead.Holder, time.Minute)
			return err
		},
	} {
		if err := op(); !errors.Is(err, dedupe.ErrLeaseLost) {
			t.Errorf("stale holder %s: err = %v, want ErrLeaseLost", name, err)
		}
	}
	// The new holder is unaffected.
	if err := inbox.RecordStep(ctx, db.Pool, next.Holder, "capture", []byte(`{"auth":"a_1","capture":"c_1"}`)); err != nil {
		t.Fatal(err)
	}
	if err := inbox.CompleteLease(ctx, db.Pool, next.Holder, []byte(`"ok"`)); err != nil {
		t.Fatal(err)
	}
	wantOutcome(t, mustLease(t, inbox, db, "k2", fpA, time.Minute), dedupe.LeaseDone)
}

// A released lease (the effect failed) can be taken again at once, resuming at its
// recovery point.
func TestLeaseReleaseAllowsImmediateRetry(t *testing.T) {
	t.Parallel()
	db, inbox := newInbox(t, pgtest.Options{})
	ctx := context.Background()

	r := mustLease(t, inbox, db, "k3", fpA, time.Hour)
	if err := inbox.RecordStep(ctx, db.Pool, r.Holder, "one", []byte("s1")); err != nil {
		t.Fatal(err)
	}
	if err := inbox.ReleaseLease(ctx, db.Pool, r.Holder); err != nil {
		t.Fatal(err)
	}
	again := mustLease(t, inbox, db, "k3", fpA, time.Hour)
	wantOutcome(t, again, dedupe.LeaseAcquired)
	if again.Attempt != 2 || again.Step != "one" || string(again.StepState) != "s1" {
		t.Fatalf("after release = %+v, want attempt 2 at step one", again)
	}
	// A released lease with another payload is still a mismatch, not a takeover.
	if err := inbox.ReleaseLease(ctx, db.Pool, again.Holder); err != nil {
		t.Fatal(err)
	}
	wantOutcome(t, mustLease(t, inbox, db, "k3", fpB, time.Hour), dedupe.LeaseMismatch)
}

// ExtendLease keeps a live holder live: the new end is later, and a competitor is
// told to wait for the extended end, not the original one.
func TestLeaseExtend(t *testing.T) {
	t.Parallel()
	db, inbox := newInbox(t, pgtest.Options{})
	r := mustLease(t, inbox, db, "k4", fpA, time.Second)
	until, err := inbox.ExtendLease(context.Background(), db.Pool, r.Holder, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if !until.After(r.Until.Add(50 * time.Minute)) {
		t.Fatalf("extended until %s, first until %s: not extended", until, r.Until)
	}
	busy := mustLease(t, inbox, db, "k4", fpA, time.Second)
	wantOutcome(t, busy, dedupe.LeaseBusy)
	if busy.RetryIn < 50*time.Minute {
		t.Errorf("busy RetryIn = %s, want the extended lease (~1h)", busy.RetryIn)
	}
}

// Many workers race for the same key, new and then expired: exactly one acquires
// each time, the rest are told it is busy. On a partitioned inbox half of them
// ask for a week's lifetime, so their rows would land in another partition than
// the others', where no unique index could stop a second winner.
func TestLeaseRaceHasOneWinner(t *testing.T) {
	t.Parallel()
	for _, partitioned := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "partitioned"}[partitioned], func(t *testing.T) {
			t.Parallel()
			leaseRace(t, partitioned)
		})
	}
}

func leaseRace(t *testing.T, partitioned bool) {
	db, inbox := newInbox(t, pgtest.Options{Partitioned: partitioned}) // its own: an Inbox learns one database's layout
	const workers = 12

	race := func(leaseFor time.Duration) (acquired []dedupe.LeaseResult, busy int) {
		var (
			mu    sync.Mutex
			wg    sync.WaitGroup
			start = make(chan struct{})
		)
		for i := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				lifetime := time.Hour
				if partitioned && i%2 == 1 {
					lifetime = 7 * 24 * time.Hour
				}
				<-start
				r, err := inbox.Lease(context.Background(), db.Pool, leaseConsumer, dedupe.ID{Key: "k-race", Message: testMessage}, fpA, leaseFor, lifetime)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				defer mu.Unlock()
				switch r.Outcome {
				case dedupe.LeaseAcquired:
					acquired = append(acquired, r)
				case dedupe.LeaseBusy:
					busy++
				default:
					t.Errorf("unexpected outcome %s", r.Outcome)
				}
			}()
		}
		close(start)
		wg.Wait()
		return acquired, busy
	}

	// Leases long enough that none can expire during a race on a loaded machine:
	// a second winner would then be a legitimate takeover, not a race.
	won, busy := race(time.Minute)
	if len(won) != 1 || busy != workers-1 {
		t.Fatalf("new key: %d acquired, %d busy; want 1 and %d", len(won), busy, workers-1)
	}
	// The winner "died" long ago: its lease ended. Race for the takeover.
	if _, err := db.Pool.Exec(context.Background(), `UPDATE idem_inbox SET lease_until = now() - interval '1 second' WHERE key = 'k-race'`); err != nil {
		t.Fatal(err)
	}
	won, busy = race(time.Minute)
	if len(won) != 1 || busy != workers-1 {
		t.Fatalf("expired lease: %d acquired, %d busy; want 1 and %d", len(won), busy, workers-1)
	}
	if won[0].Attempt != 2 {
		t.Errorf("takeover attempt = %d, want 2", won[0].Attempt)
	}
}

func TestLeaseRejectsNonPositiveLeaseFor(t *testing.T) {
	t.Parallel()
	_, inbox := newInbox(t, pgtest.Options{})
	if _, err := inbox.Lease(context.Background(), nil, leaseConsumer, dedupe.ID{Key: "k", Message: testMessage}, fpA, 0, 0); err == nil {
		t.Fatal("Lease with leaseFor 0: want an error")
	}
}
