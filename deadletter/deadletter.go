package deadletter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/wire"
)

// Letter is one row of idem_dead_letters: a message that can never succeed as it
// is, with the reason.
type Letter struct {
	ID       int64  `json:"id"`
	Consumer string `json:"consumer"`
	Key      string `json:"key"`
	// Message names which message of the intent it is (wire.MessageOf): the
	// subject, or the subject and the producer's name for it.
	Message    string            `json:"message"`
	Subject    string            `json:"subject"`
	Headers    map[string]string `json:"headers"`
	Payload    []byte            `json:"payload"`
	Reason     string            `json:"reason"`
	Deliveries int               `json:"deliveries"`
	CreatedAt  time.Time         `json:"created_at"`
	ReplayedAt *time.Time        `json:"replayed_at,omitempty"`
	// InboxExpiresAt is the replay horizon: when the consumer's inbox may forget
	// the delivery. A replay that could reach a consumer after it (one sent
	// later than the horizon less the stream's MaxAge and a margin) could run an
	// effect twice and is refused unless forced. Nil for dead letters filed before schema v3 (horizon unknown)
	// and for messages the broker refused (outbox.RelayConsumer: never delivered,
	// no horizon). A relay's dead letter of a message whose publishes timed out,
	// which the broker may have stored after all, carries the horizon of the
	// consumers that read its subject.
	InboxExpiresAt *time.Time `json:"inbox_expires_at,omitempty"`
	// ReplayBy is the last time a replay is accepted without Force:
	// InboxExpiresAt less the time a replay may spend in the stream (its MaxAge
	// and a margin for the relay). Nil when InboxExpiresAt is.
	ReplayBy *time.Time `json:"replay_by,omitempty"`

	// readAt is when the row was read, by the database's clock, against which
	// InboxExpiresAt is judged.
	readAt time.Time
}

// Filter selects dead letters. Its zero value selects every dead letter not yet
// replayed; each field set narrows the selection.
type Filter struct {
	// Consumer selects one consumer's dead letters (outbox.RelayConsumer: the
	// relay's).
	Consumer string
	// ReasonPrefix selects dead letters whose reason starts with it, such as
	// "permanent handler error" or "max deliveries exceeded".
	ReasonPrefix string
	// Since and Until select dead letters filed in [Since, Until); a zero time is
	// unbounded.
	Since, Until time.Time
	// IDs, when not nil, selects only these dead letters (an empty, non-nil slice
	// selects none).
	IDs []int64
	// IncludeReplayed also selects dead letters replayed before.
	IncludeReplayed bool
	// Limit is the most dead letters selected (0: no limit).
	Limit int
}

func (f Filter) validate() error {
	if f.Limit < 0 {
		return errors.New("deadletter: Filter.Limit must not be negative")
	}
	return nil
}

// args are the parameters $1..$6 of sqlDeadLetterFilter.
func (f Filter) args() []any {
	at := func(t time.Time) *time.Time {
		if t.IsZero() {
			return nil
		}
		return &t
	}
	return []any{f.Consumer, f.ReasonPrefix, at(f.Since), at(f.Until), f.IDs, f.IncludeReplayed}
}

// ReplayOptions tune a replay.
type ReplayOptions struct {
	// DryRun writes nothing and locks nothing: the report says which dead letters
	// would be replayed and which refused.
	DryRun bool
	// Force replays dead letters past their replay horizon, or whose horizon is
	// unknown (filed before schema v3). It may run an effect twice if the consumer
	// had completed this key before: its inbox may no longer remember that. A dead
	// letter without a valid key is refused even when forced.
	Force bool
	// BatchSize is how many dead letters one transaction replays (default 100).
	BatchSize int
}

// defaultReplayBatch is how many dead letters a bulk replay commits at once.
const defaultReplayBatch = 100

// Actions of a ReplayResult.
const (
	// ActionReplayed: written to the outbox for the relay to publish, and marked
	// replayed.
	ActionReplayed = "replayed"
	// ActionWouldReplay: a dry run found nothing against replaying it.
	ActionWouldReplay = "would-replay"
	// ActionRefused: not replayed; Reason says why.
	ActionRefused = "refused"
)

// ReplayResult is what a replay did (or, in a dry run, would do) with one dead
// letter.
type ReplayResult struct {
	ID       int64  `json:"id"`
	Consumer string `json:"consumer"`
	Key      string `json:"key"`
	Action   string `json:"action"`
	// Reason is why the dead letter was refused; empty otherwise.
	Reason string `json:"reason"`
}

// ReplayReport lists every dead letter a replay selected, oldest first.
type ReplayReport struct {
	Results []ReplayResult
}

