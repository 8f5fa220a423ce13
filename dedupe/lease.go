package dedupe

// Leases: the two-phase claim for effects that cannot join a Postgres transaction.
//
// An in-transaction effect (a ledger row) commits together with its inbox claim, so
// there is never a moment in which one exists without the other. An email handed to
// an SMTP server or a charge sent to a payment provider cannot be rolled back with a
// transaction, so the claim is split in two, each phase its own short commit:
//
//	Lease          claim the key as 'leased' until now()+leaseFor      COMMIT
//	               ... perform the effect, passing the key downstream ...
//	               (ExtendLease while it runs; RecordStep after each step)
//	CompleteLease  status 'done', result stored, lease cleared         COMMIT
//
// What another delivery of the same key finds tells it what to do:
//
//	'done'                 LeaseDone: the effect happened; return the first result.
//	'leased', live         LeaseBusy: someone is performing it now; back off.
//	'leased', expired      LeaseAcquired: the holder died (or released it after a
//	                       failure); take over and perform it again, from the last
//	                       recovery point, with the same key.
//	other fingerprint      LeaseMismatch: a producer bug; never merged.
//
// The window between the effect and CompleteLease cannot be closed: a worker that
// dies there leaves a performed effect under an expired lease, and the takeover
// performs it again. That is why the key is passed downstream: a downstream that
// honours it (an Idempotency-Key header, a Message-ID) folds the second attempt, and
// the effect is exactly once; one that does not sees it twice — at least once, but
// never silently zero.

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrLeaseLost is returned by the holder-only operations (ExtendLease, RecordStep,
// CompleteLease, ReleaseLease) when the caller no longer holds the lease: it
// expired and another worker took it over, or the key was completed or collected.
// The caller must stop: the new holder is performing the effect.
var ErrLeaseLost = errors.New("dedupe: lease lost: another worker holds this key now")

// LeaseOutcome is what Lease found for a key.
type LeaseOutcome int

const (
	// LeaseAcquired: the caller holds the lease and must perform the effect, then
	// CompleteLease (or ReleaseLease on failure).
	LeaseAcquired LeaseOutcome = iota + 1
	// LeaseBusy: another worker holds a live lease. Perform nothing; try again
	// after LeaseResult.RetryIn.
	LeaseBusy
	// LeaseDone: the effect was completed; LeaseResult.Result is its first result.
	LeaseDone
	// LeaseMismatch: the key was first claimed with a different payload.
	LeaseMismatch
)

// String names the outcome, for logs.
func (o LeaseOutcome) String() string {
	switch o {
	case LeaseAcquired:
		return "acquired"
	case LeaseBusy:
		return "busy"
	case LeaseDone:
		return "done"
	case LeaseMismatch:
		return "mismatch"
	}
	return fmt.Sprintf("LeaseOutcome(%d)", int(o))
}

// Holder names one acquisition of a lease: the inbox row and the random token that
// proves who holds it. Every acquisition mints a new token, so a worker whose lease
// was taken over is refused by the holder-only operations instead of completing,
// or overwriting the recovery point of, the new holder's attempt.
type Holder struct {
	Consumer string
	Key      string
	// Message is the leased row's message: the delivery's own, or "" for a row
	// written before schema v5 (see Record.Message).
	Message string
	Token   string
}

// LeaseResult is the answer of Lease.
type LeaseResult struct {
	Outcome LeaseOutcome

	// Holder, for LeaseAcquired, is what the holder-only operations take.
	Holder Holder
	// Attempt, for LeaseAcquired, counts acquisitions of this key: 1 the first
	// time, more after a takeover or a released failure. Above 1, an earlier
	// attempt may already have reached the downstream.
	Attempt int
	// Step and StepState, for LeaseAcquired, are the last recovery point recorded
	// by an earlier attempt (RecordStep); empty on a first attempt.
	Step      string
	StepState []byte
	// Until is when the lease ends unless extended: the caller's (LeaseAcquired)
	// or the other worker's (LeaseBusy).
	Until time.Time

	// RetryIn, for LeaseBusy, is how long the other worker's lease still runs by
	// the database's clock: the earliest a retry can take it over.
	RetryIn time.Duration

	// Result, for LeaseDone, is the stored first result.
	Result []byte
}

// leaseTries bounds Lease's loop. Each extra turn happens only when the row changed
// between two statements (it expired, or was deleted, in between), so a second
// turn almost always settles it.
const leaseTries = 5

// Lease claims delivery id for consumer for leaseFor, in its own committed
// statement; see the outcomes of LeaseOutcome. payload is what the message carries
// (a delivery seen with another payload is a LeaseMismatch); lifetime is how long
// the delivery is remembered (default DefaultLifetime).
//
// db must not be a transaction that stays open across the effect: other workers
// learn of the lease only once it commits. Pass a pool.
//
// Taking over an expired lease is race-free: of any number of workers that find
// the same expired lease, exactly one acquires it.
func (in *Inbox) Lease(ctx context.Context, db Querier, consumer string, id ID, payload []byte, leaseFor, lifetime time.Duration) (LeaseResult, error) {
	if leaseFor <= 0 {
		return LeaseResult{}, fmt.Errorf("dedupe: lease %q: leaseFor must be positive, got %s", id.Key, leaseFor)
	}
	if id.Message == "" {
		return LeaseResult{}, fmt.Errorf("dedupe: lease %q: the delivery names no message", id.Key)
	}
	if lifetime <= 0 {
		lifetime = DefaultLifetime
	}
	fp := fingerprint(payload)
	for range leaseTries {
		token := rand.Text()
		acquired := func(row pgx.Row) (LeaseResult, error) {
			r := LeaseResult{Outcome: LeaseAcquired, Holder: Holder{Consumer: consumer, Key: id.Key, Token: token}}
			var step *string
			if err := row.Scan(&r.Holder.Message, &r.Attempt, &step, &r.StepState, &r.Until); err != nil {
				return LeaseResult{}, err
			}
			if step != nil {
				r.Step = *step
			}
			return r, nil
		}
		r, err := in.insertLease(ctx, db, consumer, id, fp, leaseFor, token, lifetime, acquired)
		if err == nil {
			return r, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return LeaseResult{}, fmt.Errorf("dedupe: lease: %w", err)
		}

		// A row settles the delivery already. Find out what it says.
		var (
			message, status string
			had, result     []byte
			leaseUntil      *time.Time
			databaseClock   time.Time
		)
		err = db.QueryRow(ctx, in.q.LeaseInspect, consumer, id.Key, id.Message).Scan(&message, &status, &had, &result, &leaseUntil, &databaseClock)
		if errors.Is(err, pgx.ErrNoRows) {
			continue // deleted in between (collected): claim it afresh
		}
		if err != nil {
			return LeaseResult{}, fmt.Errorf("dedupe: lease: %w", err)
		}
		switch {
		case !bytes.Equal(had, fp):
			return LeaseResult{Outcome: LeaseMismatch}, nil
		case Status(status) == StatusDone:
			return LeaseResult{Outcome: LeaseDone, Result: result}, nil
		case Status(status) != StatusLeased:
			return LeaseResult{}, fmt.Errorf("dedupe: lease %q: unknown inbox status %q", id.Key, status)
		case leaseUntil != nil && leaseUntil.After(databaseClock):
			return LeaseResult{Outcome: LeaseBusy, Until: *leaseUntil, RetryIn: leaseUntil.Sub(databaseClock)}, nil
		}
		// An expired lease: take it over, unless another worker is quicker.
		r, err = acquired(db.QueryRow(ctx, in.q.LeaseTakeOver, consumer, id.Key, message, fp, leaseFor, token))
		if err == nil {
			return r, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return LeaseResult{}, fmt.Errorf("dedupe: lease: take over: %w", err)
		}
	}
	return LeaseResult{}, fmt.Errorf("dedupe: lease %q: the row kept changing under %d attempts", id.Key, leaseTries)
}

// batcher is what a lease on a partitioned inbox needs from db: its key lock and
// its insert go in one pipeline, one implicit transaction.
type batcher interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// insertLease inserts the delivery as leased when no row settles it yet, and
// scans the new row with acquired (pgx.ErrNoRows: a row is in the way).
func (in *Inbox) insertLease(ctx context.Context, db Querier, consumer string, id ID, fp []byte, leaseFor time.Duration, token string, lifetime time.Duration,
	acquired func(pgx.Row) (LeaseResult, error)) (LeaseResult, error) {
	partitioned, err := in.partitioned(ctx, db)
	if err != nil {
		return LeaseResult{}, err
	}
	if !partitioned {
		r, err := acquired(db.QueryRow(ctx, in.q.LeaseInsert, consumer, id.Key, id.Message, fp, leaseFor, token, lifetime))
		in.relearnLayout(err)
		return r, err
	}
	bdb, ok := db.(batcher)
	if !ok {
		return LeaseResult{}, fmt.Errorf("a lease on a partitioned inbox needs a pool, connection or transaction (SendBatch), not %T", db)
	}
	b := &pgx.Batch{}
	b.Queue(in.q.ClaimLock, consumer, []string{id.Key})
	b.Queue(in.q.LeaseInsertPartitioned, consumer, id.Key, id.Message, fp, leaseFor, token, lifetime)
	br := bdb.SendBatch(ctx, b)
	defer br.Close()
	if err := keysLocked(br); err != nil {
		return LeaseResult{}, err
	}
	r, err := acquired(br.QueryRow())
	if err != nil {
		return LeaseResult{}, err
	}
	return r, br.Close()
}

// ExtendLease pushes the holder's lease to now()+leaseFor and returns the new end.
// A long effect calls it periodically (well within leaseFor) so that no other
// worker mistakes it for dead. ErrLeaseLost means another worker took over.
func (in *Inbox) ExtendLease(ctx context.Context, db Querier, h Holder, leaseFor time.Duration) (time.Time, error) {
	var until time.Time
	err := db.QueryRow(ctx, in.q.LeaseExtend, h.Consumer, h.Key, h.Message, h.Token, leaseFor).Scan(&until)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, ErrLeaseLost
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("dedupe: extend lease: %w", err)
	}
	return until, nil
}

