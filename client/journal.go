package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/gofrs/flock"

	"github.com/idemkit/idem"
)

// Sentinel errors of the journal. Match them with errors.Is.
var (
	// ErrJournalLocked: another Journal (in this or another process) holds the file.
	ErrJournalLocked = errors.New("client: journal locked by another process")
	// ErrJournalCorrupt: a damaged record is followed by intact ones, so the damage is
	// not a torn tail and dropping it would lose intents. OpenJournal refuses the
	// file rather than silently forgetting keys; an operator must look at it.
	ErrJournalCorrupt = errors.New("client: journal corrupt")
	// ErrNotJournal: the file exists and is not a journal. OpenJournal never
	// truncates it.
	ErrNotJournal = errors.New("client: not a journal file")
	// ErrJournalClosed: the Journal was closed, or a failed write left it unusable.
	ErrJournalClosed = errors.New("client: journal closed")
	// ErrUnknownIntent: no intent with this key is in the journal.
	ErrUnknownIntent = errors.New("client: unknown intent")
	// ErrDuplicateIntent: Append was called twice with one key. Keys name intents;
	// two intents never share one.
	ErrDuplicateIntent = errors.New("client: duplicate intent key")
	// ErrIntentFinished: the intent already has a final result.
	ErrIntentFinished = errors.New("client: intent already finished")
)

// Journal is the durable vessel of a client's intents and the Store the package
// ships: a file-backed, append-only log that holds each key from before its first
// send until its final response. Every write is fsynced before it returns, so a key
// is never sent before it would survive a crash, and a restarted client finds it
// again (Client.Resume).
//
// OpenJournal replays the whole file into memory; the journal is meant for one
// client's intents, and compaction keeps it to the live ones.
//
// A Journal holds an exclusive lock on path+".lock" from OpenJournal to Close, so two
// processes never interleave writes in one file. A Journal is safe for concurrent use
// by multiple goroutines.
//
// The Store methods ignore their ctx: a write is one local append and fsync, which
// cannot be abandoned halfway, and a read is served from memory.
type Journal struct {
	path string
	lock *flock.Flock

	mu      sync.Mutex
	f       *os.File // nil once closed or broken
	size    int64    // bytes of valid log; every append starts here
	intents map[idem.Key]*Intent
	order   []idem.Key // log order of live intents; forgotten keys are removed
	records int        // records in the file, to decide when compaction pays
	torn    int64      // bytes of torn tail dropped by OpenJournal

	// dirPending: a compaction renamed its file over the journal but the directory
	// fsync failed; no write is durable until it succeeds (see compactLocked).
	dirPending bool

	syncDir func(dir string) error // fsyncs a directory; a test swaps it to inject failures
}

// OpenJournal opens the journal at path, creating it (and its directory) if needed,
// and replays it into memory. It fsyncs the journal's directory, and the parent of
// every directory it creates, before it returns, and fails if one of those fsyncs
// does: until then a crash could lose the journal's directory entry, and with it
// keys reported durable. It does not wait for the lock: if another process holds
// the journal, OpenJournal fails at once with ErrJournalLocked. Use
// OpenJournalContext to wait.
//
// A torn tail (the last record cut off by a crash or power loss mid-write) is
// detected by its checksum and truncated, so later appends are not stranded behind
// garbage; every record before it is kept. Torn reports how many bytes were dropped.
func OpenJournal(path string) (*Journal, error) {
	return open(path, func(l *flock.Flock) (bool, error) { return l.TryLock() })
}

// OpenJournalContext is OpenJournal, but waits for the lock until ctx is done. A CLI
// that may be run twice at once uses it so the second invocation queues behind the
// first. On timeout the error wraps both ErrJournalLocked and ctx.Err().
func OpenJournalContext(ctx context.Context, path string) (*Journal, error) {
	return open(path, func(l *flock.Flock) (bool, error) {
		ok, err := l.TryLockContext(ctx, 20*time.Millisecond)
		if !ok && err != nil && ctx.Err() != nil {
			return false, fmt.Errorf("%w: %w", ErrJournalLocked, ctx.Err())
		}
		return ok, err
	})
}

// Path returns the journal's file path.
func (j *Journal) Path() string { return j.path }

