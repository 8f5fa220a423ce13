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
	"github.com/idemkit/idem/internal/parts"
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
	return &Inbox{q: parts.Of(inst).Store.Inbox, schema: inst.Schema()}
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
// the intent's messages it is (wire.MessageOf: the subject, or the subject and the
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

// Claim judges deliveries for consumer inside tx, before their effect runs:
// Fresh, Duplicate or Mismatch. Claims must not repeat a delivery (fold repeats
// inside a batch first), and must name their message.
//
// Claim writes nothing. A Fresh delivery is recorded only by Settle, in the same
// transaction after its effect: the effect and the delivery's one row commit
// together or not at all. A transaction that commits a Fresh delivery's effect
// without settling it leaves the delivery unknown, and its next copy runs again.
//
// Two transactions may both find a delivery Fresh when they claim it at the same
// moment; Settle then lets exactly one of them commit it (see ErrSettleConflict).
// On a partitioned inbox Claim takes the deliveries' key locks instead, held to
// the end of tx, so a concurrent copy waits in its Claim and then finds the
// delivery settled.
func (in *Inbox) Claim(ctx context.Context, tx pgx.Tx, consumer string, claims []Claim) (map[ID]Verdict, error) {
	out := make(map[ID]Verdict, len(claims))
	if len(claims) == 0 {
		return out, nil
	}
	sorted := sortedDeliveries(claims, func(c Claim) ID { return c.ID() })
	if err := checkDeliveries(sorted, func(c Claim) ID { return c.ID() }); err != nil {
		return nil, fmt.Errorf("dedupe: claim: %w", err)
	}
	partitioned, err := in.partitioned(ctx, tx)
	if err != nil {
		return nil, err
	}
	var recs map[ID]Record
	if partitioned {
		recs, err = in.lookupLocked(ctx, tx, consumer, sorted)
	} else {
		recs, err = in.Lookup(ctx, tx, consumer, idsOf(sorted))
	}
	if err != nil {
		return nil, fmt.Errorf("dedupe: claim: %w", err)
	}
	for _, c := range sorted {
		out[c.ID()] = judge(recs, c)
	}
	return out, nil
}

// lookupLocked takes the keys' advisory locks and then looks the deliveries up,
// in one round trip.
func (in *Inbox) lookupLocked(ctx context.Context, tx pgx.Tx, consumer string, claims []Claim) (map[ID]Record, error) {
	keys, messages := columnsOf(idsOf(claims))
	b := &pgx.Batch{}
	b.Queue(in.q.ClaimLock, consumer, keys)
	b.Queue(in.q.Lookup, consumer, keys, messages)
	br := tx.SendBatch(ctx, b)
	defer br.Close()
	if err := keysLocked(br); err != nil {
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	recs, err := collectRecords(rows, len(claims))
	if err != nil {
		return nil, err
	}
	return recs, br.Close()
}

// judge is the verdict on c given the records found: Fresh when there is none.
func judge(recs map[ID]Record, c Claim) Verdict {
	rec, ok := recs[c.ID()]
	switch {
	case !ok:
		return Fresh
	case !rec.Matches(c.Payload):
		return Mismatch
	default:
		return Duplicate
	}
}

// Settlement is a delivery that Claim judged Fresh, with the result its effect
// produced (nil for none).
type Settlement struct {
	Claim
	Result []byte
}

// ErrSettleConflict is returned by Settle when another transaction settled one of
// the deliveries first: a copy claimed at the same moment committed (the inbox
// keeps its row), or the inbox was partitioned since the claim. The caller's
// transaction is no good any more: roll it back, effect and all, and run the
// deliveries again from Claim, which finds the settled ones Duplicate.
var ErrSettleConflict = errors.New("dedupe: settle: another transaction settled a delivery first; roll back and claim again")

// Settle records deliveries as done, each with its result and its payload's
// fingerprint, in tx: one INSERT of each delivery's finished row, after the effect
// and before the commit. lifetime is how long the deliveries are remembered
// (default DefaultLifetime). Settle only deliveries Claim judged Fresh in tx, each
// once.
//
// A copy of a delivery that another transaction is settling makes Settle wait for
// that transaction: if it commits, Settle fails with ErrSettleConflict (and tx is
// aborted); if it rolls back, Settle goes on. So of two copies processed at once,
// exactly one commits its effect. On a partitioned inbox Settle takes the keys'
// locks again (Claim holds them already) and inserts only what no partition has.
func (in *Inbox) Settle(ctx context.Context, tx pgx.Tx, consumer string, done []Settlement, lifetime time.Duration) error {
	if len(done) == 0 {
		return nil
	}
	if lifetime <= 0 {
		lifetime = DefaultLifetime
	}
	// Sorted, so that two transactions settling overlapping deliveries wait on
	// each other in the same order and cannot deadlock.
	sorted := sortedDeliveries(done, func(s Settlement) ID { return s.ID() })
	if err := checkDeliveries(sorted, func(s Settlement) ID { return s.ID() }); err != nil {
		return fmt.Errorf("dedupe: settle: %w", err)
	}
	keys := make([]string, len(sorted))
	messages := make([]string, len(sorted))
	fps := make([][]byte, len(sorted))
	results := make([][]byte, len(sorted))
	for i, s := range sorted {
		keys[i], messages[i], fps[i], results[i] = s.Key, s.Message, fingerprint(s.Payload), s.Result
	}
	partitioned, err := in.partitioned(ctx, tx)
	if err != nil {
		return err
	}
	var inserted int64
	if partitioned {
		inserted, err = in.settlePartitioned(ctx, tx, consumer, keys, messages, fps, results, lifetime)
	} else {
		var tag pgconn.CommandTag
		tag, err = tx.Exec(ctx, in.q.Settle, consumer, keys, messages, fps, results, lifetime)
		inserted = tag.RowsAffected()
		if err == nil && inserted == 0 {
			// Nothing inserted and no error: the table was partitioned since the
			// layout was learnt. The next claim learns it again.
			in.layout.Store(0)
		}
	}
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &pe) && pe.Code == "23505": // unique_violation: a copy committed first
		return fmt.Errorf("%w (consumer %q): %s", ErrSettleConflict, consumer, pe.Detail)
	case err != nil:
		return fmt.Errorf("dedupe: settle: %w", err)
	case inserted != int64(len(sorted)):
		return fmt.Errorf("%w (consumer %q): %d of %d deliveries were settled already", ErrSettleConflict, consumer, int64(len(sorted))-inserted, len(sorted))
	}
	return nil
}

