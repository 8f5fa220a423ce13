package consumer

// The in-transaction path: a batch of deliveries is claimed, run and committed in
// one Postgres transaction, then acked.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/idemkit/idem"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/otelmsg"
)

var (
	errHandler   = errors.New("handler failed")
	errAbandoned = errors.New("batch abandoned (fault point)")
)

// runBatches takes deliveries from claim to settlement. First deliveries run as one
// transaction. A redelivered one (Deliveries > 1: its worker may have died on it) is
// charged an attempt in Postgres first and runs alone, so a message that crashes
// its worker uses up its own attempts, not its batch-mates'.
func (c *Consumer) runBatches(ctx context.Context, ds []*Delivery) {
	stopBeat := c.heartbeat(ctx, ds)
	defer stopBeat()
	var first []*Delivery
	var again []*Delivery
	for _, d := range ds {
		if d.Deliveries > 1 {
			again = append(again, d)
		} else {
			first = append(first, d)
		}
	}
	// A copy of a delivery whose payload differs from an earlier copy's in the
	// batch waits for that one's transaction, then runs alone: judged against
	// what the inbox holds by then, it is the duplicate or the changed payload it
	// is, whichever copy came first (a redelivery of a settled message beside a
	// changed payload under its key must not be dead-lettered as the change).
	first, later := c.apartFromChangedCopies(first)
	if len(first) > 0 {
		c.runTransactions(ctx, first, nil)
	}
	for _, d := range later {
		c.runTransactions(ctx, []*Delivery{d}, nil)
	}
	for _, d := range again {
		var n int
		err := c.whileDatabaseDown(ctx, []*Delivery{d}, func() (err error) {
			n, err = c.attempts.start(ctx, c.idOf(d))
			return err
		})
		if err != nil {
			continue // shutting down: handed back by whileDatabaseDown
		}
		c.runTransactions(ctx, []*Delivery{d}, map[*Delivery]int{d: n})
	}
}

// apartFromChangedCopies splits ds into the deliveries that run together and the
// later copies of a delivery with another payload than its first copy in ds.
func (c *Consumer) apartFromChangedCopies(ds []*Delivery) (together, later []*Delivery) {
	seen := make(map[dedupe.ID][]byte, len(ds))
	for _, d := range ds {
		id := c.idOf(d)
		if p, ok := seen[id]; ok && !bytes.Equal(p, d.Payload) {
			later = append(later, d)
			continue
		}
		if _, ok := seen[id]; !ok {
			seen[id] = d.Payload
		}
		together = append(together, d)
	}
	return together, later
}

// runTransactions runs ds as one transaction. A delivery whose handler fails is
// taken out and the rest run again in a fresh transaction, so one bad message never
// takes its batch down. attempt holds the Postgres count of the deliveries charged
// before the run; the others are on their first attempt.
func (c *Consumer) runTransactions(ctx context.Context, ds []*Delivery, attempt map[*Delivery]int) {
	for len(ds) > 0 {
		start := time.Now()
		var res batchResult
		err := c.whileDatabaseDown(ctx, ds, func() (err error) {
			res, err = c.runBatch(ctx, ds, attempt)
			return err
		})
		var fa failedAt
		switch {
		case err == nil:
			c.settle(ctx, res, time.Since(start))
			return
		case errors.Is(err, errStopping):
			return // handed back by whileDatabaseDown
		case errors.Is(err, dedupe.ErrSettleConflict):
			// A copy processed at the same moment committed first, and this
			// transaction rolled back. Run again now: the claim finds it settled.
			c.log.DebugContext(ctx, "a concurrent copy settled first; running the batch again", "err", err, "messages", len(ds))
		case errors.As(err, &fa):
			c.handlerFailed(ctx, ds[fa.index], fa.err)
			ds = append(ds[:fa.index:fa.index], ds[fa.index+1:]...)
		case errors.Is(err, errAbandoned):
			c.log.WarnContext(ctx, "batch abandoned (fault point)", "err", err, "messages", len(ds))
			c.observe(idem.OutcomeAbandoned, len(ds), 0)
			return
		case len(ds) > 1:
			// A batch handler failed without saying where: run each delivery alone.
			for _, d := range ds {
				c.runTransactions(ctx, []*Delivery{d}, attempt)
			}
			return
		default:
			c.handlerFailed(ctx, ds[0], err)
			return
		}
	}
}

// handlerFailed charges a handler's failure to its message in Postgres and retries
// or dead-letters it by that count. A database that cannot record the charge does
// not stop the retry: the message comes back after its backoff, uncharged.
//
// A delivery that a concurrent copy settled meanwhile is folded instead: its
// handler may have failed only because of that copy (a unique key of its own
// taken by the copy's effect, a row the copy changed).
func (c *Consumer) handlerFailed(ctx context.Context, d *Delivery, err error) {
	if c.settledMeanwhile(ctx, d) {
		c.log.DebugContext(ctx, "handler failed on a delivery a concurrent copy settled; folded", "key", d.Key, "err", err)
		otelmsg.Fail(d.span, err)
		c.ack(ctx, d)
		c.observe(idem.OutcomeDuplicate, 1, 0)
		return
	}
	n, rerr := c.attempts.fail(ctx, c.idOf(d), err)
	if rerr != nil {
		c.log.WarnContext(ctx, "handler failure not recorded; retrying uncharged", "key", d.Key, "err", rerr)
		n = 1
	}
	c.fail(ctx, d, n, err)
}

// settledMeanwhile reports whether the inbox holds d as settled with its payload
// (a failed look-up says no: the failure is charged as usual).
func (c *Consumer) settledMeanwhile(ctx context.Context, d *Delivery) bool {
	if faults.From(ctx).On(faults.SkipInboxClaim) {
		return false
	}
	id := c.idOf(d)
	v, err := c.inbox.Check(ctx, c.pool, c.cfg.Name, []dedupe.Claim{{Key: id.Key, Message: id.Message, Payload: d.Payload}})
	return err == nil && v[id] == dedupe.Duplicate
}

