package client

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/gofrs/flock"

	"github.com/idemkit/idem"
)

// open creates the directory, takes the lock with acquire, replays the file and
// compacts it when most of it is dead. OpenJournal and OpenJournalContext differ only
// in how they wait for the lock.
func open(path string, acquire func(*flock.Flock) (bool, error)) (*Journal, error) {
	if path == "" {
		return nil, errors.New("client: journal: open: empty path")
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("client: journal: open: %w", err)
	}
	// The lock lives in its own file, not on the journal: compaction replaces the
	// journal by rename, and a lock on the replaced inode would no longer exclude a
	// process that opens the new one.
	lock := flock.New(path+".lock", flock.SetPermissions(0o600))
	ok, err := acquire(lock)
	if err != nil {
		_ = lock.Close()
		if errors.Is(err, ErrJournalLocked) {
			return nil, fmt.Errorf("client: journal: open %s: %w", path, err)
		}
		return nil, fmt.Errorf("client: journal: open %s: lock: %w", path, err)
	}
	if !ok {
		_ = lock.Close()
		return nil, fmt.Errorf("client: journal: open %s: %w", path, ErrJournalLocked)
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
		return fmt.Errorf("client: journal: open: %w", err)
	}
	data, err := io.ReadAll(f)
	if err != nil {
		_ = f.Close()
		return fmt.Errorf("client: journal: open: read %s: %w", j.path, err)
	}

	// A file shorter than the header that holds a prefix of it is a journal whose
	// creation was cut short; anything else that does not start with the header is
	// somebody else's file, which we refuse to touch.
	if len(data) < len(magic) {
		if !bytes.HasPrefix([]byte(magic), data) {
			_ = f.Close()
			return fmt.Errorf("client: journal: open %s: %w", j.path, ErrNotJournal)
		}
		if err := writeHeader(f); err != nil {
			_ = f.Close()
			return fmt.Errorf("client: journal: open %s: %w", j.path, err)
		}
		// The directory entry of a new file is only durable once the directory is.
		if err := syncDir(filepath.Dir(j.path)); err != nil {
			_ = f.Close()
			return fmt.Errorf("client: journal: open %s: %w", j.path, err)
		}
		j.f, j.size = f, int64(len(magic))
		return nil
	}
	if string(data[:len(magic)]) != magic {
		_ = f.Close()
		return fmt.Errorf("client: journal: open %s: %w", j.path, ErrNotJournal)
	}

	off, err := j.replay(data)
	if err != nil {
		_ = f.Close()
		return fmt.Errorf("client: journal: open %s: %w", j.path, err)
	}
	if off < len(data) {
		// Cut the torn tail off and make the cut durable before anything is appended
		// behind it; otherwise the next append would sit after garbage and be lost on
		// the next replay.
		j.torn = int64(len(data) - off)
		if err := f.Truncate(int64(off)); err != nil {
			_ = f.Close()
			return fmt.Errorf("client: journal: open %s: truncate torn tail: %w", j.path, err)
		}
		if err := f.Sync(); err != nil {
			_ = f.Close()
			return fmt.Errorf("client: journal: open %s: sync: %w", j.path, err)
		}
	}
	j.f, j.size = f, int64(off)
	return nil
}

// replay applies the records of a whole file (header included) and returns where the
// intact log ends: len(data) for a clean journal, the start of the torn tail
// otherwise.
func (j *Journal) replay(data []byte) (int, error) {
	off := len(magic)
	for off < len(data) {
		rec, n, err := decodeFrame(data[off:])
		if err != nil {
			// Torn or damaged. If an intact record follows, this is not a torn tail
			// but damage in the middle of the log: refuse rather than drop intents.
			if next := nextValidFrame(data, off+1); next >= 0 {
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

// nextValidFrame returns the offset of the first intact frame at or after from, or
// -1. It runs only when a damaged record was found, so its cost is paid on recovery,
// never on the happy path.
func nextValidFrame(data []byte, from int) int {
	for p := from; p+frameHeader < len(data); p++ {
		if _, _, err := decodeFrame(data[p:]); err == nil {
			return p
		}
	}
	return -1
}

func writeHeader(f *os.File) error {
	if err := f.Truncate(0); err != nil {
		return fmt.Errorf("write header: %w", err)
	}
	if _, err := f.WriteAt([]byte(magic), 0); err != nil {
		return fmt.Errorf("write header: %w", err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("write header: sync: %w", err)
	}
	return nil
}

func syncDir(dir string) error {
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

// writeLocked appends one framed record at the end of the valid log and fsyncs it.
// If the write or the fsync fails, it cuts the file back to where the record began,
// so a failed append never leaves a half record in front of later ones; if even that
// fails, the journal refuses further writes rather than risk it.
func (j *Journal) writeLocked(rec record) error {
	if j.f == nil {
		return ErrJournalClosed
	}
	frame := encodeFrame(rec)
	if len(frame)-frameHeader > maxRecord {
		return fmt.Errorf("record of %d bytes exceeds the limit of %d", len(frame)-frameHeader, maxRecord)
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

// liveRecords is how many records a compacted journal would hold: one per intent,
// plus one per final response.
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

// compactLocked writes the intents in j.order to a new file beside the journal,
// fsyncs it, renames it over the journal and fsyncs the directory.
func (j *Journal) compactLocked() error {
	if j.f == nil {
		return fmt.Errorf("client: journal: compact: %w", ErrJournalClosed)
	}
	var buf bytes.Buffer
	buf.WriteString(magic)
	records := 0
	for _, k := range j.order {
		in := j.intents[k]
		buf.Write(encodeFrame(record{
			Kind:      kindIntent,
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
		code := doneOK
		if in.Status == IntentRejected {
			code = doneRejected
		}
		buf.Write(encodeFrame(record{
			Kind:       kindDone,
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
		return fmt.Errorf("client: journal: compact: %w", err)
	}
	if _, err := f.Write(buf.Bytes()); err != nil {
		_ = f.Close()
		_ = os.Remove(tmp)
		return fmt.Errorf("client: journal: compact: write: %w", err)
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		_ = os.Remove(tmp)
		return fmt.Errorf("client: journal: compact: sync: %w", err)
	}
	if err := os.Rename(tmp, j.path); err != nil {
		_ = f.Close()
		_ = os.Remove(tmp)
		return fmt.Errorf("client: journal: compact: rename: %w", err)
	}
	// Without the directory fsync the rename may not survive a crash. That is safe
	// to ignore: either file is a complete journal with the same intents, so carry
	// on with the new one rather than fail a compaction that has already happened.
	_ = syncDir(filepath.Dir(j.path))
	_ = j.f.Close()
	j.f, j.size, j.records = f, int64(buf.Len()), records
	return nil
}
