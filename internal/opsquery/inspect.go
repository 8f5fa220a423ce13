package opsquery

import (
	"context"
	"encoding/json"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
)

// The SQL of Inspect. Past the ingress every table stores the scoped key
// (idem.ScopedKey); idem_requests and the demo's payments and emails store the
// scope and the bare key in two columns.
const (
	sqlInspectRequest = `
SELECT method, path, status, response_code, response_body, encode(fingerprint, 'hex'),
       locked_at, created_at, expires_at
FROM idem_requests
WHERE scope = $1 AND key = $2`

	sqlInspectOutbox = `
SELECT id, subject, msg_id, headers, payload, created_at, published_at, attempts, last_error, expires_at
FROM idem_outbox
WHERE key = $1
ORDER BY id`

	// The inbox's primary key is (consumer, key): a look-up by key alone would scan
	// the table. There are few consumers, so walk them with a "loose index scan"
	// (each step finds the next consumer name with one probe of the primary key)
	// and probe (consumer, key) for each: a handful of index probes, whatever the
	// size of the inbox. LIMIT 1 keeps each probe from being flattened into a join.
	sqlInspectInbox = `
WITH RECURSIVE consumers(name) AS (
    (SELECT consumer FROM idem_inbox ORDER BY consumer LIMIT 1)
    UNION ALL
    SELECT (SELECT consumer FROM idem_inbox WHERE consumer > c.name ORDER BY consumer LIMIT 1)
    FROM consumers c
    WHERE c.name IS NOT NULL
)
SELECT i.consumer, i.status, i.result, encode(i.fingerprint, 'hex'), i.lease_until, i.lease_attempts,
       i.step, i.created_at, i.completed_at, i.expires_at
FROM consumers c
CROSS JOIN LATERAL (
    SELECT * FROM idem_inbox WHERE consumer = c.name AND key = $1 LIMIT 1
) AS i
ORDER BY i.consumer`

	sqlInspectDeadLetters = `
SELECT id, consumer, subject, reason, deliveries, stream_seq, payload, created_at, replayed_at
FROM idem_dead_letters
WHERE key = $1
ORDER BY id`

	// payments and emails have no index on the key (they are the demo's tables, and
	// their writes are guarded by idem_requests): these scan. Fine for a command an
	// operator runs by hand.
	sqlInspectPayments = `
SELECT id, account, amount_cents, created_at FROM payments
WHERE scope = $1 AND idempotency_key = $2
ORDER BY id`

	sqlInspectEmails = `
SELECT id, recipient, subject, created_at FROM emails
WHERE scope = $1 AND idempotency_key = $2
ORDER BY id`

	sqlInspectLedger = `
SELECT id, account, amount_cents, created_at FROM ledger_entries
WHERE idempotency_key = $1
ORDER BY id`

	// Only when nothing at all is known about the key: is it known in other scopes?
	// The request table's key is (scope, key), so this scans; it runs once, by hand.
	sqlInspectOtherScopes = `
SELECT DISTINCT scope FROM idem_requests
WHERE key = $1 AND scope <> $2
ORDER BY scope
LIMIT 20`
)

// KeyReport is everything the database knows about one key.
type KeyReport struct {
	Scope string `json:"scope"`
	Key   string `json:"key"`
	// ScopedKey is the identity past the ingress (outbox, stream, inbox, ledger).
	ScopedKey string `json:"scoped_key"`
	// AsOf is the database's clock when the snapshot was taken.
	AsOf time.Time `json:"as_of"`
	// Known: some table mentions the key. When false every list below is empty.
	Known bool `json:"known"`

	Request     *Request      `json:"request"` // nil: no HTTP request recorded
	Outbox      []OutboxRow   `json:"outbox"`
	Inbox       []InboxRow    `json:"inbox"`
	DeadLetters []DeadLetter  `json:"dead_letters"`
	Payments    []Payment     `json:"payments"`
	Emails      []Email       `json:"emails"`
	Ledger      []LedgerEntry `json:"ledger_entries"`

	// OtherScopes, filled only when nothing is known about the key in Scope, lists
	// scopes that do know it ("" is "no scope"): the operator likely forgot --scope.
	OtherScopes []string `json:"other_scopes,omitempty"`
}

// known reports whether any table mentions the key.
func (r *KeyReport) known() bool {
	return r.Request != nil || len(r.Outbox) > 0 || len(r.Inbox) > 0 || len(r.DeadLetters) > 0 ||
		len(r.Payments) > 0 || len(r.Emails) > 0 || len(r.Ledger) > 0
}

// Request is the key's idem_requests row: the first response of the HTTP ingress.
type Request struct {
	Method       string    `json:"method"`
	Path         string    `json:"path"`
	Status       string    `json:"status"` // "running" until the handler's transaction commits, then "done"
	ResponseCode *int      `json:"response_code"`
	ResponseBody Bytes     `json:"response_body"`
	Fingerprint  string    `json:"fingerprint"` // hex
	LockedAt     time.Time `json:"locked_at"`
	CreatedAt    time.Time `json:"created_at"`
	ExpiresAt    time.Time `json:"expires_at"`
}