// batchResult is what a committed batch leaves to settle.
type batchResult struct {
	processed  []*Delivery
	duplicates []*Delivery
	poison     map[*Delivery]string
	handlers   time.Duration // spent in HandleBatch
	committed  time.Time
}

// runBatch is the transaction: claim (look up), run the new, settle them (one row
// each, with its result), commit. Its error is a failedAt or errHandler for a
// handler's failure, errAbandoned for the fault point after commit,
// dedupe.ErrSettleConflict when a concurrent copy settled a delivery first, and
// anything else for the database's (retried in place).
func (c *Consumer) runBatch(ctx context.Context, ds []*Delivery, attempt map[*Delivery]int) (batchResult, error) {
	res := batchResult{poison: map[*Delivery]string{}}
	fs := faults.From(ctx)

	// One claim per delivery (key and message): later copies of it in the same
	// batch are duplicates of the first (or, with another payload, poison).
	// Deliveries whose attempts (counted in Postgres) passed MaxDeliver never
	// reached a commit (the worker kept dying on them, or the handler kept
	// failing): they are only checked, never claimed, so that a replay of their
	// dead letter can still run the effect.
	first := make(map[dedupe.ID]*Delivery, len(ds))
	var claims, checks []dedupe.Claim
	var repeats []*Delivery
	for _, d := range ds {
		id := c.idOf(d)
		if f, ok := first[id]; ok {
			if !bytes.Equal(f.Payload, d.Payload) {
				res.poison[d] = reasonMismatch
			} else {
				repeats = append(repeats, d)
			}
			continue
		}
		first[id] = d
		cl := dedupe.Claim{Key: id.Key, Message: id.Message, Payload: d.Payload}
		if attempt[d] > c.cfg.MaxDeliver {
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

	verdicts := make(map[dedupe.ID]dedupe.Verdict, len(claims))
	if fs.On(faults.SkipInboxClaim) {
		for _, cl := range claims {
			verdicts[cl.ID()] = dedupe.Fresh // the negative control: no claim at all
		}
	} else if verdicts, err = c.inbox.Claim(ctx, tx, c.cfg.Name, claims); err != nil {
		return res, err
	}
	checked, err := c.inbox.Check(ctx, tx, c.cfg.Name, checks)
	if err != nil {
		return res, err
	}
	for id, v := range checked {
		if v == dedupe.Absent {
			d := first[id]
			res.poison[d] = fmt.Sprintf("%s: attempted %d times without an outcome (%d deliveries), MaxDeliver is %d",
				reasonMaxDeliver, attempt[d]-1, d.Deliveries, c.cfg.MaxDeliver)
			continue
		}
		verdicts[id] = v
	}

	var fresh []*Delivery
	for _, d := range ds { // delivery order: handlers run in the order messages came
		id := c.idOf(d)
		if first[id] != d {
			continue
		}
		switch verdicts[id] {
		case dedupe.Fresh:
			fresh = append(fresh, d)
		case dedupe.Duplicate:
			res.duplicates = append(res.duplicates, d)
		case dedupe.Mismatch:
			res.poison[d] = reasonMismatch
		}
	}

	if len(fresh) > 0 {
		began := time.Now()
		results, err := c.handle(ctx, tx, fresh)
		res.handlers = time.Since(began)
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
			done := make([]dedupe.Settlement, len(fresh))
			for i, d := range fresh {
				id := c.idOf(d)
				done[i] = dedupe.Settlement{Claim: dedupe.Claim{Key: id.Key, Message: id.Message, Payload: d.Payload}, Result: results[i]}
			}
			if err := c.inbox.Settle(ctx, tx, c.cfg.Name, done, c.cfg.KeyLifetime); err != nil {
				return res, err
			}
		}
	}
	if len(fresh) == 0 {
		// No handler ran: nothing for the fault point to interrupt.
	} else if err := fs.Hit(ctx, faults.EffectBeforeCommit, keysOf(fresh)); err != nil {
		// As if the worker died here: the transaction rolls back with the
		// deferred Rollback, and the messages are left for their AckWait.
		return res, fmt.Errorf("%w: before commit: %w", errAbandoned, err)
	}
	if err := tx.Commit(ctx); err != nil {
		if errors.Is(err, pgx.ErrTxCommitRollback) {
			// A handler ignored a failed statement and left the transaction
			// aborted: its failure, not the database's.
			return res, fmt.Errorf("%w: the transaction was aborted by a failed statement the handler ignored: %w", errHandler, err)
		}
		return res, fmt.Errorf("consumer: commit: %w", err)
	}
	res.processed, res.committed = fresh, time.Now()
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
	c.observeProcessed(res.processed, took, res.handlers, res.committed)
	c.observe(idem.OutcomeDuplicate, len(res.duplicates), 0)
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

// handle runs the batch handler, turning a panic into that handler's failure: the
// worker survives, the message fails alone (a panicking batch is run one delivery
// at a time) and is charged like any failure.
func (c *Consumer) handle(ctx context.Context, tx pgx.Tx, ds []*Delivery) (results [][]byte, err error) {
	defer func() {
		if v := recover(); v != nil {
			c.log.ErrorContext(ctx, "handler panicked", "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
			results, err = nil, fmt.Errorf("handler panicked: %v", v)
		}
	}()
	if fs := faults.From(ctx); fs != nil {
		for _, d := range ds {
			fs.Marked(d.Headers[faults.MarkHeader])
		}
	}
	return c.batch.HandleBatch(ctx, tx, ds)
}
