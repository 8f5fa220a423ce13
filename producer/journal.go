package producer

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/gofrs/flock"

	"github.com/idemkit/idem"
)

// The journal file format.
//
// A journal is an 8-byte file header (journalMagic) followed by frames, appended and
// never rewritten in place:
//
//	frame   = crc32c(u32 LE) | length(u32 LE) | payload[length]
//	payload = kind(u8) | fields...
//
// The checksum covers the length and the payload, so a torn length is caught as
// surely as a torn payload. Fields are fixed-width little-endian integers and
// u32-length-prefixed byte strings: one value has exactly one encoding, so whatever
// decodes re-encodes to the same bytes (FuzzJournalDecode checks it).
//
//	intent  (1): key, scope, method, path (strings), created_at (i64 unix ns),
//	             attempts (u32), payload (bytes)
//	attempt (2): key, at (i64)
//	done    (3): key, at (i64), status (u8: 1 done, 2 rejected), http_status (u16),
//	             response (bytes)
//	forget  (4): key, at (i64)
const (
	journalMagic       = "IDEMJNL\x01"
	journalFrameHeader = 8
	// journalMaxRecord bounds one record. It keeps a corrupt length field from
	// making Open allocate gigabytes, and bounds the payload an intent may carry.
	journalMaxRecord = 64 << 20
)

type journalKind uint8

const (
	journalKindIntent  journalKind = 1
	journalKindAttempt journalKind = 2
	journalKindDone    journalKind = 3
	journalKindForget  journalKind = 4
)

// The final statuses as stored in a done record.
const (
	journalDoneOK       uint8 = 1
	journalDoneRejected uint8 = 2
)

// journalCRC is CRC-32C (Castagnoli): hardware accelerated on amd64 and arm64 and
// better at catching burst errors than the IEEE polynomial.
var journalCRC = crc32.MakeTable(crc32.Castagnoli)

// journalRecord is one decoded record. Which fields are meaningful depends on Kind.
type journalRecord struct {
	Kind       journalKind
	Key        idem.Key
	Scope      string // intent
	Method     string // intent
	Path       string // intent
	CreatedAt  int64  // intent: unix nanoseconds
	Attempts   uint32 // intent: attempts folded in by compaction
	Payload    []byte // intent
	At         int64  // attempt, done, forget: unix nanoseconds
	Status     uint8  // done
	HTTPStatus uint16 // done
	Response   []byte // done
}

// Sentinel errors of the journal. Match them with errors.Is.
var (
	// ErrJournalLocked: another Journal (in this or another process) holds the file.
	ErrJournalLocked = errors.New("journal: locked by another process")
	// ErrJournalCorrupt: a damaged record is followed by intact ones, so the damage is
	// not a torn tail and dropping it would lose intents. Open refuses the file rather
	// than silently forgetting keys; an operator must look at it.
	ErrJournalCorrupt = errors.New("journal: corrupt")
	// ErrNotJournal: the file exists and is not a journal. Open never truncates it.
	ErrNotJournal = errors.New("journal: not a journal file")
	// ErrJournalClosed: the Journal was closed, or a failed write left it unusable.
	ErrJournalClosed = errors.New("journal: closed")
	// ErrUnknownIntent: no intent with this key is in the journal.
	ErrUnknownIntent = errors.New("journal: unknown intent")
	// ErrDuplicateIntent: Append was called twice with one key. Keys name intents;
	// two intents never share one.
	ErrDuplicateIntent = errors.New("journal: duplicate intent key")
	// ErrIntentFinished: the intent already has a final result.
	ErrIntentFinished = errors.New("journal: intent already finished")
)

// IntentStatus is where an intent stands, as the client sees it.
type IntentStatus string

const (
	// IntentPending: no final response has been recorded. Resume re-sends it with
	// its own key.
	IntentPending IntentStatus = "pending"
	// IntentDone: a 2xx response was received and recorded.
	IntentDone IntentStatus = "done"
	// IntentRejected: a final 4xx response was received and recorded. Re-sending the
	// same request would be rejected again.
	IntentRejected IntentStatus = "rejected"
	// IntentExpired: still pending, but older than the server's key lifetime. It is
	// never re-sent: the server may have forgotten the key, and a late retry would
	// then be a second effect. The journal never stores this status; the Client
	// derives it from CreatedAt.
	IntentExpired IntentStatus = "expired"
)

