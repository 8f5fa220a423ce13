package dedupe

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/store"
)

// DefaultLifetime is how long an inbox key is remembered by default. It must outlast
// every window in which the intent can be delivered again; see Lifetimes.
const DefaultLifetime = 72 * time.Hour

// Inbox is the idem_inbox table of one schema. It holds no connection: every method
// takes the transaction or pool it runs on. It is safe for concurrent use.
type Inbox struct {
	q      store.Inbox
	schema string
	// layout caches whether idem_inbox is partitioned (package partition): 0 not
	// yet known, layoutPlain or layoutPartitioned. It is learnt on first use and
	// forgotten when a plain-table claim finds the table converted under it.
	layout atomic.Int32
}

const (
	layoutPlain int32 = iota + 1
	layoutPartitioned
)

// partitioned reports whether the inbox table is partitioned, asking q once.
func (in *Inbox) partitioned(ctx context.Context, q pgschema.Row) (bool, error) {
	switch in.layout.Load() {
	case layoutPlain:
		return false, nil
	case layoutPartitioned:
		return true, nil
	}
	ok, err := pgschema.Partitioned(ctx, q, in.schema, "idem_inbox")
	if err != nil {
		return false, fmt.Errorf("dedupe: %w", err)
	}
	if ok {
		in.layout.Store(layoutPartitioned)
	} else {
		in.layout.Store(layoutPlain)
	}
	return ok, nil
}

// relearnLayout forgets the cached layout when err says the table is no longer
// the plain one the statement was written for: ON CONFLICT (consumer, key) has
// no unique index to use on a partitioned inbox (SQLSTATE 42P10). The caller's
// retry then uses the partitioned claim.
func (in *Inbox) relearnLayout(err error) {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42P10" {
		in.layout.Store(0)
	}
}

// New returns the inbox of inst. The inbox learns on its first claim whether the
// table is partitioned (`worker partition`) and claims accordingly, so use one
// Inbox per installation.
func New(inst *install.Installation) *Inbox {
	return &Inbox{q: inst.Store().Inbox, schema: inst.Schema()}
}

// fingerprint is the SHA-256 of a payload: what a key was first seen with.
func fingerprint(payload []byte) []byte {
	sum := sha256.Sum256(payload)
	return sum[:]
}

// Querier is what the inbox needs from a connection, pool or transaction.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ID names one delivery within a consumer: the intent (its scoped key) and which of
// the intent's messages it is (idem.MessageOf: the subject, or the subject and the
// name the producer gave it). Two messages of one intent are two deliveries; every
// repeat of one message is the same delivery.
type ID struct {
	Key     string
	Message string
}

// Claim is one delivery to claim, with the payload it arrived with.
type Claim struct {
	Key     string
	Message string
	Payload []byte
}

// ID is the delivery c claims.
func (c Claim) ID() ID { return ID{Key: c.Key, Message: c.Message} }

// Verdict is what the inbox says of one claimed delivery.
type Verdict int

const (
	// Fresh: the delivery is new; this transaction owns it and must run the effect.
	Fresh Verdict = iota + 1
	// Duplicate: the delivery was claimed before with the same payload; the effect
	// has happened (or is under way in an external lease). Run nothing.
	Duplicate
	// Mismatch: the delivery was claimed before with a different payload: a
	// producer bug, never merged.
	Mismatch
	// Absent: (Check only) the inbox does not know the delivery.
	Absent
)

// String names the verdict, for logs.
func (v Verdict) String() string {
	switch v {
	case Fresh:
		return "fresh"
	case Duplicate:
		return "duplicate"
	case Mismatch:
		return "mismatch"
	case Absent:
		return "absent"
	}
	return fmt.Sprintf("Verdict(%d)", int(v))
}

