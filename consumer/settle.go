package consumer

// The one settle path both kinds of handler share: ack, retry, dead-letter, report.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/otelmsg"
)

func (c *Consumer) ack(ctx context.Context, d *Delivery) {
	if err := d.raw.Ack(); err != nil {
		// Harmless for correctness: the redelivery will be folded by the inbox.
		c.log.WarnContext(ctx, "ack failed; the redelivery will be a duplicate", "key", d.Key, "err", err)
	}
}

// fail handles a handler's error for one delivery, charged as its attempt-th
// attempt: dead-letter it when the error is permanent or the attempts are used up,
// retry it later otherwise.
func (c *Consumer) fail(ctx context.Context, d *Delivery, attempt int, err error) {
	otelmsg.Fail(d.span, err)
	switch {
	case IsPermanent(err):
		c.deadLetter(ctx, d, fmt.Sprintf("%s: %v", reasonPermanent, err))
	case dataError(err):
		c.deadLetter(ctx, d, fmt.Sprintf("%s: the database refuses the message's data, which no retry can change: %v", reasonPermanent, err))
	case attempt >= c.cfg.MaxDeliver:
		c.deadLetter(ctx, d, fmt.Sprintf("%s: failed %d attempts (%d deliveries), last error: %v",
			reasonMaxDeliver, attempt, d.Deliveries, err))
	default:
		delay := c.cfg.Backoff(attempt)
		c.log.WarnContext(ctx, "handler failed; will retry", "key", d.Key, "attempt", attempt, "retry_in", delay, "err", err)
		c.retryLater(d, delay)
	}
}

// dataError reports a Postgres data exception (SQLSTATE class 22: a NUL in a text
// value, invalid UTF-8, a number out of range, a malformed date): the message's data
// is wrong for the handler's statements, and running it again cannot succeed.
func dataError(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && strings.HasPrefix(pe.Code, "22")
}

// retryLater hands d back to the broker for redelivery after delay.
func (c *Consumer) retryLater(d *Delivery, delay time.Duration) {
	_ = d.raw.NakWithDelay(delay)
	c.observe(idem.OutcomeFailed, 1, 0)
}

// observeProcessed reports deliveries whose effect committed at committed: the
// batch's duration, the part of it in handlers, and each message's end-to-end
// latency from its outbox row (idem.HeaderEnqueuedAt), when it has one.
func (c *Consumer) observeProcessed(ds []*Delivery, took, handlers time.Duration, committed time.Time) {
	if len(ds) == 0 || c.observer == nil {
		return // no latencies to compute for nobody
	}
	e := idem.Event{Component: idem.ComponentConsumer, Name: c.cfg.Name, Outcome: idem.OutcomeProcessed,
		Count: len(ds), Duration: took, HandlerDuration: handlers}
	for _, d := range ds {
		if !d.EnqueuedAt.IsZero() {
			e.EndToEnd = append(e.EndToEnd, committed.Sub(d.EnqueuedAt))
		}
	}
	c.observer.Observe(e)
}

func (c *Consumer) observe(outcome idem.Outcome, n int, took time.Duration) {
	if n > 0 {
		c.observer.Observe(idem.Event{Component: idem.ComponentConsumer, Name: c.cfg.Name, Outcome: outcome, Count: n, Duration: took})
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// every runs tick every interval in its own goroutine until tick returns false,
// ctx ends or stop is called. stop waits for the goroutine, so no tick runs after
// it returns (no heartbeat after the ack, no lease extension after completion).
func every(ctx context.Context, interval time.Duration, tick func() (again bool)) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if !tick() {
				return
			}
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
}