// Intent is one user intent as recorded in a Journal.
type Intent struct {
	// Key names the intent. It was minted before the first send.
	Key idem.Key
	// Scope is sent as Idempotency-Scope when not empty.
	Scope string
	// Method and Path of the HTTP request, for example "POST" "/v1/payments".
	Method, Path string
	// Payload is the request body, byte for byte what every attempt sends: the
	// server rejects a key reused with a different body.
	Payload []byte
	// CreatedAt is when the intent was journaled. The key lifetime counts from here.
	CreatedAt time.Time
	// Attempts counts sends started with this key, across processes.
	Attempts int
	// Status is IntentPending, IntentDone or IntentRejected.
	Status IntentStatus
	// HTTPStatus and Response are the final response, once Status is not pending.
	HTTPStatus int
	Response   []byte
	// FinishedAt is when the final response was recorded.
	FinishedAt time.Time
}

// Journal is the durable vessel of a client's intents: a file-backed, append-only log
// that holds each key from before its first send until its final response. Every
// write is fsynced before it returns, so a key is never sent before it would survive
// a crash, and a restarted client finds it again (Client.Resume).
//
// Open replays the whole file into memory; the journal is meant for one client's
// intents, and compaction keeps it to the live ones.
//
// A Journal holds an exclusive lock on path+".lock" from Open to Close, so two
// processes never interleave writes in one file. A Journal is safe for concurrent use
// by multiple goroutines.
type Journal struct {
	path string
	lock *flock.Flock

	mu      sync.Mutex
	f       *os.File // nil once closed or broken
	size    int64    // bytes of valid log; every append starts here
	intents map[idem.Key]*Intent
	order   []idem.Key // log order of live intents; forgotten keys are removed
	records int        // records in the file, to decide when compaction pays
	torn    int64      // bytes of torn tail dropped by Open
}

// Open opens the journal at path, creating it (and its directory) if needed, and
// replays it into memory. It does not wait for the lock: if another process holds the
// journal, Open fails at once with ErrJournalLocked. Use OpenContext to wait.
//
// A torn tail (the last record cut off by a crash or power loss mid-write) is
// detected by its checksum and truncated, so later appends are not stranded behind
// garbage; every record before it is kept. Torn reports how many bytes were dropped.
func Open(path string) (*Journal, error) {
	return journalOpen(path, func(l *flock.Flock) (bool, error) { return l.TryLock() })
}

// OpenContext is Open, but waits for the lock until ctx is done. A CLI that may be
// run twice at once uses it so the second invocation queues behind the first. On
// timeout the error wraps both ErrJournalLocked and ctx.Err().
func OpenContext(ctx context.Context, path string) (*Journal, error) {
	return journalOpen(path, func(l *flock.Flock) (bool, error) {
		ok, err := l.TryLockContext(ctx, 20*time.Millisecond)
		if !ok && err != nil && ctx.Err() != nil {
			return false, fmt.Errorf("%w: %w", ErrJournalLocked, ctx.Err())
		}
		return ok, err
	})
}

func journalOpen(path string, acquire func(*flock.Flock) (bool, error)) (*Journal, error) {
	if path == "" {
		return nil, errors.New("journal: open: empty path")
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("journal: open: %w", err)
	}
	// The lock lives in its own file, not on the journal: compaction replaces the
	// journal by rename, and a lock on the replaced inode would no longer exclude a
	// process that opens the new one.
	lock := flock.New(path+".lock", flock.SetPermissions(0o600))
	ok, err := acquire(lock)
	if err != nil {
		_ = lock.Close()
		if errors.Is(err, ErrJournalLocked) {
			return nil, fmt.Errorf("journal: open %s: %w", path, err)
		}
		return nil, fmt.Errorf("journal: open %s: lock: %w", path, err)
	}
	if !ok {
		_ = lock.Close()
		return nil, fmt.Errorf("journal: open %s: %w", path, ErrJournalLocked)
	}
	j := &Journal{path: path, lock: lock, intents: make(map[idem.Key]*Intent)}
	if err := j.load(); err != nil {
		_ = lock.Unlock()
		_ = lock.Close()
		return nil, err
	}
	// Compact when the log is mostly folded attempts and forgotten keys; a journal
	// that is mostly live intents is left alone.
	if j.records > 1024 && j.records > 2*j.liveRecords() {
		if err := j.compactLocked(); err != nil {
			_ = j.Close()
			return nil, err
		}
	}
	return j, nil
}