// Torn returns how many bytes of torn tail OpenJournal found and truncated; 0 for a
// clean journal. A non-zero value means the previous process died mid-write. The
// record it was writing never completed its fsync, so it was never reported as
// written.
func (j *Journal) Torn() int64 {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.torn
}

// Append records a new pending intent and fsyncs it. Only after Append returns may
// the intent be sent: from then on the key survives a crash. ctx is ignored.
//
// in.Key must be a valid key not already in the journal. A zero CreatedAt means now;
// Attempts, Status and the response fields are ignored (a new intent is pending and
// has not been sent).
func (j *Journal) Append(_ context.Context, in Intent) error {
	if _, err := idem.ParseKey(string(in.Key)); err != nil {
		return fmt.Errorf("client: journal: append: %w", err)
	}
	if err := idem.ValidateScope(in.Scope); err != nil {
		return fmt.Errorf("client: journal: append %s: %w", in.Key, err)
	}
	created := in.CreatedAt
	if created.IsZero() {
		created = time.Now()
	}
	rec := record{
		Kind:      kindIntent,
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
		return fmt.Errorf("client: journal: append: %w: %s", ErrDuplicateIntent, in.Key)
	}
	if err := j.writeLocked(rec); err != nil {
		return fmt.Errorf("client: journal: append %s: %w", in.Key, err)
	}
	return j.apply(rec)
}

// RecordAttempt counts one more send of the intent, fsynced before it returns. The
// Client records the attempt before sending, so a crash mid-send still counts it.
// ctx is ignored.
func (j *Journal) RecordAttempt(_ context.Context, key idem.Key) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	in, ok := j.intents[key]
	if !ok {
		return fmt.Errorf("client: journal: record attempt: %w: %s", ErrUnknownIntent, key)
	}
	if in.Status != IntentPending {
		return fmt.Errorf("client: journal: record attempt: %w: %s", ErrIntentFinished, key)
	}
	rec := record{Kind: kindAttempt, Key: key, At: time.Now().UnixNano()}
	if err := j.writeLocked(rec); err != nil {
		return fmt.Errorf("client: journal: record attempt %s: %w", key, err)
	}
	return j.apply(rec)
}

