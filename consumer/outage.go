package consumer

import (
	"context"
	"errors"
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