// load reads the file, replays its records and positions the journal for appends.
func (j *Journal) load() error {
	f, err := os.OpenFile(j.path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("journal: open: %w", err)
	}
	data, err := io.ReadAll(f)
	if err != nil {
		_ = f.Close()
		return fmt.Errorf("journal: open: read %s: %w", j.path, err)
	}

	// A file shorter than the header that holds a prefix of it is a journal whose
	// creation was cut short; anything else that does not start with the header is
	// somebody else's file, which we refuse to touch.
	if len(data) < len(journalMagic) {
		if !bytes.HasPrefix([]byte(journalMagic), data) {
			_ = f.Close()
			return fmt.Errorf("journal: open %s: %w", j.path, ErrNotJournal)
		}
		if err := journalWriteHeader(f); err != nil {
			_ = f.Close()
			return fmt.Errorf("journal: open %s: %w", j.path, err)
		}
		// The directory entry of a new file is only durable once the directory is.
		if err := journalSyncDir(filepath.Dir(j.path)); err != nil {
			_ = f.Close()
			return fmt.Errorf("journal: open %s: %w", j.path, err)
		}
		j.f, j.size = f, int64(len(journalMagic))
		return nil
	}
	if string(data[:len(journalMagic)]) != journalMagic {
		_ = f.Close()
		return fmt.Errorf("journal: open %s: %w", j.path, ErrNotJournal)
	}

	off, err := j.replay(data)
	if err != nil {
		_ = f.Close()
		return fmt.Errorf("journal: open %s: %w", j.path, err)
	}
	if off < len(data) {
		// Cut the torn tail off and make the cut durable before anything is appended
		// behind it; otherwise the next append would sit after garbage and be lost on
		// the next replay.
		j.torn = int64(len(data) - off)
		if err := f.Truncate(int64(off)); err != nil {
			_ = f.Close()
			return fmt.Errorf("journal: open %s: truncate torn tail: %w", j.path, err)
		}
		if err := f.Sync(); err != nil {
			_ = f.Close()
			return fmt.Errorf("journal: open %s: sync: %w", j.path, err)
		}
	}
	j.f, j.size = f, int64(off)
	return nil
}

// replay applies the records of a whole file (header included) and returns where the
// intact log ends: len(data) for a clean journal, the start of the torn tail
// otherwise.
func (j *Journal) replay(data []byte) (int, error) {
	off := len(journalMagic)
	for off < len(data) {
		rec, n, err := journalDecodeFrame(data[off:])
		if err != nil {
			// Torn or damaged. If an intact record follows, this is not a torn tail
			// but damage in the middle of the log: refuse rather than drop intents.
			if next := journalNextValidFrame(data, off+1); next >= 0 {
				return 0, fmt.Errorf("%w: bad record at offset %d (%v), intact record at offset %d",
					ErrJournalCorrupt, off, err, next)
			}
			return off, nil
		}
		if err := j.apply(rec); err != nil {
			return 0, fmt.Errorf("%w: record at offset %d: %v", ErrJournalCorrupt, off, err)
		}
		j.records++
		off += n
	}
	return off, nil
}

// journalNextValidFrame returns the offset of the first intact frame at or after
// from, or -1. It runs only when a damaged record was found, so its cost is paid on
// recovery, never on the happy path.
func journalNextValidFrame(data []byte, from int) int {
	for p := from; p+journalFrameHeader < len(data); p++ {
		if _, _, err := journalDecodeFrame(data[p:]); err == nil {
			return p
		}
	}
	return -1
}