// Claim claims deliveries for consumer inside tx and judges each: Fresh, Duplicate
// or Mismatch. Claims must not repeat a delivery (fold repeats inside a batch
// first), and must name their message.
//
// A fresh delivery's row is stored as done with a nil result, so the caller's
// effect and the claim commit together or not at all; SetResults fills results in.
// Deliveries are claimed in sorted order so that two workers claiming overlapping
// batches wait on each other in the same order and cannot deadlock. A delivery
// claimed concurrently by an uncommitted transaction makes this one wait for it:
// exactly one of them sees it fresh.
func (in *Inbox) Claim(ctx context.Context, tx pgx.Tx, consumer string, claims []Claim, lifetime time.Duration) (map[ID]Verdict, error) {
	out := make(map[ID]Verdict, len(claims))
	if len(claims) == 0 {
		return out, nil
	}
	if lifetime <= 0 {
		lifetime = DefaultLifetime
	}
	sorted := slices.Clone(claims)
	slices.SortFunc(sorted, func(a, b Claim) int {
		if c := strings.Compare(a.Key, b.Key); c != 0 {
			return c
		}
		return strings.Compare(a.Message, b.Message)
	})
	keys := make([]string, len(sorted))
	messages := make([]string, len(sorted))
	fps := make([][]byte, len(sorted))
	for i, c := range sorted {
		if c.Message == "" {
			return nil, fmt.Errorf("dedupe: claim: key %q names no message", c.Key)
		}
		keys[i], messages[i], fps[i] = c.Key, c.Message, fingerprint(c.Payload)
	}
	partitioned, err := in.partitioned(ctx, tx)
	if err != nil {
		return nil, err
	}
	var claimed []ID
	if partitioned {
		claimed, err = in.claimPartitioned(ctx, tx, consumer, keys, messages, fps, lifetime)
	} else {
		var rows pgx.Rows
		if rows, err = tx.Query(ctx, in.q.Claim, consumer, keys, messages, fps, lifetime); err == nil {
			claimed, err = pgx.CollectRows(rows, scanID)
		}
		in.relearnLayout(err)
	}
	if err != nil {
		return nil, fmt.Errorf("dedupe: claim: %w", err)
	}
	for _, id := range claimed {
		out[id] = Fresh
	}
	var seen []Claim
	for _, c := range sorted {
		if out[c.ID()] != Fresh {
			seen = append(seen, c)
		}
	}
	judged, err := in.Check(ctx, tx, consumer, seen)
	if err != nil {
		return nil, err
	}
	for _, c := range seen {
		v := judged[c.ID()]
		if v == Absent {
			// Claimed concurrently and then rolled back between our claim and our
			// look-up. The caller rolls back and the delivery is retried.
			return nil, fmt.Errorf("dedupe: claim: key %q, message %q vanished between claim and look-up", c.Key, c.Message)
		}
		out[c.ID()] = v
	}
	return out, nil
}

func scanID(row pgx.CollectableRow) (ID, error) {
	var id ID
	err := row.Scan(&id.Key, &id.Message)
	return id, err
}

