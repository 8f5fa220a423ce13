package consumer

// The in-transaction path: a batch of deliveries is claimed, run and committed in
// one Postgres transaction, then acked.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/internal/faults"
)

var (
	errHandler   = errors.New("handler failed")
	errAbandoned = errors.New("batch abandoned after commit (fault point)")
)

// runBatches runs ds as one transaction. A delivery whose handler fails is taken out
// and the rest run again in a fresh transaction, so one bad message never takes its
// batch down.
func (c *Consumer) runBatches(ctx context.Context, ds []*Delivery) {
	stopBeat := c.heartbeat(ctx, ds)
	defer stopBeat()
	for len(ds) > 0 {
		start := time.Now()
		res, err := c.runBatch(ctx, ds)
		var fa failedAt
		switch {
		case err == nil:
			c.settle(ctx, res, time.Since(start))
			return
		case errors.As(err, &fa):
			c.fail(ctx, ds[fa.index], ds[fa.index].Deliveries, fa.err)
			ds = append(ds[:fa.index:fa.index], ds[fa.index+1:]...)
		case errors.Is(err, errAbandoned):
			c.log.WarnContext(ctx, "batch abandoned after commit, before ack (fault point)", "messages", len(ds))
			c.observe(OutcomeAbandoned, len(ds), 0)
			return
		case len(ds) > 1 && errors.Is(err, errHandler):
			// A batch handler failed without saying where: run each delivery alone.
			for _, d := range ds {
				c.runBatches(ctx, []*Delivery{d})
			}
			return
		case errors.Is(err, errHandler):
			c.fail(ctx, ds[0], ds[0].Deliveries, err)
			return
		default:
			// The database or the transaction failed, not a handler: the deliveries
			// are redelivered after a short pause.
			c.log.ErrorContext(ctx, "batch failed; will be redelivered", "err", err, "messages", len(ds))
			for _, d := range ds {
				c.retryLater(d, c.cfg.Backoff(1))
			}
			return
		}
	}
}

// batchResult is what a committed batch leaves to settle.
type batchResult struct {
	processed  []*Delivery
	duplicates []*Delivery
	poison     map[*Delivery]string
}

// runBatch is the transaction: claim, run the new, store results, commit.
func (c *Consumer) runBatch(ctx context.Context, ds []*Delivery) (batchResult, error) {
	res := batchResult{poison: map[*Delivery]string{}}
	fs := faults.From(ctx)

	// One claim per key: later deliveries of a key in the same batch are
	// duplicates of the first (or, with another payload, poison). Deliveries past
	// MaxDeliver whose key is new never reached a commit (the worker kept dying, or
	// the handler kept failing): they are only checked, never claimed, so that a
	// replay of their dead letter can still run the effect.
	first := make(map[string]*Delivery, len(ds))
	var claims, checks []dedupe.Claim
	var repeats []*Delivery
	for _, d := range ds {
		if f, ok := first[d.Key]; ok {
			if !bytes.Equal(f.Payload, d.Payload) {
				res.poison[d] = reasonMismatch
			} else {
				repeats = append(repeats, d)
			}
			continue
		}
		first[d.Key] = d
		cl := dedupe.Claim{Key: d.Key, Payload: d.Payload}
		if d.Deliveries > c.cfg.MaxDeliver {
			checks = append(checks, cl)
		} else {
			claims = append(claims, cl)
		}
	}

	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("consumer: begin: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit

	verdicts := make(map[string]dedupe.Verdict, len(claims))
	if fs.On(faults.SkipInboxClaim) {
		for _, cl := range claims {
			verdicts[cl.Key] = dedupe.Fresh // the negative control: no claim at all
		}
	} else if verdicts, err = c.inbox.Claim(ctx, tx, c.cfg.Name, claims, c.cfg.KeyLifetime); err != nil {
		return res, err
	}
	checked, err := c.inbox.Check(ctx, tx, c.cfg.Name, checks)
	if err != nil {
		return res, err
	}
	for k, v := range checked {
		if v == dedupe.Absent {
			d := first[k]
			res.poison[d] = fmt.Sprintf("%s: delivered %d times, MaxDeliver is %d", reasonMaxDeliver, d.Deliveries, c.cfg.MaxDeliver)
			continue
		}
		verdicts[k] = v
	}

	var fresh []*Delivery
	for _, d := range ds { // delivery order: handlers run in the order messages came
		if first[d.Key] != d {
			continue
		}
		switch verdicts[d.Key] {
		case dedupe.Fresh:
			fresh = append(fresh, d)
		case dedupe.Duplicate:
			res.duplicates = append(res.duplicates, d)
		case dedupe.Mismatch:
			res.poison[d] = reasonMismatch
		}
	}

	if len(fresh) > 0 {
		results, err := c.batch.HandleBatch(ctx, tx, fresh)
		if err != nil {
			var fa failedAt
			if errors.As(err, &fa) && fa.index >= 0 && fa.index < len(fresh) {
				return res, failedAt{index: indexOf(ds, fresh[fa.index]), err: fa.err}
			}
			return res, fmt.Errorf("%w: %w", errHandler, err)
		}
		if len(results) != len(fresh) {
			return res, fmt.Errorf("%w: returned %d results for %d deliveries", errHandler, len(results), len(fresh))
		}
		if !fs.On(faults.SkipInboxClaim) {
			byKey := make(map[string][]byte, len(fresh))
			for i, d := range fresh {
				byKey[d.Key] = results[i]
			}
			if err := c.inbox.SetResults(ctx, tx, c.cfg.Name, byKey); err != nil {
				return res, err
			}
		}
	}
	if err := fs.Hit(ctx, faults.EffectBeforeCommit, keysOf(ds)); err != nil {
		return res, fmt.Errorf("consumer: before commit: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("consumer: commit: %w", err)
	}
	res.processed = fresh
	// Repeats inside the batch are duplicates of a first that just committed.
	res.duplicates = append(res.duplicates, repeats...)

	if err := fs.Hit(ctx, faults.ConsumerAfterCommit, keysOf(ds)); err != nil {
		return res, fmt.Errorf("%w: %w", errAbandoned, err)
	}
	return res, nil
}

// settle acks a committed batch and dead-letters its poison.
func (c *Consumer) settle(ctx context.Context, res batchResult, took time.Duration) {
	for _, d := range res.processed {
		c.ack(ctx, d)
	}
	for _, d := range res.duplicates {
		c.log.DebugContext(ctx, "duplicate folded", "key", d.Key, "deliveries", d.Deliveries)
		c.ack(ctx, d)
	}
	for d, reason := range res.poison {
		c.deadLetter(ctx, d, reason)
	}
	c.observe(OutcomeProcessed, len(res.processed), took)
	c.observe(OutcomeDuplicate, len(res.duplicates), 0)
}

// heartbeat tells JetStream the batch is still being worked on, every third of
// AckWait, so a long transaction does not trigger a redelivery to another worker.
func (c *Consumer) heartbeat(ctx context.Context, ds []*Delivery) (stop func()) {
	return every(ctx, c.cfg.AckWait/3, func() bool {
		for _, d := range ds {
			_ = d.raw.InProgress()
		}
		return true
	})
}

func indexOf(ds []*Delivery, d *Delivery) int {
	for i := range ds {
		if ds[i] == d {
			return i
		}
	}
	return -1
}

func keysOf(ds []*Delivery) []string {
	keys := make([]string, len(ds))
	for i, d := range ds {
		keys[i] = d.Key
	}
	return keys
}