func journalWriteHeader(f *os.File) error {
	if err := f.Truncate(0); err != nil {
		return fmt.Errorf("write header: %w", err)
	}
	if _, err := f.WriteAt([]byte(journalMagic), 0); err != nil {
		return fmt.Errorf("write header: %w", err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("write header: sync: %w", err)
	}
	return nil
}

func journalSyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync dir: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync dir %s: %w", dir, err)
	}
	return nil
}

// apply folds one record into the in-memory state. Records that contradict the
// state (an attempt for an unknown key, say) mean the log was not written by this
// code, and are reported rather than guessed around.
func (j *Journal) apply(rec journalRecord) error {
	switch rec.Kind {
	case journalKindIntent:
		if _, ok := j.intents[rec.Key]; ok {
			return fmt.Errorf("%w: %s", ErrDuplicateIntent, rec.Key)
		}
		j.intents[rec.Key] = &Intent{
			Key:       rec.Key,
			Scope:     rec.Scope,
			Method:    rec.Method,
			Path:      rec.Path,
			Payload:   rec.Payload,
			CreatedAt: time.Unix(0, rec.CreatedAt).UTC(),
			Attempts:  int(rec.Attempts),
			Status:    IntentPending,
		}
		j.order = append(j.order, rec.Key)
	case journalKindAttempt:
		in, ok := j.intents[rec.Key]
		if !ok {
			return fmt.Errorf("attempt: %w: %s", ErrUnknownIntent, rec.Key)
		}
		in.Attempts++
	case journalKindDone:
		in, ok := j.intents[rec.Key]
		if !ok {
			return fmt.Errorf("done: %w: %s", ErrUnknownIntent, rec.Key)
		}
		if in.Status != IntentPending {
			return fmt.Errorf("done: %w: %s", ErrIntentFinished, rec.Key)
		}
		in.Status = IntentDone
		if rec.Status == journalDoneRejected {
			in.Status = IntentRejected
		}
		in.HTTPStatus = int(rec.HTTPStatus)
		in.Response = rec.Response
		in.FinishedAt = time.Unix(0, rec.At).UTC()
	case journalKindForget:
		if _, ok := j.intents[rec.Key]; !ok {
			return fmt.Errorf("forget: %w: %s", ErrUnknownIntent, rec.Key)
		}
		delete(j.intents, rec.Key)
		j.order = slices.DeleteFunc(j.order, func(k idem.Key) bool { return k == rec.Key })
	default:
		return fmt.Errorf("unknown record kind %d", rec.Kind)
	}
	return nil
}

// Path returns the journal's file path.
func (j *Journal) Path() string { return j.path }

// Torn returns how many bytes of torn tail Open found and truncated; 0 for a clean
// journal. A non-zero value means the previous process died mid-write. The record it
// was writing never completed its fsync, so it was never reported as written.
func (j *Journal) Torn() int64 {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.torn
}

