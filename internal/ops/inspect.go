package ops

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/natssubject"
	"github.com/idemkit/idem/internal/registry"
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/wire"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
)

// KeyReport is everything the database knows about one key.
type KeyReport struct {
	Scope string   `json:"scope"`
	Key   idem.Key `json:"key"`
	// ScopedKey is the identity past the ingress (outbox, stream, inbox).
	ScopedKey string `json:"scoped_key"`
	// AsOf is the database's clock when the snapshot was taken.
	AsOf time.Time `json:"as_of"`
	// Known: some table, idem's or the application's, mentions the key. When false
	// every list below is empty.
	Known bool `json:"known"`

	Request *Request `json:"request"` // nil: no HTTP request recorded
	// InFlight is the request of the key running at the ingress right now (it
	// holds the key's lock; its record is written when it commits); nil when none.
	InFlight    *InFlight    `json:"in_flight,omitempty"`
	Outbox      []OutboxRow  `json:"outbox"`
	Inbox       []InboxRow   `json:"inbox"`
	DeadLetters []DeadLetter `json:"dead_letters"`
	// Effects are the application's rows for the key, read by Config.Effects
	// (empty without it).
	Effects Effects `json:"effects"`

	// OtherScopes, filled only when nothing is known about the key in Scope, lists
	// scopes that do know it ("" is "no scope"): the operator likely forgot the
	// scope.
	OtherScopes []string `json:"other_scopes,omitempty"`
}

// known reports whether any table mentions the key.
func (r *KeyReport) known() bool {
	return r.Request != nil || r.InFlight != nil || len(r.Outbox) > 0 || len(r.Inbox) > 0 || len(r.DeadLetters) > 0 || r.Effects.rows() > 0
}

// InFlight is a request of the key that the ingress is running: the backend whose
// transaction holds the key's advisory lock (pg_locks), read live, not as of AsOf.
type InFlight struct {
	PID int32 `json:"pid"`
	// Since is when its transaction began; nil when this role may not see other
	// roles' sessions (pg_stat_activity; pg_read_all_stats grants it).
	Since *time.Time `json:"since"`
	// Waiting counts the duplicates waiting for it.
	Waiting int64 `json:"waiting"`
}

// Request is the key's idem_requests row: the first response of the HTTP ingress.
type Request struct {
	Method       string    `json:"method"`
	Path         string    `json:"path"`
	Status       string    `json:"status"` // "done": written once, when the request commits ("running" only from an older release)
	ResponseCode *int      `json:"response_code"`
	ResponseBody Bytes     `json:"response_body"`
	Fingerprint  string    `json:"fingerprint"` // hex
	LockedAt     time.Time `json:"locked_at"`
	CreatedAt    time.Time `json:"created_at"`
	ExpiresAt    time.Time `json:"expires_at"`
}

// OutboxRow is one message of the key in idem_outbox.
type OutboxRow struct {
	ID      int64  `json:"id"`
	Subject string `json:"subject"`
	// Message names which message of the intent it is (wire.MessageOf): the
	// subject, or the subject and the name its producer gave it.
	Message     string            `json:"message"`
	MsgID       string            `json:"msg_id"`
	Headers     map[string]string `json:"headers"`
	Payload     Bytes             `json:"payload"`
	CreatedAt   time.Time         `json:"created_at"`
	PublishedAt *time.Time        `json:"published_at"` // nil: not yet published
	Attempts    int               `json:"attempts"`
	LastError   *string           `json:"last_error"`
	ExpiresAt   *time.Time        `json:"expires_at"`
	// Stream and StreamSeq are where the stream acknowledged it (its PubAck).
	Stream    *string `json:"stream"`
	StreamSeq *int64  `json:"stream_seq"`
	// Generation counts the re-drives: the reconciler published it again because
	// the stream lost it.
	Generation int `json:"generation"`
	// CompletedAt is when the reconciler proved every consumer that reads it
	// settled it; AlertedAt when it gave up on it, past every horizon.
	CompletedAt    *time.Time `json:"completed_at"`
	AlertedAt      *time.Time `json:"alerted_at"`
	DeadLetteredAt *time.Time `json:"dead_lettered_at"`
	// Deliveries says, for each registered consumer that should settle it, whether
	// it has.
	Deliveries []Delivery `json:"deliveries"`
}

// Delivery states.
const (
	DeliveryConsumed     = "consumed"      // an inbox row that is done
	DeliveryInProgress   = "in progress"   // an external effect under way (a lease)
	DeliveryDeadLettered = "dead-lettered" // a dead letter of that consumer
	DeliveryNotYet       = "not yet"
)

