package consumer

import (
	"context"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// queue holds the messages fetched and not yet taken into a batch, bounded by count
// and by bytes: a full queue blocks the fetch callback, which holds back the pulls.
// Unlike a channel it can be walked, so that the messages waiting in it get
// in-progress heartbeats too (while the database is down every worker is holding
// its batch, and a queued message would otherwise outlive its AckWait and come
// back as a charged redelivery).
type queue struct {
	mu       sync.Mutex
	changed  chan struct{} // closed and replaced at every change: a broadcast that select can wait on
	msgs     []jetstream.Msg
	bytes    int64
	maxMsgs  int
	maxBytes int64
}

func newQueue(maxMsgs int, maxBytes int64) *queue {
	return &queue{changed: make(chan struct{}), maxMsgs: maxMsgs, maxBytes: maxBytes}
}

// signal wakes every waiter; the caller holds mu.
func (q *queue) signal() {
	close(q.changed)
	q.changed = make(chan struct{})
}

// push adds m, waiting while the queue is full (a message bigger than the byte
// bound is let in alone). It returns false, without adding, once ctx is done.
func (q *queue) push(ctx context.Context, m jetstream.Msg) bool {
	size := msgSize(m)
	q.mu.Lock()
	for len(q.msgs) > 0 && (len(q.msgs) >= q.maxMsgs || q.bytes+size > q.maxBytes) {
		wait := q.changed
		q.mu.Unlock()
		select {
		case <-ctx.Done():
			return false
		case <-wait:
		}
		q.mu.Lock()
	}
	q.msgs = append(q.msgs, m)
	q.bytes += size
	q.signal()
	q.mu.Unlock()
	return true
}

// take waits for at least one message, then takes up to maxMsgs of those queued,
// and at most maxBytes of them (always at least one), waiting up to linger for more
// when the first did not fill the batch. ok is false once ctx is done and nothing
// was taken.
func (q *queue) take(ctx context.Context, maxMsgs int, maxBytes int64, linger time.Duration) (batch []jetstream.Msg, ok bool) {
	var lingerDone <-chan time.Time
	var bytes int64
	for {
		q.mu.Lock()
		for len(q.msgs) > 0 && len(batch) < maxMsgs {
			size := msgSize(q.msgs[0])
			if len(batch) > 0 && bytes+size > maxBytes {
				break
			}
			batch = append(batch, q.msgs[0])
			q.msgs[0] = nil
			q.msgs = q.msgs[1:]
			q.bytes -= size
			bytes += size
		}
		if len(batch) > 0 {
			q.signal()
		}
		full := len(batch) >= maxMsgs || (len(batch) > 0 && len(q.msgs) > 0)
		wait := q.changed
		q.mu.Unlock()
		switch {
		case full, len(batch) > 0 && linger <= 0:
			return batch, true
		case len(batch) > 0 && lingerDone == nil:
			t := time.NewTimer(linger)
			defer t.Stop()
			lingerDone = t.C
		}
		select {
		case <-ctx.Done():
			return batch, len(batch) > 0
		case <-lingerDone:
			return batch, true
		case <-wait:
		}
	}
}

// each calls f for every queued message, under the lock: keep f short.
func (q *queue) each(f func(jetstream.Msg)) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, m := range q.msgs {
		f(m)
	}
}

// drain empties the queue and returns what it held.
func (q *queue) drain() []jetstream.Msg {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := q.msgs
	q.msgs, q.bytes = nil, 0
	q.signal()
	return out
}

// msgSize is what a message holds in memory: its payload and its headers.
func msgSize(m jetstream.Msg) int64 {
	n := len(m.Data())
	for k, vs := range m.Headers() {
		for _, v := range vs {
			n += len(k) + len(v)
		}
	}
	return int64(n)
}