// Append records a new pending intent and fsyncs it. Only after Append returns may
// the intent be sent: from then on the key survives a crash.
//
// in.Key must be a valid key not already in the journal. A zero CreatedAt means now;
// Attempts, Status and the response fields are ignored (a new intent is pending and
// has not been sent).
func (j *Journal) Append(in Intent) error {
	if _, err := idem.ParseKey(string(in.Key)); err != nil {
		return fmt.Errorf("journal: append: %w", err)
	}
	if err := idem.ValidateScope(in.Scope); err != nil {
		return fmt.Errorf("journal: append %s: %w", in.Key, err)
	}
	created := in.CreatedAt
	if created.IsZero() {
		created = time.Now()
	}
	rec := journalRecord{
		Kind:      journalKindIntent,
		Key:       in.Key,
		Scope:     in.Scope,
		Method:    in.Method,
		Path:      in.Path,
		CreatedAt: created.UnixNano(),
		Payload:   bytes.Clone(in.Payload),
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if _, ok := j.intents[in.Key]; ok {
		return fmt.Errorf("journal: append: %w: %s", ErrDuplicateIntent, in.Key)
	}
	if err := j.writeLocked(rec); err != nil {
		return fmt.Errorf("journal: append %s: %w", in.Key, err)
	}
	return j.apply(rec)
}

// RecordAttempt counts one more send of the intent, fsynced before it returns. The
// Client records the attempt before sending, so a crash mid-send still counts it.
func (j *Journal) RecordAttempt(key idem.Key) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	in, ok := j.intents[key]
	if !ok {
		return fmt.Errorf("journal: record attempt: %w: %s", ErrUnknownIntent, key)
	}
	if in.Status != IntentPending {
		return fmt.Errorf("journal: record attempt: %w: %s", ErrIntentFinished, key)
	}
	rec := journalRecord{Kind: journalKindAttempt, Key: key, At: time.Now().UnixNano()}
	if err := j.writeLocked(rec); err != nil {
		return fmt.Errorf("journal: record attempt %s: %w", key, err)
	}
	return j.apply(rec)
}

// Done records the final response of an intent: status is IntentDone or
// IntentRejected. After Done the intent is no longer pending and Resume leaves it
// alone. Done on an intent that is already finished fails with ErrIntentFinished.
func (j *Journal) Done(key idem.Key, httpStatus int, body []byte, status IntentStatus) error {
	var code uint8
	switch status {
	case IntentDone:
		code = journalDoneOK
	case IntentRejected:
		code = journalDoneRejected
	default:
		return fmt.Errorf("journal: done %s: status %q is not final (want %q or %q)", key, status, IntentDone, IntentRejected)
	}
	if httpStatus < 0 || httpStatus > 0xffff {
		return fmt.Errorf("journal: done %s: http status %d out of range", key, httpStatus)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	in, ok := j.intents[key]
	if !ok {
		return fmt.Errorf("journal: done: %w: %s", ErrUnknownIntent, key)
	}
	if in.Status != IntentPending {
		return fmt.Errorf("journal: done: %w: %s", ErrIntentFinished, key)
	}
	rec := journalRecord{
		Kind:       journalKindDone,
		Key:        key,
		At:         time.Now().UnixNano(),
		Status:     code,
		HTTPStatus: uint16(httpStatus),
		Response:   bytes.Clone(body),
	}
	if err := j.writeLocked(rec); err != nil {
		return fmt.Errorf("journal: done %s: %w", key, err)
	}
	return j.apply(rec)
}

// Forget removes an intent as if the client had never journaled it. It exists for
// the --forget-key demonstration (the negative control: a client that loses its key
// mints another, and the server cannot know the two are one intent) and for an
// operator who deliberately abandons an intent.
func (j *Journal) Forget(key idem.Key) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if _, ok := j.intents[key]; !ok {
		return fmt.Errorf("journal: forget: %w: %s", ErrUnknownIntent, key)
	}
	rec := journalRecord{Kind: journalKindForget, Key: key, At: time.Now().UnixNano()}
	if err := j.writeLocked(rec); err != nil {
		return fmt.Errorf("journal: forget %s: %w", key, err)
	}
	return j.apply(rec)
}

// Get returns the intent with the given key.
func (j *Journal) Get(key idem.Key) (Intent, bool) {
	j.mu.Lock()
	defer j.mu.Unlock()
	in, ok := j.intents[key]
	if !ok {
		return Intent{}, false
	}
	return journalCopy(in), true
}

// Pending returns the intents without a final response, oldest first.
func (j *Journal) Pending() []Intent {
	return j.list(func(in *Intent) bool { return in.Status == IntentPending })
}

// All returns every intent in the journal, oldest first. Forgotten intents are gone.
func (j *Journal) All() []Intent {
	return j.list(func(*Intent) bool { return true })
}

func (j *Journal) list(keep func(*Intent) bool) []Intent {
	j.mu.Lock()
	defer j.mu.Unlock()
	out := make([]Intent, 0, len(j.order))
	for _, k := range j.order {
		if in := j.intents[k]; keep(in) {
			out = append(out, journalCopy(in))
		}
	}
	return out
}