// Delivery is whether one consumer has settled an outbox message.
type Delivery struct {
	Consumer string `json:"consumer"`
	State    string `json:"state"`
}

// Summary is the message's life in one line: "pending", "published; consumed by
// charges; not yet by emails", "complete", ...
func (o OutboxRow) Summary() string {
	switch {
	case o.DeadLetteredAt != nil:
		return "never published: dead-lettered by the relay"
	case o.PublishedAt == nil && o.Generation > 0:
		return fmt.Sprintf("re-driven (the stream lost it; generation %d), waiting to be published again", o.Generation)
	case o.PublishedAt == nil:
		return "pending, not yet published"
	case o.AlertedAt != nil:
		return "published, never settled by every consumer: given up on past its horizon and dead-lettered"
	}
	parts := []string{"published"}
	if len(o.Deliveries) == 0 {
		parts = append(parts, "no registered consumer reads "+o.Subject)
	}
	byState := map[string][]string{}
	for _, d := range o.Deliveries {
		byState[d.State] = append(byState[d.State], d.Consumer)
	}
	for _, st := range []string{DeliveryConsumed, DeliveryDeadLettered, DeliveryInProgress, DeliveryNotYet} {
		if names := byState[st]; len(names) > 0 {
			parts = append(parts, st+" by "+strings.Join(names, ", "))
		}
	}
	if o.CompletedAt != nil {
		parts = append(parts, "complete")
	}
	if o.Generation > 0 {
		parts = append(parts, fmt.Sprintf("re-driven %d×", o.Generation))
	}
	return strings.Join(parts, "; ")
}

// InboxRow is one consumer's claim of one message of the key in idem_inbox.
type InboxRow struct {
	Consumer string `json:"consumer"`
	// Message is the message claimed (wire.MessageOf), or "" for a row written
	// before schema v5, which stands for every message of the key.
	Message       string     `json:"message"`
	Status        string     `json:"status"` // "done", or "leased" while an external effect is under way
	Result        Bytes      `json:"result"`
	Fingerprint   string     `json:"fingerprint"` // hex
	LeaseUntil    *time.Time `json:"lease_until"`
	LeaseAttempts int        `json:"lease_attempts"`
	Step          *string    `json:"step"`
	CreatedAt     time.Time  `json:"created_at"`
	CompletedAt   *time.Time `json:"completed_at"`
	ExpiresAt     time.Time  `json:"expires_at"`
}

// DeadLetter is one idem_dead_letters row of the key.
type DeadLetter struct {
	ID         int64      `json:"id"`
	Consumer   string     `json:"consumer"`
	Message    string     `json:"message"`
	Subject    string     `json:"subject"`
	Reason     string     `json:"reason"`
	Deliveries int        `json:"deliveries"`
	StreamSeq  *int64     `json:"stream_seq"`
	Payload    Bytes      `json:"payload"`
	CreatedAt  time.Time  `json:"created_at"`
	ReplayedAt *time.Time `json:"replayed_at"`
}

