package consumer

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/idemkit/idem/dedupe"
)

// errStopping: the consumer is shutting down while the database is down; the
// deliveries were handed back to the broker, uncharged.
var errStopping = errors.New("consumer: stopping while the database is unavailable")

// whileDatabaseDown runs op until it succeeds or fails for a reason of its own (a
// handler's failure, a fault point). A failure of the database — refused
// connections, a broken connection, a failed commit — is nobody's message's fault:
// the deliveries are held (the caller's heartbeat keeps them ours) and op is tried
// again with a growing pause, instead of naking them into a storm of redeliveries
// that would use up their MaxDeliver without their handler ever running. Shutting
// down meanwhile hands the deliveries back to the broker.
func (c *Consumer) whileDatabaseDown(ctx context.Context, ds []*Delivery, op func() error) error {
	wait := 100 * time.Millisecond
	for {
		err := op()
		if err == nil || !databaseFailure(err) {
			return err
		}
		c.log.WarnContext(ctx, "database unavailable; holding the messages and trying again", "err", err, "messages", len(ds), "retry_in", wait)
		select {
		case <-c.stopping:
			for _, d := range ds {
				_ = d.raw.Nak()
			}
			return errStopping
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
}

// databaseFailure reports whether err is the database's rather than a handler's or
// a fault point's.
func databaseFailure(err error) bool {
	var fa failedAt
	return !errors.As(err, &fa) && !errors.Is(err, errHandler) && !errors.Is(err, errAbandoned) && !errors.Is(err, errStopping) &&
		!errors.Is(err, dedupe.ErrSettleConflict)
}

// untilRecorded runs op, the record of an effect that has already happened, the way
// whileDatabaseDown runs its work, except that op runs on a context the hard stop
// (ctx ending) does not cancel. While the consumer runs, a database failure is
// tried again without end. Once it is stopping, or hard-stopped, op is tried again
// only until leaseEnd, or for a short grace if the lease has already ended by this
// worker's clock: past that bound a takeover may come, and Stop must not wait on a
// database that does not answer. A try the hard stop finds under way gets the same
// bound.
func (c *Consumer) untilRecorded(ctx context.Context, d *Delivery, leaseEnd time.Time, op func(context.Context) error) error {
	grace := max(c.cfg.LeaseFor/5, 10*time.Millisecond)
	bound := func() time.Time { return later(leaseEnd, time.Now().Add(grace)) }
	var until time.Time // set once stopping
	wait := 100 * time.Millisecond
	for {
		err := c.boundedTry(ctx, until, bound, op)
		if err == nil || !databaseFailure(err) {
			return err
		}
		if until.IsZero() && (c.isStopping() || ctx.Err() != nil) {
			until = bound()
		}
		if !until.IsZero() && !time.Now().Before(until) {
			_ = d.raw.Nak()
			return errStopping
		}
		c.log.WarnContext(ctx, "database unavailable; holding a performed effect and trying its record again", "err", err, "key", d.Key, "retry_in", wait)
		if until.IsZero() {
			select {
			case <-c.stopping:
			case <-ctx.Done():
			case <-time.After(wait):
			}
		} else {
			time.Sleep(min(wait, time.Until(until)))
		}
		wait = min(2*wait, 5*time.Second)
	}
}

// boundedTry runs op once on a context that survives ctx: it ends at until, if set,
// or at bound() from the moment ctx ends.
func (c *Consumer) boundedTry(ctx context.Context, until time.Time, bound func() time.Time, op func(context.Context) error) error {
	octx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	if !until.IsZero() {
		var cancelAt context.CancelFunc
		octx, cancelAt = context.WithDeadline(octx, until)
		defer cancelAt()
	}
	var mu sync.Mutex
	var t *time.Timer
	unwatch := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		t = time.AfterFunc(time.Until(bound()), cancel)
	})
	defer func() {
		unwatch()
		mu.Lock()
		defer mu.Unlock()
		if t != nil {
			t.Stop()
		}
	}()
	return op(octx)
}

func (c *Consumer) isStopping() bool {
	select {
	case <-c.stopping:
		return true
	default:
		return false
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