// journalCopy returns a copy that shares no memory with the journal's state, so a
// caller that edits a payload cannot change what Resume will send.
func journalCopy(in *Intent) Intent {
	c := *in
	c.Payload = bytes.Clone(in.Payload)
	c.Response = bytes.Clone(in.Response)
	return c
}

// Prune removes the finished intents (done or rejected) whose final response was
// recorded before cutoff, compacts the journal and returns how many it removed.
// A finished intent is never sent again, so forgetting it loses only its record;
// pending intents are never pruned, however old — an expired one is exactly what
// an operator must still see to reconcile by hand. Without Prune a long-lived
// client's journal (and Open's replay of it) grows with every intent it ever sent.
func (j *Journal) Prune(cutoff time.Time) (int, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return 0, fmt.Errorf("journal: prune: %w", ErrJournalClosed)
	}
	keep := make([]idem.Key, 0, len(j.order))
	var drop []idem.Key
	for _, k := range j.order {
		if in := j.intents[k]; in.Status != IntentPending && in.FinishedAt.Before(cutoff) {
			drop = append(drop, k)
		} else {
			keep = append(keep, k)
		}
	}
	if len(drop) == 0 {
		return 0, nil
	}
	// compactLocked writes the intents in j.order: write the pruned set, and put
	// the full one back if the new file could not replace the old.
	all := j.order
	j.order = keep
	if err := j.compactLocked(); err != nil {
		j.order = all
		return 0, fmt.Errorf("journal: prune: %w", err)
	}
	for _, k := range drop {
		delete(j.intents, k)
	}
	return len(drop), nil
}

// Compact rewrites the journal with one intent record (attempts folded in) and at
// most one done record per live intent, dropping attempt records and forgotten keys.
// The new file is written beside the old one, fsynced, renamed over it and the
// directory fsynced, so a crash at any point leaves either the old or the new
// journal, never a mix. Open compacts on its own when most records are dead.
func (j *Journal) Compact() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.compactLocked()
}

func (j *Journal) liveRecords() int {
	n := 0
	for _, in := range j.intents {
		n++
		if in.Status != IntentPending {
			n++
		}
	}
	return n
}

func (j *Journal) compactLocked() error {
	if j.f == nil {
		return fmt.Errorf("journal: compact: %w", ErrJournalClosed)
	}
	var buf bytes.Buffer
	buf.WriteString(journalMagic)
	records := 0
	for _, k := range j.order {
		in := j.intents[k]
		buf.Write(journalEncodeFrame(journalRecord{
			Kind:      journalKindIntent,
			Key:       in.Key,
			Scope:     in.Scope,
			Method:    in.Method,
			Path:      in.Path,
			CreatedAt: in.CreatedAt.UnixNano(),
			Attempts:  uint32(in.Attempts),
			Payload:   in.Payload,
		}))
		records++
		if in.Status == IntentPending {
			continue
		}
		code := journalDoneOK
		if in.Status == IntentRejected {
			code = journalDoneRejected
		}
		buf.Write(journalEncodeFrame(journalRecord{
			Kind:       journalKindDone,
			Key:        in.Key,
			At:         in.FinishedAt.UnixNano(),
			Status:     code,
			HTTPStatus: uint16(in.HTTPStatus),
			Response:   in.Response,
		}))
		records++
	}

	tmp := j.path + ".compact"
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("journal: compact: %w", err)
	}
	if _, err := f.Write(buf.Bytes()); err != nil {
		_ = f.Close()
		_ = os.Remove(tmp)
		return fmt.Errorf("journal: compact: write: %w", err)
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		_ = os.Remove(tmp)
		return fmt.Errorf("journal: compact: sync: %w", err)
	}
	if err := os.Rename(tmp, j.path); err != nil {
		_ = f.Close()
		_ = os.Remove(tmp)
		return fmt.Errorf("journal: compact: rename: %w", err)
	}
	// Without the directory fsync the rename may not survive a crash. That is safe
	// to ignore: either file is a complete journal with the same intents, so carry
	// on with the new one rather than fail a compaction that has already happened.
	_ = journalSyncDir(filepath.Dir(j.path))
	_ = j.f.Close()
	j.f, j.size, j.records = f, int64(buf.Len()), records
	return nil
}

