package wake

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Callers that arrive while a NOTIFY is on its way share the next one: a burst
// costs two sends, not one per caller, and every caller's send starts after it
// arrived (the shared one starts only once the one on its way has finished).
func TestWakeCoalescesCallersBehindOneInFlight(t *testing.T) {
	t.Parallel()
	var w Waker
	var sends atomic.Int64
	first, releaseFirst := make(chan struct{}), make(chan struct{})
	var secondStarted atomic.Bool
	send := func(context.Context) error {
		switch sends.Add(1) {
		case 1:
			close(first)
			<-releaseFirst
		default:
			secondStarted.Store(true)
		}
		return nil
	}
	ctx := context.Background()
	errs := make(chan error, 11)
	go func() { errs <- w.Notify(ctx, send) }()
	<-first // the first NOTIFY is on its way

	const callers = 10
	var joined sync.WaitGroup
	for range callers {
		joined.Add(1)
		go func() {
			joined.Done()
			errs <- w.Notify(ctx, send)
		}()
	}
	joined.Wait()
	// Every caller has either joined the next flight or not yet taken the lock;
	// wait until all ten are behind the first.
	deadline := time.Now().Add(45 * time.Second)
	for waiting(&w) < callers {
		if time.Now().After(deadline) {
			t.Fatalf("only %d callers joined the next NOTIFY", waiting(&w))
		}
		time.Sleep(time.Millisecond) // poll interval of a condition
	}
	if secondStarted.Load() {
		t.Fatal("a second NOTIFY started while the first was on its way: it could miss a commit made after the first began")
	}
	close(releaseFirst)
	for range callers + 1 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if n := sends.Load(); n != 2 {
		t.Errorf("%d callers sent %d NOTIFYs, want 2 (the first, and one shared by the ten behind it)", callers+1, n)
	}
}

func waiting(w *Waker) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.next == nil {
		return 0
	}
	return w.next.joined
}
