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
//
// One taker at a time gathers a batch (gathering holds a token): a message that
// arrives while a batch waits for more joins that batch, instead of going to
// another idle worker as a batch of its own.
type queue struct {
	mu       sync.Mutex
	changed  chan struct{} // closed and replaced at every change: a broadcast that select can wait on
	msgs     []queued
	bytes    int64
	maxMsgs  int
	maxBytes int64

	gathering chan struct{} // the token of the taker gathering a batch (capacity 1)
}

// queued is a message and when it arrived.
type queued struct {
	msg     jetstream.Msg
	arrived time.Time
}

func newQueue(maxMsgs int, maxBytes int64) *queue {
	return &queue{changed: make(chan struct{}), maxMsgs: maxMsgs, maxBytes: maxBytes, gathering: make(chan struct{}, 1)}
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
	q.msgs = append(q.msgs, queued{msg: m, arrived: time.Now()})
	q.bytes += size
	q.signal()
	q.mu.Unlock()
	return true
}

// take waits for at least one message, then takes up to maxMsgs of those queued,
// and at most maxBytes of them (always at least one). A batch that is not full
// waits for more until linger has passed since its first message arrived: a batch
// that fills, or a first message that has waited that long already, goes at once.
// ok is false once ctx is done and nothing was taken; a batch being gathered when
// ctx ends is returned at once.
func (q *queue) take(ctx context.Context, maxMsgs int, maxBytes int64, linger time.Duration) (batch []jetstream.Msg, ok bool) {
	select {
	case q.gathering <- struct{}{}:
		defer func() { <-q.gathering }()
	case <-ctx.Done():
		return nil, false
	}
	var lingerDone <-chan time.Time
	var first time.Time // when the batch's first message arrived
	var bytes int64
	for {
		q.mu.Lock()
		for len(q.msgs) > 0 && len(batch) < maxMsgs {
			m := q.msgs[0]
			size := msgSize(m.msg)
			if len(batch) > 0 && bytes+size > maxBytes {
				break
			}
			if len(batch) == 0 {
				first = m.arrived
			}
			batch = append(batch, m.msg)
			q.msgs[0] = queued{}
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
			left := linger - time.Since(first)
			if left <= 0 {
				return batch, true
			}
			t := time.NewTimer(left)
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
		f(m.msg)
	}
}

// drain empties the queue and returns what it held.
func (q *queue) drain() []jetstream.Msg {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := make([]jetstream.Msg, len(q.msgs))
	for i, m := range q.msgs {
		out[i] = m.msg
	}
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