// writeLocked appends one framed record at the end of the valid log and fsyncs it.
// If the write or the fsync fails, it cuts the file back to where the record began,
// so a failed append never leaves a half record in front of later ones; if even that
// fails, the journal refuses further writes rather than risk it.
func (j *Journal) writeLocked(rec journalRecord) error {
	if j.f == nil {
		return ErrJournalClosed
	}
	frame := journalEncodeFrame(rec)
	if len(frame)-journalFrameHeader > journalMaxRecord {
		return fmt.Errorf("record of %d bytes exceeds the limit of %d", len(frame)-journalFrameHeader, journalMaxRecord)
	}
	_, err := j.f.WriteAt(frame, j.size)
	if err == nil {
		err = j.f.Sync()
	}
	if err != nil {
		if terr := j.f.Truncate(j.size); terr != nil {
			_ = j.f.Close()
			j.f = nil
			return fmt.Errorf("%w (and truncating the partial record failed: %v; journal closed)", err, terr)
		}
		return err
	}
	j.size += int64(len(frame))
	j.records++
	return nil
}

// Close releases the file and the lock. Everything written is already durable.
func (j *Journal) Close() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	var errs []error
	if j.f != nil {
		errs = append(errs, j.f.Close())
		j.f = nil
	}
	if j.lock != nil {
		errs = append(errs, j.lock.Unlock(), j.lock.Close())
		j.lock = nil
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("journal: close: %w", err)
	}
	return nil
}

// journalEncodeFrame encodes rec as a framed record: checksum, length, payload.
func journalEncodeFrame(rec journalRecord) []byte {
	payload := journalEncodeRecord(rec)
	frame := make([]byte, journalFrameHeader, journalFrameHeader+len(payload))
	binary.LittleEndian.PutUint32(frame[4:8], uint32(len(payload)))
	frame = append(frame, payload...)
	binary.LittleEndian.PutUint32(frame[0:4], crc32.Checksum(frame[4:], journalCRC))
	return frame
}

// journalDecodeFrame decodes the frame at the start of b and returns the record and
// the frame's length. Any error means "no intact record here": too short, a length
// out of bounds, a checksum mismatch or a payload that does not decode.
func journalDecodeFrame(b []byte) (journalRecord, int, error) {
	if len(b) < journalFrameHeader {
		return journalRecord{}, 0, fmt.Errorf("short frame header: %d bytes", len(b))
	}
	n := binary.LittleEndian.Uint32(b[4:8])
	if n == 0 || n > journalMaxRecord {
		return journalRecord{}, 0, fmt.Errorf("frame length %d out of range", n)
	}
	if uint64(len(b)-journalFrameHeader) < uint64(n) {
		return journalRecord{}, 0, fmt.Errorf("frame of %d bytes cut off after %d", n, len(b)-journalFrameHeader)
	}
	end := journalFrameHeader + int(n)
	if got, want := crc32.Checksum(b[4:end], journalCRC), binary.LittleEndian.Uint32(b[0:4]); got != want {
		return journalRecord{}, 0, fmt.Errorf("checksum mismatch: %08x != %08x", got, want)
	}
	rec, err := journalDecodeRecord(b[journalFrameHeader:end])
	if err != nil {
		return journalRecord{}, 0, err
	}
	return rec, end, nil
}

// journalEncodeRecord encodes a record's payload (no frame).
func journalEncodeRecord(rec journalRecord) []byte {
	var e journalEncoder
	e.u8(uint8(rec.Kind))
	e.bytes([]byte(rec.Key))
	switch rec.Kind {
	case journalKindIntent:
		e.bytes([]byte(rec.Scope))
		e.bytes([]byte(rec.Method))
		e.bytes([]byte(rec.Path))
		e.i64(rec.CreatedAt)
		e.u32(rec.Attempts)
		e.bytes(rec.Payload)
	case journalKindAttempt, journalKindForget:
		e.i64(rec.At)
	case journalKindDone:
		e.i64(rec.At)
		e.u8(rec.Status)
		e.u16(rec.HTTPStatus)
		e.bytes(rec.Response)
	}
	return e.b
}

