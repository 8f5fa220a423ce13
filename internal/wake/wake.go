// Package wake wakes the outbox relays of an installation when rows are committed:
// a relay of the same process directly, at no cost to the database, and the
// others with a NOTIFY that concurrent committers share.
package wake

import (
	"context"
	"sync"
)

// Waker holds the relays of this process listening to one installation, and
// coalesces the NOTIFYs sent when there are none. Its zero value is ready to use.
type Waker struct {
	mu     sync.Mutex
	relays map[chan<- struct{}]struct{}
	// byLog: a log relay of this process reads the commits from the slot; new
	// rows need no wake-up.
	byLog bool

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

// Attach makes wake-ups reach ch (a relay's wake channel, buffered) until the
// returned detach is called.
func (w *Waker) Attach(ch chan<- struct{}) (detach func()) {
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

// ByLog says that a log relay of this process publishes new rows (on), or no
// longer does (off): while it does, Local wakes nobody and reports true.
func (w *Waker) ByLog(on bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.byLog = on
}

// Logged reports whether a log relay of this process publishes new rows.
func (w *Waker) Logged() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.byLog
}

// Local wakes the attached relays and reports whether there were any (or a log
// relay of this process reads the commits itself).
func (w *Waker) Local() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.byLog {
		return true
	}
	for ch := range w.relays {
		select {
		case ch <- struct{}{}:
		default: // a wake-up is already pending
		}
	}
	return len(w.relays) > 0
}

// Notify runs send in a flight that starts after this call: its own, or one shared
// with the other callers waiting behind the flight on its way.
func (w *Waker) Notify(ctx context.Context, send func(context.Context) error) error {
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

func (w *Waker) fly(ctx context.Context, f *flight, send func(context.Context) error) {
	f.err = send(ctx)
	w.mu.Lock()
	if w.running == f {
		w.running = nil
	}
	w.mu.Unlock()
	close(f.done)
}