// Count is how many results have action.
func (r ReplayReport) Count(action string) int {
	n := 0
	for _, res := range r.Results {
		if res.Action == action {
			n++
		}
	}
	return n
}

// ErrReplayRefused is wrapped by the error of a replay that was refused: past the
// replay horizon, horizon unknown, or nothing replayable (no valid key, a header
// that cannot be sent).
var ErrReplayRefused = errors.New("deadletter: replay refused")

// Queue is the operator's view of idem_dead_letters: list, inspect, replay.
//
// A replay puts a dead letter back on its way with its original key: it writes the
// message into the outbox under a new Msg-Id generation (so the broker's duplicate
// window does not swallow it, nor a second replay) and records the replay, in one
// transaction; the relay publishes it. The message carries idem.HeaderReplayFor
// naming the consumer that dead-lettered it: every other consumer of the subject
// acks it without an effect, since its inbox may have forgotten the key by then. A
// replay of a message whose effect already happened is still a duplicate, folded
// by the consumer's inbox — as long as the inbox remembers the key, which is why a
// replay is refused, unless forced, once it could still be in the stream at the
// dead letter's horizon (InboxExpiresAt): past the horizon less the stream's
// MaxAge and a margin for the relay.
// A replay starts with a fresh attempt count. A dead letter the relay filed
// (outbox.RelayConsumer) is replayed to every consumer of its subject; one the
// broker refused never reached the stream, and has no horizon.
type Queue struct {
	// inTransit is how long a replay may stay in the stream (see refusal).
	inTransit time.Duration
	pool      *pgxpool.Pool
	q         store.DeadLetters
	outbox    *outbox.Outbox
}

// New returns the dead letters of inst. It needs no NATS connection:
// a replay goes through the outbox.
func New(inst *install.Installation) *Queue {
	return &Queue{inTransit: inst.Stream().WithDefaults().MaxAge + replayMargin, pool: inst.Pool(), q: parts.Of(inst).Store.DeadLetters, outbox: outbox.New(inst)}
}

// List returns up to limit dead letters (limit <= 0: all), replayed or not, newest
// first: Find with Filter{IncludeReplayed: true, Limit: limit}.
func (dl *Queue) List(ctx context.Context, limit int) ([]Letter, error) {
	return dl.Find(ctx, Filter{IncludeReplayed: true, Limit: max(limit, 0)})
}

