package outbox

import (
	"context"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5/pgconn"
)

// Execer is what Wake needs of a pool or connection: one statement outside any
// transaction of the caller's.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Wake tells the relays that rows written with AddToBatch have committed. Call it
// after the commit, never before: a relay woken early finds nothing and sleeps
// until its next poll.
//
// A relay of this process started with RelayConfig.Outbox set to o is woken
// directly, at no cost to the database. Otherwise Wake sends a NOTIFY through db,
// outside any transaction of the caller's, coalescing concurrent calls: a caller
// that arrives while a NOTIFY is on its way shares the next one with everyone who
// arrived meanwhile, so a burst of commits costs a few NOTIFYs, and no caller waits
// for more than two. Each NOTIFY starts after every commit it announces, which is
// what makes it safe to share.
//
// An error means the NOTIFY failed; the rows are committed all the same and a
// relay's poll will find them.
func (o *Outbox) Wake(ctx context.Context, db Execer) error {
	if o.wake.local() {
		return nil
	}
	if err := o.wake.notify(ctx, func(ctx context.Context) error {
		_, err := db.Exec(ctx, sqlNotify, o.channel)
		return err
	}); err != nil {
		return fmt.Errorf("outbox: wake: %w", err)
	}
	return nil
}

// waker holds the relays of this process listening to one Outbox, and coalesces
// the NOTIFYs sent when there are none.
type waker struct {
	mu     sync.Mutex
	relays map[chan<- struct{}]struct{}

	// running is the NOTIFY being sent; next is the one that will be sent after it,
	// shared by every caller that arrived while running was on its way (those
	// callers' commits may have come after running started).
	running, next *flight
}

// A flight is one NOTIFY; done is closed when it has been sent or has failed.
type flight struct {
	done   chan struct{}
	err    error
	joined int // callers sharing it, the leader included
}

// attach makes wake-ups reach ch (a relay's wake channel, buffered) until the
// returned detach is called.
func (w *waker) attach(ch chan<- struct{}) (detach func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.relays == nil {
		w.relays = make(map[chan<- struct{}]struct{})
	}
	w.relays[ch] = struct{}{}
	return func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		delete(w.relays, ch)
	}
}

// local wakes the attached relays and reports whether there were any.
func (w *waker) local() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for ch := range w.relays {
		select {
		case ch <- struct{}{}:
		default: // a wake-up is already pending
		}
	}
	return len(w.relays) > 0
}

// notify runs send in a flight that starts after this call: its own, or one shared
// with the other callers waiting behind the flight on its way.
func (w *waker) notify(ctx context.Context, send func(context.Context) error) error {
	w.mu.Lock()
	if w.running == nil {
		f := &flight{done: make(chan struct{})}
		w.running = f
		w.mu.Unlock()
		w.fly(ctx, f, send)
		return f.err
	}
	f, lead := w.next, false
	if f == nil {
		f, lead = &flight{done: make(chan struct{})}, true
		w.next = f
	}
	f.joined++
	ahead := w.running
	w.mu.Unlock()

	if !lead {
		select {
		case <-f.done:
			return f.err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	// The leader of the next flight waits for the one ahead, then sends for all
	// its followers, whatever happens to its own context meanwhile: they count on it.
	<-ahead.done
	w.mu.Lock()
	w.next = nil
	w.running = f
	w.mu.Unlock()
	w.fly(context.WithoutCancel(ctx), f, send)
	return f.err
}

func (w *waker) fly(ctx context.Context, f *flight, send func(context.Context) error) {
	f.err = send(ctx)
	w.mu.Lock()
	if w.running == f {
		w.running = nil
	}
	w.mu.Unlock()
	close(f.done)
}