// Done records the final response of an intent: status is IntentDone or
// IntentRejected. After Done the intent is no longer pending and Resume leaves it
// alone. Done on an intent that is already finished fails with ErrIntentFinished.
// The record is fsynced before Done returns; ctx is ignored.
func (j *Journal) Done(_ context.Context, key idem.Key, httpStatus int, body []byte, status IntentStatus) error {
	var code uint8
	switch status {
	case IntentDone:
		code = doneOK
	case IntentRejected:
		code = doneRejected
	default:
		return fmt.Errorf("client: journal: done %s: status %q is not final (want %q or %q)", key, status, IntentDone, IntentRejected)
	}
	if httpStatus < 0 || httpStatus > 0xffff {
		return fmt.Errorf("client: journal: done %s: http status %d out of range", key, httpStatus)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	in, ok := j.intents[key]
	if !ok {
		return fmt.Errorf("client: journal: done: %w: %s", ErrUnknownIntent, key)
	}
	if in.Status != IntentPending {
		return fmt.Errorf("client: journal: done: %w: %s", ErrIntentFinished, key)
	}
	rec := record{
		Kind:       kindDone,
		Key:        key,
		At:         time.Now().UnixNano(),
		Status:     code,
		HTTPStatus: uint16(httpStatus),
		Response:   bytes.Clone(body),
	}
	if err := j.writeLocked(rec); err != nil {
		return fmt.Errorf("client: journal: done %s: %w", key, err)
	}
	return j.apply(rec)
}

// Forget removes an intent as if the client had never journaled it, fsynced before
// it returns. It is for an operator who deliberately abandons an intent, and for the
// enqueue CLI's --forget-key demonstration (the negative control: a client that
// loses its key mints another, and the server cannot know the two are one intent).
func (j *Journal) Forget(key idem.Key) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if _, ok := j.intents[key]; !ok {
		return fmt.Errorf("client: journal: forget: %w: %s", ErrUnknownIntent, key)
	}
	rec := record{Kind: kindForget, Key: key, At: time.Now().UnixNano()}
	if err := j.writeLocked(rec); err != nil {
		return fmt.Errorf("client: journal: forget %s: %w", key, err)
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
	return copyIntent(in), true
}

// Pending returns the intents without a final response, oldest first. It reads
// memory, so the error is always nil; ctx is ignored.
func (j *Journal) Pending(context.Context) ([]Intent, error) {
	return j.list(func(in *Intent) bool { return in.Status == IntentPending }), nil
}

// All returns every intent in the journal, oldest first. Forgotten intents are gone.
// It reads memory, so the error is always nil; ctx is ignored.
func (j *Journal) All(context.Context) ([]Intent, error) {
	return j.list(func(*Intent) bool { return true }), nil
}

func (j *Journal) list(keep func(*Intent) bool) []Intent {
	j.mu.Lock()
	defer j.mu.Unlock()
	out := make([]Intent, 0, len(j.order))
	for _, k := range j.order {
		if in := j.intents[k]; keep(in) {
			out = append(out, copyIntent(in))
		}
	}
	return out
}

// copyIntent returns a copy that shares no memory with the journal's state, so a
// caller that edits a payload cannot change what Resume will send.
func copyIntent(in *Intent) Intent {
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
// client's journal (and OpenJournal's replay of it) grows with every intent it ever
// sent.
//
// If the compaction's new file replaced the journal but the directory fsync failed
// (see Compact), Prune returns the count and the error: the intents are gone from
// the journal, which owes the fsync before its next write.
func (j *Journal) Prune(cutoff time.Time) (int, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return 0, fmt.Errorf("client: journal: prune: %w", ErrJournalClosed)
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
	renamed, err := j.compactLocked()
	if !renamed {
		j.order = all
		return 0, fmt.Errorf("client: journal: prune: %w", err)
	}
	// The pruned file is the journal now: memory must agree with it, or a record
	// written later (a forget of a pruned key, say) would contradict the file.
	for _, k := range drop {
		delete(j.intents, k)
	}
	if err != nil {
		return len(drop), fmt.Errorf("client: journal: prune: %w", err)
	}
	return len(drop), nil
}

// Compact rewrites the journal with one intent record (attempts folded in) and at
// most one done record per live intent, dropping attempt records and forgotten keys.
// The new file is written beside the old one, fsynced, renamed over it and the
// directory fsynced, so a crash at any point leaves either the old or the new
// journal, never a mix. OpenJournal compacts on its own when most records are dead.
//
// If the directory fsync fails, Compact returns the error, but the journal already
// runs on the new file: until a later fsync succeeds a crash may bring back the old
// one, which holds the same intents but not what is appended after the compaction.
// So every later write retries the fsync first and fails while it fails: no key is
// reported durable (and the Client sends none) before it is.
func (j *Journal) Compact() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	_, err := j.compactLocked()
	return err
}

// Close releases the file and the lock. Everything written is already durable, unless
// a compaction's directory fsync is still owed: Close retries it and reports its
// failure.
func (j *Journal) Close() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	var errs []error
	if j.f != nil {
		errs = append(errs, j.syncCompactedDirLocked(), j.f.Close())
		j.f = nil
	}
	if j.lock != nil {
		errs = append(errs, j.lock.Unlock(), j.lock.Close())
		j.lock = nil
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("client: journal: close: %w", err)
	}
	return nil
}

// apply folds one record into the in-memory state: replay calls it for every record
// in the file, the writers for the record they just made durable. Records that
// contradict the state (an attempt for an unknown key, say) mean the log was not
// written by this code, and are reported rather than guessed around.
func (j *Journal) apply(rec record) error {
	switch rec.Kind {
	case kindIntent:
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
	case kindAttempt:
		in, ok := j.intents[rec.Key]
		if !ok {
			return fmt.Errorf("attempt: %w: %s", ErrUnknownIntent, rec.Key)
		}
		in.Attempts++
	case kindDone:
		in, ok := j.intents[rec.Key]
		if !ok {
			return fmt.Errorf("done: %w: %s", ErrUnknownIntent, rec.Key)
		}
		if in.Status != IntentPending {
			return fmt.Errorf("done: %w: %s", ErrIntentFinished, rec.Key)
		}
		in.Status = IntentDone
		if rec.Status == doneRejected {
			in.Status = IntentRejected
		}
		in.HTTPStatus = int(rec.HTTPStatus)
		in.Response = rec.Response
		in.FinishedAt = time.Unix(0, rec.At).UTC()
	case kindForget:
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