// Find returns the dead letters f selects, newest first.
func (dl *Queue) Find(ctx context.Context, f Filter) ([]Letter, error) {
	if err := f.validate(); err != nil {
		return nil, err
	}
	var limit *int
	if f.Limit > 0 {
		limit = &f.Limit
	}
	rows, err := dl.pool.Query(ctx, dl.q.Find, append(f.args(), limit)...)
	if err != nil {
		return nil, fmt.Errorf("deadletter: list dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, dl.scan)
	if err != nil {
		return nil, fmt.Errorf("deadletter: list dead letters: %w", err)
	}
	return out, nil
}

// Get returns one dead letter.
func (dl *Queue) Get(ctx context.Context, id int64) (Letter, error) {
	return dl.get(ctx, dl.pool, dl.q.Get, id)
}

// ReplayID replays dead letter id, replayed before or not (a second replay is
// folded by the inbox); two replays of one dead letter at once run in turn. The
// result says what was done. A refusal is also an error, wrapping ErrReplayRefused
// (and idem.ErrMissingKey or idem.ErrMalformedKey for a dead letter without a
// valid key); nothing is written. With opts.DryRun nothing is written either way.
func (dl *Queue) ReplayID(ctx context.Context, id int64, opts ReplayOptions) (ReplayResult, error) {
	judge := func(d Letter, action string) (ReplayResult, error) {
		refused := d.refusal(opts.Force, dl.inTransit)
		res := d.result(action, refused)
		if refused != nil {
			return res, fmt.Errorf("deadletter: replay dead letter %d: %w", id, refused)
		}
		return res, nil
	}
	if opts.DryRun {
		d, err := dl.get(ctx, dl.pool, dl.q.Get, id)
		if err != nil {
			return ReplayResult{}, err
		}
		return judge(d, ActionWouldReplay)
	}
	var res ReplayResult
	err := pgx.BeginFunc(ctx, dl.pool, func(tx pgx.Tx) error {
		d, err := dl.get(ctx, tx, dl.q.GetForUpdate, id)
		if err != nil {
			return err
		}
		if res, err = judge(d, ActionReplayed); err != nil {
			return err
		}
		if err := dl.republish(ctx, tx, d); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, dl.q.MarkReplayed, []int64{id}); err != nil {
			return fmt.Errorf("deadletter: replay dead letter %d: record: %w", id, err)
		}
		return nil
	})
	if err != nil && res.Action != ActionRefused {
		return ReplayResult{}, err
	}
	return res, err
}

// Replay replays every dead letter f selects, oldest first, one transaction per
// opts.BatchSize of them; the report lists each with what was done (or, in a dry
// run, would be done). Dead letters another replay holds at the same moment are
// left to it, and each is replayed at most once per call, so two operators
// replaying the same selection at once replay every dead letter once between them.
// A refusal is a result, not an error: the others are still replayed. An error
// stops the replay; the report holds the batches committed before it.
func (dl *Queue) Replay(ctx context.Context, f Filter, opts ReplayOptions) (ReplayReport, error) {
	if err := f.validate(); err != nil {
		return ReplayReport{}, err
	}
	if opts.BatchSize < 0 {
		return ReplayReport{}, errors.New("deadletter: replay: BatchSize must not be negative")
	}
	if opts.BatchSize == 0 {
		opts.BatchSize = defaultReplayBatch
	}
	var rep ReplayReport
	var after int64 // the cursor: every call moves past a dead letter once
	for {
		n := opts.BatchSize
		if f.Limit > 0 {
			n = min(n, f.Limit-len(rep.Results))
		}
		if n <= 0 {
			return rep, nil
		}
		results, err := dl.replayBatch(ctx, f, opts, after, n)
		if err != nil {
			return rep, err
		}
		rep.Results = append(rep.Results, results...)
		if len(results) < n {
			return rep, nil
		}
		after = results[len(results)-1].ID
	}
}

// replayBatch replays (or judges, in a dry run) up to n dead letters after id
// after, in one transaction.
func (dl *Queue) replayBatch(ctx context.Context, f Filter, opts ReplayOptions, after int64, n int) ([]ReplayResult, error) {
	args := append(f.args(), after, n)
	if opts.DryRun {
		rows, err := dl.pool.Query(ctx, dl.q.ReplayBatchDry, args...)
		if err != nil {
			return nil, fmt.Errorf("deadletter: replay: %w", err)
		}
		ds, err := pgx.CollectRows(rows, dl.scan)
		if err != nil {
			return nil, fmt.Errorf("deadletter: replay: %w", err)
		}
		results := make([]ReplayResult, len(ds))
		for i, d := range ds {
			results[i] = d.result(ActionWouldReplay, d.refusal(opts.Force, dl.inTransit))
		}
		return results, nil
	}
	var results []ReplayResult
	err := pgx.BeginFunc(ctx, dl.pool, func(tx pgx.Tx) error {
		results = results[:0]
		rows, err := tx.Query(ctx, dl.q.ReplayBatch, args...)
		if err != nil {
			return fmt.Errorf("deadletter: replay: %w", err)
		}
		ds, err := pgx.CollectRows(rows, dl.scan)
		if err != nil {
			return fmt.Errorf("deadletter: replay: %w", err)
		}
		var replayed []int64
		for _, d := range ds {
			refused := d.refusal(opts.Force, dl.inTransit)
			if refused == nil {
				if err := dl.republish(ctx, tx, d); err != nil {
					return err
				}
				replayed = append(replayed, d.ID)
			}
			results = append(results, d.result(ActionReplayed, refused))
		}
		if len(replayed) > 0 {
			if _, err := tx.Exec(ctx, dl.q.MarkReplayed, replayed); err != nil {
				return fmt.Errorf("deadletter: replay: record: %w", err)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return results, nil
}

// republish writes d's message into the outbox, inside tx, under a generation of
// its own: two dead letters of one subject and key (one per consumer, say) replayed
// together must not share a Nats-Msg-Id.
func (dl *Queue) republish(ctx context.Context, tx pgx.Tx, d Letter) error {
	generation := fmt.Sprintf("replay-%d-%d", d.ID, time.Now().UnixNano())
	if err := dl.outbox.Republish(ctx, tx, generation, d.replayFor(), d.message()); err != nil {
		return fmt.Errorf("deadletter: replay dead letter %d: %w", d.ID, err)
	}
	return nil
}

// message is what a replay of d publishes: the original subject, key, name,
// headers and payload.
func (d Letter) message() idem.Message {
	headers := make(map[string]string, len(d.Headers))
	for k, v := range d.Headers {
		// The relay sets its own headers afresh; the broker's are instructions to
		// the stream for the original publish, not part of the message.
		if !wire.IsRelayHeader(k) && !wire.ReservedByBroker(k) {
			headers[k] = v
		}
	}
	name, _ := strings.CutPrefix(d.Message, d.Subject+" ")
	if name == d.Message {
		name = ""
	}
	return idem.Message{Key: d.Key, Subject: d.Subject, Name: name, Headers: headers, Payload: d.Payload}
}

// replayFor is the consumer a replay of d is for: the one that dead-lettered it, or
// every consumer of the subject for a dead letter the relay filed.
func (d Letter) replayFor() string {
	if d.Consumer == outbox.RelayConsumer {
		return ""
	}
	return d.Consumer
}

// replayMargin is what a replay's horizon keeps back, past the stream's MaxAge,
// for the relay's delay: the reconciler's default Margin, for its re-drives.
const replayMargin = time.Hour

// refusal says why d must not be replayed now (wrapping ErrReplayRefused), or nil.
// A replay stays in the stream for up to inTransit (its MaxAge, and a margin for
// the relay): a consumer lagging that long reads it then, so the replay must be
// sent that long before the horizon, or it may arrive after the key is forgotten.
func (d Letter) refusal(force bool, inTransit time.Duration) error {
	if _, _, err := idem.ParseScopedKey(d.Key); err != nil {
		return fmt.Errorf("%w: no valid %s (%w): fix its producer instead", ErrReplayRefused, idem.HeaderKey, err)
	}
	if err := idem.ValidateSubject(d.Subject); err != nil {
		return fmt.Errorf("%w: subject: %w", ErrReplayRefused, err)
	}
	if m := d.message(); wire.MessageOf(m.Subject, m.Name) != d.Message {
		return fmt.Errorf("%w: message %q is not of subject %s", ErrReplayRefused, d.Message, d.Subject)
	}
	for name, v := range d.message().Headers {
		if err := wire.ValidateHeader(name, v); err != nil {
			return fmt.Errorf("%w: %w", ErrReplayRefused, err)
		}
	}
	if force || (d.Consumer == outbox.RelayConsumer && d.InboxExpiresAt == nil) {
		return nil // forced, or never delivered
	}
	late := d.InboxExpiresAt != nil && !d.readAt.Before(d.InboxExpiresAt.Add(-inTransit))
	switch {
	case d.InboxExpiresAt == nil:
		return fmt.Errorf("%w: replay horizon unknown (filed before schema v3): the inbox of consumer %s may have forgotten key %q, "+
			"so a replay could run its effect twice; force it only if the effect never ran", ErrReplayRefused, d.Consumer, d.Key)
	case late && d.Consumer == outbox.RelayConsumer:
		return fmt.Errorf("%w: past its replay horizon: it may have reached the stream, and a consumer of %s may have run it and forget key %q at %s, "+
			"before a replay sent now leaves the stream (%s), so the replay could run its effect twice; force it only if no consumer ran it",
			ErrReplayRefused, d.Subject, d.Key, d.InboxExpiresAt.UTC().Format(time.RFC3339), inTransit)
	case late:
		return fmt.Errorf("%w: past its replay horizon: the inbox of consumer %s may forget key %q at %s, "+
			"before a replay sent now leaves the stream (%s), so the replay could run its effect twice; force it only if the effect never ran",
			ErrReplayRefused, d.Consumer, d.Key, d.InboxExpiresAt.UTC().Format(time.RFC3339), inTransit)
	}
	return nil
}

// result is d's line in a report: action, or refused with the reason.
func (d Letter) result(action string, refused error) ReplayResult {
	r := ReplayResult{ID: d.ID, Consumer: d.Consumer, Key: d.Key, Action: action}
	if refused != nil {
		r.Action, r.Reason = ActionRefused, refused.Error()
	}
	return r
}

type queryer interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

func (dl *Queue) get(ctx context.Context, db queryer, sql string, id int64) (Letter, error) {
	rows, err := db.Query(ctx, sql, id)
	if err != nil {
		return Letter{}, fmt.Errorf("deadletter: dead letter %d: %w", id, err)
	}
	d, err := pgx.CollectExactlyOneRow(rows, dl.scan)
	if errors.Is(err, pgx.ErrNoRows) {
		return Letter{}, fmt.Errorf("deadletter: dead letter %d: not found", id)
	}
	if err != nil {
		return Letter{}, fmt.Errorf("deadletter: dead letter %d: %w", id, err)
	}
	return d, nil
}

// scan reads a dead letter (store.DeadLetters' columns) and dates its ReplayBy.
func (dl *Queue) scan(row pgx.CollectableRow) (Letter, error) {
	var d Letter
	var headers []byte
	err := row.Scan(&d.ID, &d.Consumer, &d.Key, &d.Message, &d.Subject, &headers, &d.Payload, &d.Reason, &d.Deliveries, &d.CreatedAt, &d.ReplayedAt,
		&d.InboxExpiresAt, &d.readAt)
	if err == nil && len(headers) > 0 {
		err = json.Unmarshal(headers, &d.Headers)
	}
	if d.InboxExpiresAt != nil {
		by := d.InboxExpiresAt.Add(-dl.inTransit)
		d.ReplayBy = &by
	}
	return d, err
}