// journalDecodeRecord decodes a record's payload. It is strict: unknown kinds or
// statuses, invalid keys and trailing bytes are errors, so every payload it accepts
// has exactly one encoding.
func journalDecodeRecord(b []byte) (journalRecord, error) {
	d := journalDecoder{b: b}
	var rec journalRecord
	rec.Kind = journalKind(d.u8())
	key := d.bytes()
	switch rec.Kind {
	case journalKindIntent:
		rec.Scope = string(d.bytes())
		rec.Method = string(d.bytes())
		rec.Path = string(d.bytes())
		rec.CreatedAt = d.i64()
		rec.Attempts = d.u32()
		rec.Payload = d.bytes()
	case journalKindAttempt, journalKindForget:
		rec.At = d.i64()
	case journalKindDone:
		rec.At = d.i64()
		rec.Status = d.u8()
		rec.HTTPStatus = d.u16()
		rec.Response = d.bytes()
	default:
		if d.err == nil {
			return journalRecord{}, fmt.Errorf("unknown record kind %d", rec.Kind)
		}
	}
	if d.err != nil {
		return journalRecord{}, d.err
	}
	if len(d.b) != 0 {
		return journalRecord{}, fmt.Errorf("%d trailing bytes after record", len(d.b))
	}
	k, err := idem.ParseKey(string(key))
	if err != nil {
		return journalRecord{}, err
	}
	rec.Key = k
	if err := idem.ValidateScope(rec.Scope); err != nil {
		return journalRecord{}, err
	}
	if rec.Kind == journalKindDone && rec.Status != journalDoneOK && rec.Status != journalDoneRejected {
		return journalRecord{}, fmt.Errorf("unknown done status %d", rec.Status)
	}
	return rec, nil
}

type journalEncoder struct{ b []byte }

func (e *journalEncoder) u8(v uint8)   { e.b = append(e.b, v) }
func (e *journalEncoder) u16(v uint16) { e.b = binary.LittleEndian.AppendUint16(e.b, v) }
func (e *journalEncoder) u32(v uint32) { e.b = binary.LittleEndian.AppendUint32(e.b, v) }
func (e *journalEncoder) i64(v int64)  { e.b = binary.LittleEndian.AppendUint64(e.b, uint64(v)) }
func (e *journalEncoder) bytes(v []byte) {
	e.u32(uint32(len(v)))
	e.b = append(e.b, v...)
}

// journalDecoder reads fields off b; the first short read sets err and every later
// read returns zero, so decoding code reads straight through and checks once.
type journalDecoder struct {
	b   []byte
	err error
}

func (d *journalDecoder) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n < 0 || len(d.b) < n {
		d.err = fmt.Errorf("record cut off: want %d bytes, have %d", n, len(d.b))
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

func (d *journalDecoder) u8() uint8 {
	if v := d.take(1); v != nil {
		return v[0]
	}
	return 0
}

func (d *journalDecoder) u16() uint16 {
	if v := d.take(2); v != nil {
		return binary.LittleEndian.Uint16(v)
	}
	return 0
}

func (d *journalDecoder) u32() uint32 {
	if v := d.take(4); v != nil {
		return binary.LittleEndian.Uint32(v)
	}
	return 0
}

func (d *journalDecoder) i64() int64 {
	if v := d.take(8); v != nil {
		return int64(binary.LittleEndian.Uint64(v))
	}
	return 0
}

func (d *journalDecoder) bytes() []byte {
	n := d.u32()
	if d.err != nil {
		return nil
	}
	if uint64(n) > uint64(len(d.b)) {
		d.err = fmt.Errorf("field of %d bytes cut off after %d", n, len(d.b))
		return nil
	}
	return bytes.Clone(d.take(int(n)))
}