// Inspect reads everything about key in scope (scope "" is no scope): idem's rows
// and, through Config.Effects, the application's, in one snapshot. A key nothing
// knows is not an error: the report says Known false.
func (r *Reader) Inspect(ctx context.Context, scope string, key idem.Key) (*KeyReport, error) {
	if _, err := idem.ParseKey(string(key)); err != nil {
		return nil, fmt.Errorf("ops: inspect: %w", err)
	}
	if err := idem.ValidateScope(scope); err != nil {
		return nil, fmt.Errorf("ops: inspect: %w", err)
	}
	scoped := idem.ScopedKey(scope, key)
	rep := &KeyReport{Scope: scope, Key: key, ScopedKey: scoped}
	err := r.snapshot(ctx, func(tx pgx.Tx, asOf time.Time) error {
		rep.AsOf = asOf
		reqs, err := queryAll(ctx, tx, "request", r.st.Requests.Inspect, scanRequest, scope, string(key))
		if err != nil {
			return err
		}
		if len(reqs) > 0 {
			rep.Request = &reqs[0]
		}
		flying, err := queryAll(ctx, tx, "request in flight", r.st.Requests.InFlight, pgx.RowToStructByPos[InFlight], int64(store.RequestLock(scope, string(key))))
		if err != nil {
			return err
		}
		if len(flying) > 0 {
			rep.InFlight = &flying[0]
		}
		if rep.Outbox, err = queryAll(ctx, tx, "outbox", r.st.Outbox.Inspect, scanOutbox, scoped); err != nil {
			return err
		}
		if rep.Inbox, err = queryAll(ctx, tx, "inbox", r.st.Inbox.Inspect, scanInbox, scoped); err != nil {
			return err
		}
		if rep.DeadLetters, err = queryAll(ctx, tx, "dead letters", r.st.DeadLetters.Inspect, scanDeadLetter, scoped); err != nil {
			return err
		}
		if len(rep.Outbox) > 0 {
			consumers, err := registry.Registered(ctx, tx, r.cfg.Schema)
			if err != nil {
				return fmt.Errorf("ops: inspect: %w", err)
			}
			for i := range rep.Outbox {
				rep.Outbox[i].Deliveries = deliveries(&rep.Outbox[i], consumers, rep.Inbox, rep.DeadLetters, asOf)
			}
		}
		if r.cfg.Effects != nil {
			if rep.Effects, err = r.cfg.Effects(ctx, tx, scope, key); err != nil {
				return fmt.Errorf("ops: application effects: %w", err)
			}
		}
		rep.Effects = rep.Effects.normalized()
		rep.Known = rep.known()
		if !rep.Known {
			if rep.OtherScopes, err = queryAll(ctx, tx, "other scopes", r.st.Requests.OtherScopes, pgx.RowTo[string], string(key), scope); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return rep, nil
}

// deliveries says, for each consumer that should settle m, whether it has: by the
// reconciler's rules, an unexpired inbox row of the message that is done, or a
// dead letter of the message filed since m was written.
func deliveries(m *OutboxRow, consumers []registry.Consumer, inbox []InboxRow, dead []DeadLetter, asOf time.Time) []Delivery {
	stream := ""
	if m.Stream != nil {
		stream = *m.Stream
	}
	replayFor := m.Headers[idem.HeaderReplayFor]
	expected := registry.Expected(consumers, stream, m.Subject, replayFor, m.CreatedAt)
	if stream == "" {
		// Not published yet (or before schema v4): whoever reads the subject.
		expected = nil
		for _, c := range consumers {
			if natssubject.Matches(c.FilterSubject, m.Subject) && wire.IsReplayFor(replayFor, c.Name) {
				expected = append(expected, c)
			}
		}
	}
	out := []Delivery{}
	for _, c := range expected {
		d := Delivery{Consumer: c.Name, State: DeliveryNotYet}
		for _, in := range inbox {
			if in.Consumer == c.Name && (in.Message == m.Message || in.Message == "") && in.ExpiresAt.After(asOf) {
				d.State = DeliveryConsumed
				if in.Status != "done" {
					d.State = DeliveryInProgress
				}
			}
		}
		if d.State != DeliveryConsumed {
			for _, dl := range dead {
				if dl.Consumer == c.Name && dl.Message == m.Message && !dl.CreatedAt.Before(m.CreatedAt) {
					d.State = DeliveryDeadLettered
				}
			}
		}
		out = append(out, d)
	}
	return out
}

func scanRequest(row pgx.CollectableRow) (Request, error) {
	var q Request
	err := row.Scan(&q.Method, &q.Path, &q.Status, &q.ResponseCode, &q.ResponseBody, &q.Fingerprint,
		&q.LockedAt, &q.CreatedAt, &q.ExpiresAt)
	return q, err
}

func scanOutbox(row pgx.CollectableRow) (OutboxRow, error) {
	var o OutboxRow
	var headers []byte
	err := row.Scan(&o.ID, &o.Subject, &o.Message, &o.MsgID, &headers, &o.Payload, &o.CreatedAt, &o.PublishedAt,
		&o.Attempts, &o.LastError, &o.ExpiresAt, &o.Stream, &o.StreamSeq, &o.Generation, &o.CompletedAt, &o.AlertedAt, &o.DeadLetteredAt)
	if err == nil && len(headers) > 0 {
		err = json.Unmarshal(headers, &o.Headers)
	}
	return o, err
}

func scanInbox(row pgx.CollectableRow) (InboxRow, error) {
	var i InboxRow
	err := row.Scan(&i.Consumer, &i.Message, &i.Status, &i.Result, &i.Fingerprint, &i.LeaseUntil, &i.LeaseAttempts,
		&i.Step, &i.CreatedAt, &i.CompletedAt, &i.ExpiresAt)
	return i, err
}

func scanDeadLetter(row pgx.CollectableRow) (DeadLetter, error) {
	var d DeadLetter
	err := row.Scan(&d.ID, &d.Consumer, &d.Message, &d.Subject, &d.Reason, &d.Deliveries, &d.StreamSeq, &d.Payload,
		&d.CreatedAt, &d.ReplayedAt)
	return d, err
}
