package consumer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// fakeMsg is a fetched message as far as the queue looks at it.
type fakeMsg struct {
	jetstream.Msg
	data []byte
}

func (m fakeMsg) Data() []byte         { return m.data }
func (m fakeMsg) Headers() nats.Header { return nil }

func msgN(i int) jetstream.Msg { return fakeMsg{data: fmt.Appendf(nil, "m%d", i)} }

const unbounded = 1 << 40

// empty reports whether every queued message was taken.
func (q *queue) empty() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.msgs) == 0
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

type taken struct {
	batch []jetstream.Msg
	ok    bool
	at    time.Time
}

func goTake(q *queue, ctx context.Context, maxMsgs int, linger time.Duration) <-chan taken {
	out := make(chan taken, 1)
	go func() {
		b, ok := q.take(ctx, maxMsgs, unbounded, linger)
		out <- taken{b, ok, time.Now()}
	}()
	return out
}

func receive(t *testing.T, c <-chan taken) taken {
	t.Helper()
	select {
	case r := <-c:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("take never returned")
		return taken{}
	}
}

// A full batch goes at once, whatever the linger.
func TestTakeDoesNotHoldAFullBatch(t *testing.T) {
	t.Parallel()
	q := newQueue(10, unbounded)
	for i := range 3 {
		q.push(t.Context(), msgN(i))
	}
	r := receive(t, goTake(q, t.Context(), 3, time.Hour))
	if len(r.batch) != 3 || !r.ok {
		t.Fatalf("take = %d messages, %v; want the full batch of 3", len(r.batch), r.ok)
	}
}

// A batch that is not full waits for the linger, and no longer: the default
// linger, and a longer one that shows the wait.
func TestTakeHoldsALoneMessageForTheLingerOnly(t *testing.T) {
	t.Parallel()
	for _, linger := range []time.Duration{Config{}.WithDefaults().linger, 50 * time.Millisecond} {
		t.Run(linger.String(), func(t *testing.T) {
			t.Parallel()
			q := newQueue(10, unbounded)
			pushed := time.Now()
			q.push(t.Context(), msgN(1))
			r := receive(t, goTake(q, t.Context(), 250, linger))
			held := r.at.Sub(pushed)
			if len(r.batch) != 1 || !r.ok {
				t.Fatalf("take = %d messages, %v; want the lone message", len(r.batch), r.ok)
			}
			if held < linger {
				t.Errorf("the lone message was held %s, less than the linger %s", held, linger)
			}
			// Generous for a loaded machine: what it rules out is a batch that
			// waits to fill.
			if held > linger+500*time.Millisecond {
				t.Errorf("the lone message was held %s, far past the linger %s", held, linger)
			}
		})
	}
	if d := (Config{}).WithDefaults().linger; d <= 0 || d > 5*time.Millisecond {
		t.Errorf("the default linger is %s, want a few milliseconds at most", d)
	}
	if d := (Config{linger: -1}).WithDefaults().linger; d > 0 {
		t.Errorf("a negative linger became %s, want none", d)
	}
}

// The linger counts from when the first message arrived, not from when a worker
// got to it: a message that waited in the queue already goes at once.
func TestTakeCountsTheLingerFromArrival(t *testing.T) {
	t.Parallel()
	q := newQueue(10, unbounded)
	q.push(t.Context(), msgN(1))
	q.mu.Lock()
	q.msgs[0].arrived = time.Now().Add(-2 * time.Hour) // queued long ago
	q.mu.Unlock()
	r := receive(t, goTake(q, t.Context(), 250, time.Hour))
	if len(r.batch) != 1 || !r.ok {
		t.Fatalf("take = %d messages, %v; want the message that waited already", len(r.batch), r.ok)
	}
}

// Messages that arrive while a batch lingers join it, not another idle worker:
// of two takers, one gathers at a time. Without that, which of the two wakes first
// for an arrival is chance; twenty rounds leave it none.
func TestTakeGathersArrivalsIntoTheLingeringBatch(t *testing.T) {
	t.Parallel()
	for round := range 20 {
		q := newQueue(10, unbounded)
		ctx, cancel := context.WithCancel(t.Context())
		a, b := goTake(q, ctx, 3, time.Hour), goTake(q, ctx, 3, time.Hour)
		q.push(ctx, msgN(1))
		waitFor(t, "the first message taken", q.empty)
		q.push(ctx, msgN(2))
		q.push(ctx, msgN(3))
		waitFor(t, "the arrivals taken", q.empty)
		q.push(ctx, msgN(4))
		waitFor(t, "the fourth message taken", q.empty)
		cancel()
		ra, rb := receive(t, a), receive(t, b)
		if len(ra.batch) < len(rb.batch) {
			ra, rb = rb, ra
		}
		if len(ra.batch) != 3 || len(rb.batch) != 1 {
			t.Fatalf("round %d: batches of %d and %d messages, want 3 (the lingering batch and what arrived during it) and then 1", round, len(ra.batch), len(rb.batch))
		}
	}
}

// Stopping ends a linger at once: the batch gathered so far is handed over (to be
// processed), and a taker with nothing gets nothing.
func TestTakeStopsLingeringOnShutdown(t *testing.T) {
	t.Parallel()
	q := newQueue(10, unbounded)
	ctx, cancel := context.WithCancel(t.Context())
	r := goTake(q, ctx, 250, time.Hour)
	q.push(ctx, msgN(1))
	waitFor(t, "the message taken", q.empty)
	idle := goTake(q, ctx, 250, time.Hour) // waits for the gathering token
	cancel()
	if got := receive(t, r); len(got.batch) != 1 || !got.ok {
		t.Fatalf("take after stop = %d messages, %v; want the gathered message", len(got.batch), got.ok)
	}
	if got := receive(t, idle); len(got.batch) != 0 || got.ok {
		t.Fatalf("idle take after stop = %d messages, %v; want nothing", len(got.batch), got.ok)
	}
}