// settlePartitioned settles deliveries in a partitioned inbox: the keys' advisory
// locks, then the insert of the deliveries no partition has, in one round trip.
func (in *Inbox) settlePartitioned(ctx context.Context, tx pgx.Tx, consumer string, keys, messages []string, fps, results [][]byte, lifetime time.Duration) (int64, error) {
	b := &pgx.Batch{}
	b.Queue(in.q.ClaimLock, consumer, keys)
	b.Queue(in.q.SettlePartitioned, consumer, keys, messages, fps, results, lifetime)
	br := tx.SendBatch(ctx, b)
	defer br.Close()
	if err := keysLocked(br); err != nil {
		return 0, err
	}
	tag, err := br.Exec()
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), br.Close()
}

// sortedDeliveries returns a copy of xs sorted by delivery (key, then message):
// the one order in which every transaction waits for another's deliveries.
func sortedDeliveries[T any](xs []T, id func(T) ID) []T {
	sorted := slices.Clone(xs)
	slices.SortFunc(sorted, func(a, b T) int {
		x, y := id(a), id(b)
		if c := strings.Compare(x.Key, y.Key); c != 0 {
			return c
		}
		return strings.Compare(x.Message, y.Message)
	})
	return sorted
}

// checkDeliveries refuses a delivery that names no message, and one named twice
// (sorted must be sorted by delivery): the caller folds repeats first.
func checkDeliveries[T any](sorted []T, id func(T) ID) error {
	for i, x := range sorted {
		d := id(x)
		if d.Message == "" {
			return fmt.Errorf("key %q names no message", d.Key)
		}
		if i > 0 && id(sorted[i-1]) == d {
			return fmt.Errorf("key %q, message %q is named twice: fold repeats of a delivery first", d.Key, d.Message)
		}
	}
	return nil
}

func idsOf(claims []Claim) []ID {
	ids := make([]ID, len(claims))
	for i, c := range claims {
		ids[i] = c.ID()
	}
	return ids
}

func columnsOf(ids []ID) (keys, messages []string) {
	keys = make([]string, len(ids))
	messages = make([]string, len(ids))
	for i, id := range ids {
		keys[i], messages[i] = id.Key, id.Message
	}
	return keys, messages
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
	recs, err := in.Lookup(ctx, q, consumer, idsOf(claims))
	if err != nil {
		return nil, err
	}
	for _, c := range claims {
		if v := judge(recs, c); v == Fresh {
			out[c.ID()] = Absent
		} else {
			out[c.ID()] = v
		}
	}
	return out, nil
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
	keys, messages := columnsOf(ids)
	rows, err := q.Query(ctx, in.q.Lookup, consumer, keys, messages)
	if err != nil {
		return nil, fmt.Errorf("dedupe: lookup: %w", err)
	}
	recs, err := collectRecords(rows, len(ids))
	if err != nil {
		return nil, fmt.Errorf("dedupe: lookup: %w", err)
	}
	return recs, nil
}

// collectRecords reads the rows of sqlLookup, keyed by the delivery asked for.
func collectRecords(rows pgx.Rows, n int) (map[ID]Record, error) {
	defer rows.Close()
	out := make(map[ID]Record, n)
	for rows.Next() {
		var asked ID
		r, err := scanRecord(rows, &asked.Key, &asked.Message)
		if err != nil {
			return nil, err
		}
		out[asked] = r
	}
	return out, rows.Err()
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