// RecordStep records a recovery point: the last step of a multi-step effect that
// completed, and whatever state the next steps need (the id the provider gave the
// authorization, say). An attempt that takes over after a crash or a failure
// starts from there instead of from the beginning.
func (in *Inbox) RecordStep(ctx context.Context, db Querier, h Holder, step string, state []byte) error {
	return holderOnly(ctx, db, "record step", in.q.LeaseStep, h, step, state)
}

// CompleteLease marks the delivery done with result and clears the lease. Only
// the holder can complete, but the holder can complete after its lease ran out as
// long as nobody took it over: an effect that was performed is recorded whenever it
// can be. ErrLeaseLost means another worker took over (and will perform the effect
// again, with the same key).
func (in *Inbox) CompleteLease(ctx context.Context, db Querier, h Holder, result []byte) error {
	return holderOnly(ctx, db, "complete lease", in.q.LeaseComplete, h, result)
}

// ReleaseLease ends the holder's lease at once, keeping the recovery point, so that
// the retry of a failed effect need not wait for the lease to expire.
func (in *Inbox) ReleaseLease(ctx context.Context, db Querier, h Holder) error {
	return holderOnly(ctx, db, "release lease", in.q.LeaseRelease, h)
}

func holderOnly(ctx context.Context, db Querier, what, sql string, h Holder, args ...any) error {
	tag, err := db.Exec(ctx, sql, append([]any{h.Consumer, h.Key, h.Message, h.Token}, args...)...)
	if err != nil {
		return fmt.Errorf("dedupe: %s: %w", what, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("dedupe: %s: %w", what, ErrLeaseLost)
	}
	return nil
}