// OutboxRow is one message of the key in idem_outbox.
type OutboxRow struct {
	ID          int64             `json:"id"`
	Subject     string            `json:"subject"`
	MsgID       string            `json:"msg_id"`
	Headers     map[string]string `json:"headers"`
	Payload     Bytes             `json:"payload"`
	CreatedAt   time.Time         `json:"created_at"`
	PublishedAt *time.Time        `json:"published_at"` // nil: not yet published
	Attempts    int               `json:"attempts"`
	LastError   *string           `json:"last_error"`
	ExpiresAt   *time.Time        `json:"expires_at"`
}

// InboxRow is one consumer's claim of the key in idem_inbox.
type InboxRow struct {
	Consumer      string     `json:"consumer"`
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
	Subject    string     `json:"subject"`
	Reason     string     `json:"reason"`
	Deliveries int        `json:"deliveries"`
	StreamSeq  *int64     `json:"stream_seq"`
	Payload    Bytes      `json:"payload"`
	CreatedAt  time.Time  `json:"created_at"`
	ReplayedAt *time.Time `json:"replayed_at"`
}

// Payment is a row of the demo's payments table (written by the ingress).
type Payment struct {
	ID          int64     `json:"id"`
	Account     string    `json:"account"`
	AmountCents int64     `json:"amount_cents"`
	CreatedAt   time.Time `json:"created_at"`
}

// Email is a row of the demo's emails table (written by the ingress).
type Email struct {
	ID        int64     `json:"id"`
	Recipient string    `json:"recipient"`
	Subject   string    `json:"subject"`
	CreatedAt time.Time `json:"created_at"`
}

// LedgerEntry is a row of ledger_entries: the effect of a charge. More than one
// per key is a double effect.
type LedgerEntry struct {
	ID          int64     `json:"id"`
	Account     string    `json:"account"`
	AmountCents int64     `json:"amount_cents"`
	CreatedAt   time.Time `json:"created_at"`
}

// Inspect reads everything about key in scope (scope "" is no scope).
func Inspect(ctx context.Context, db DB, scope, key string) (*KeyReport, error) {
	scoped := idem.ScopedKey(scope, idem.Key(key))
	r := &KeyReport{Scope: scope, Key: key, ScopedKey: scoped}
	err := snapshot(ctx, db, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `SELECT now()`).Scan(&r.AsOf); err != nil {
			return err
		}
		reqs, err := queryAll(ctx, tx, "request", sqlInspectRequest, scanRequest, scope, key)
		if err != nil {
			return err
		}
		if len(reqs) > 0 {
			r.Request = &reqs[0]
		}
		if r.Outbox, err = queryAll(ctx, tx, "outbox", sqlInspectOutbox, scanOutbox, scoped); err != nil {
			return err
		}
		if r.Inbox, err = queryAll(ctx, tx, "inbox", sqlInspectInbox, scanInbox, scoped); err != nil {
			return err
		}
		if r.DeadLetters, err = queryAll(ctx, tx, "dead letters", sqlInspectDeadLetters, scanDeadLetter, scoped); err != nil {
			return err
		}
		if r.Payments, err = queryAll(ctx, tx, "payments", sqlInspectPayments, pgx.RowToStructByPos[Payment], scope, key); err != nil {
			return err
		}
		if r.Emails, err = queryAll(ctx, tx, "emails", sqlInspectEmails, pgx.RowToStructByPos[Email], scope, key); err != nil {
			return err
		}
		if r.Ledger, err = queryAll(ctx, tx, "ledger entries", sqlInspectLedger, pgx.RowToStructByPos[LedgerEntry], scoped); err != nil {
			return err
		}
		r.Known = r.known()
		if !r.Known {
			if r.OtherScopes, err = queryAll(ctx, tx, "other scopes", sqlInspectOtherScopes, pgx.RowTo[string], key, scope); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return r, nil
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
	err := row.Scan(&o.ID, &o.Subject, &o.MsgID, &headers, &o.Payload, &o.CreatedAt, &o.PublishedAt,
		&o.Attempts, &o.LastError, &o.ExpiresAt)
	if err == nil && len(headers) > 0 {
		err = json.Unmarshal(headers, &o.Headers)
	}
	return o, err
}

func scanInbox(row pgx.CollectableRow) (InboxRow, error) {
	var i InboxRow
	err := row.Scan(&i.Consumer, &i.Status, &i.Result, &i.Fingerprint, &i.LeaseUntil, &i.LeaseAttempts,
		&i.Step, &i.CreatedAt, &i.CompletedAt, &i.ExpiresAt)
	return i, err
}

func scanDeadLetter(row pgx.CollectableRow) (DeadLetter, error) {
	var d DeadLetter
	err := row.Scan(&d.ID, &d.Consumer, &d.Subject, &d.Reason, &d.Deliveries, &d.StreamSeq, &d.Payload,
		&d.CreatedAt, &d.ReplayedAt)
	return d, err
}