// claimPartitioned claims deliveries in a partitioned inbox: the keys' advisory
// locks, then the insert of the deliveries no partition has, in one round trip.
func (in *Inbox) claimPartitioned(ctx context.Context, tx pgx.Tx, consumer string, keys, messages []string, fps [][]byte, lifetime time.Duration) ([]ID, error) {
	b := &pgx.Batch{}
	b.Queue(in.q.ClaimLock, consumer, keys)
	b.Queue(in.q.ClaimPartitioned, consumer, keys, messages, fps, lifetime)
	br := tx.SendBatch(ctx, b)
	defer br.Close()
	if err := keysLocked(br); err != nil {
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	claimed, err := pgx.CollectRows(rows, scanID)
	if err != nil {
		return nil, err
	}
	return claimed, br.Close()
}

// keysLocked reads the result of sqlClaimLock, the first statement of a
// partitioned claim's or lease's pipeline, and refuses any isolation level but
// READ COMMITTED: only there does the next statement see a key committed while
// this one waited for the key's lock.
func keysLocked(br pgx.BatchResults) error {
	var isolation string
	var locked int64
	if err := br.QueryRow().Scan(&isolation, &locked); err != nil {
		return fmt.Errorf("key locks: %w", err)
	}
	if isolation != "read committed" {
		return fmt.Errorf("a partitioned inbox claims only under READ COMMITTED (the transaction is %s): the claim must see a key committed while it waited for the key's lock", strings.ToUpper(isolation))
	}
	return nil
}

// Check judges deliveries without claiming them: Duplicate, Mismatch or Absent.
func (in *Inbox) Check(ctx context.Context, q Querier, consumer string, claims []Claim) (map[ID]Verdict, error) {
	out := make(map[ID]Verdict, len(claims))
	if len(claims) == 0 {
		return out, nil
	}
	ids := make([]ID, len(claims))
	for i, c := range claims {
		ids[i] = c.ID()
	}
	recs, err := in.Lookup(ctx, q, consumer, ids)
	if err != nil {
		return nil, err
	}
	for _, c := range claims {
		rec, ok := recs[c.ID()]
		switch {
		case !ok:
			out[c.ID()] = Absent
		case !rec.Matches(c.Payload):
			out[c.ID()] = Mismatch
		default:
			out[c.ID()] = Duplicate
		}
	}
	return out, nil
}

// SetResults stores the handlers' results for deliveries claimed fresh in tx. Nil
// results are skipped: the row already says done.
func (in *Inbox) SetResults(ctx context.Context, tx pgx.Tx, consumer string, results map[ID][]byte) error {
	b := &pgx.Batch{}
	for id, v := range results {
		if v == nil {
			continue
		}
		b.Queue(in.q.SetResult, consumer, id.Key, id.Message, v)
	}
	if b.Len() == 0 {
		return nil
	}
	br := tx.SendBatch(ctx, b)
	for range b.Len() {
		tag, err := br.Exec()
		if err != nil {
			br.Close()
			return fmt.Errorf("dedupe: store results: %w", err)
		}
		if tag.RowsAffected() != 1 {
			br.Close()
			return fmt.Errorf("dedupe: store results: a delivery was not claimed in this transaction")
		}
	}
	if err := br.Close(); err != nil {
		return fmt.Errorf("dedupe: store results: %w", err)
	}
	return nil
}

// Record is what the inbox remembers of a delivery.
type Record struct {
	Key string
	// Message is the row's message: the delivery's own, or "" for a row written
	// before schema v5, which settles every message of its key.
	Message     string
	Fingerprint []byte
	Status      Status
	Result      []byte
	LeaseUntil  time.Time
	Step        string
	CreatedAt   time.Time
	CompletedAt time.Time
	ExpiresAt   time.Time
}

// Status of an inbox row.
type Status string

const (
	// StatusDone: the effect happened and Result is the first result.
	StatusDone Status = "done"
	// StatusLeased: an external effect is under way (or its worker died) until
	// LeaseUntil; see Inbox.Lease.
	StatusLeased Status = "leased"
)

// Matches reports whether payload is what the delivery was first claimed with.
func (r Record) Matches(payload []byte) bool { return bytes.Equal(r.Fingerprint, fingerprint(payload)) }

// Lookup returns the records of deliveries for consumer, keyed by the ID asked
// for; deliveries the inbox does not know are absent from the map.
func (in *Inbox) Lookup(ctx context.Context, q Querier, consumer string, ids []ID) (map[ID]Record, error) {
	keys := make([]string, len(ids))
	messages := make([]string, len(ids))
	for i, id := range ids {
		keys[i], messages[i] = id.Key, id.Message
	}
	rows, err := q.Query(ctx, in.q.Lookup, consumer, keys, messages)
	if err != nil {
		return nil, fmt.Errorf("dedupe: lookup: %w", err)
	}
	defer rows.Close()
	out := make(map[ID]Record, len(ids))
	for rows.Next() {
		var asked ID
		r, err := scanRecord(rows, &asked.Key, &asked.Message)
		if err != nil {
			return nil, fmt.Errorf("dedupe: lookup: %w", err)
		}
		out[asked] = r
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("dedupe: lookup: %w", err)
	}
	return out, nil
}

// scanRecord reads a row of sqlLookup: the delivery asked for, then the record.
func scanRecord(row pgx.Row, askedKey, askedMessage *string) (Record, error) {
	var (
		r                Record
		status           string
		step             *string
		lease, completed *time.Time
	)
	if err := row.Scan(askedKey, askedMessage, &r.Message, &r.Fingerprint, &status, &r.Result, &lease, &step, &r.CreatedAt, &completed, &r.ExpiresAt); err != nil {
		return Record{}, err
	}
	r.Key = *askedKey
	r.Status = Status(status)
	if lease != nil {
		r.LeaseUntil = *lease
	}
	if completed != nil {
		r.CompletedAt = *completed
	}
	if step != nil {
		r.Step = *step
	}
	return r, nil
}
