package client

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/gofrs/flock"

	"github.com/idemkit/idem"
)

// open creates the directory, takes the lock with acquire, replays the file and
// compacts it when most of it is dead. OpenJournal and OpenJournalContext differ only
// in how they wait for the lock.
func open(path string, acquire func(*flock.Flock) (bool, error)) (*Journal, error) {
	j := &Journal{path: path, syncDir: syncDir}
	if err := j.open(acquire); err != nil {
		return nil, err
	}
	return j, nil
}

// open does the work of the function open on a Journal that has its path and
// syncDir set, so a test can hand it a syncDir that fails.
func (j *Journal) open(acquire func(*flock.Flock) (bool, error)) error {
	path := j.path
	if path == "" {
		return errors.New("client: journal: open: empty path")
	}
	dir := filepath.Dir(path)
	if err := j.makeDirs(dir); err != nil {
		return fmt.Errorf("client: journal: open: %w", err)
	}
	// The lock lives in its own file, not on the journal: compaction replaces the
	// journal by rename, and a lock on the replaced inode would no longer exclude a
	// process that opens the new one.
	lock := flock.New(path+".lock", flock.SetPermissions(0o600))
	ok, err := acquire(lock)
	if err != nil {
		_ = lock.Close()
		if errors.Is(err, ErrJournalLocked) {
			return fmt.Errorf("client: journal: open %s: %w", path, err)
		}
		return fmt.Errorf("client: journal: open %s: lock: %w", path, err)
	}
	if !ok {
		_ = lock.Close()
		return fmt.Errorf("client: journal: open %s: %w", path, ErrJournalLocked)
	}
	j.lock, j.intents = lock, make(map[idem.Key]*Intent)
	if err := j.load(); err != nil {
		_ = lock.Unlock()
		_ = lock.Close()
		j.lock = nil
		return err
	}
	// Compact when the log is mostly folded attempts and forgotten keys; a journal
	// that is mostly live intents is left alone.
	if j.records > 1024 && j.records > 2*j.liveRecords() {
		if _, err := j.compactLocked(); err != nil {
			_ = j.Close()
			return err
		}
	}
	// The journal's directory entry is only durable once its directory is fsynced.
	// Always, not only for a file created just now: a previous process may have
	// created it, or renamed a compaction over it, and died (or failed this very
	// fsync) before the entry was durable; what this process appends and reports
	// durable must not sit in an inode the directory could still forget.
	if err := j.syncDir(dir); err != nil {
		_ = j.Close()
		return fmt.Errorf("client: journal: open %s: %w", path, err)
	}
	return nil
}

// makeDirs creates dir and its missing parents, as os.MkdirAll does, and fsyncs the
// parent of each directory it creates: a new directory's entry is only durable once
// its parent is, and without that a power cut right after the first Append could
// lose ~/.local/state/idem/, and the journal in it, though Append had reported the
// key durable and the Client had sent it.
func (j *Journal) makeDirs(dir string) error {
	var missing []string // deepest first
	for d := filepath.Clean(dir); ; {
		st, err := os.Stat(d)
		if err == nil {
			if !st.IsDir() {
				return fmt.Errorf("mkdir %s: not a directory", d)
			}
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("mkdir: %w", err)
		}
		missing = append(missing, d)
		parent := filepath.Dir(d)
		if parent == d {
			break
		}
		d = parent
	}
	for i := len(missing) - 1; i >= 0; i-- {
		d := missing[i]
		// Another process may have just created it; its parent still needs the fsync,
		// which that process may not have reached.
		if err := os.Mkdir(d, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("mkdir: %w", err)
		}
		if err := j.syncDir(filepath.Dir(d)); err != nil {
			return fmt.Errorf("mkdir %s: %w", d, err)
		}
	}
	return nil
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
		// The new file's directory entry is made durable by open, which fsyncs the
		// directory of every journal it opens.
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
	// A record appended to a compacted file whose rename is not durable would be
	// lost with the rename: the write is not durable until the directory is.
	if err := j.syncCompactedDirLocked(); err != nil {
		return err
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

// syncCompactedDirLocked retries the directory fsync a compaction could not do, if
// one is owed.
func (j *Journal) syncCompactedDirLocked() error {
	if !j.dirPending {
		return nil
	}
	if err := j.syncDir(filepath.Dir(j.path)); err != nil {
		return fmt.Errorf("journal not durable since its compaction: %w", err)
	}
	j.dirPending = false
	return nil
}

// compactLocked writes the intents in j.order to a new file beside the journal,
// fsyncs it, renames it over the journal and fsyncs the directory. renamed reports
// whether the new file replaced the old: when it did, the journal runs on the new
// file even if err is not nil, and err then means the directory fsync failed, so
// the rename may not survive a crash; the journal owes that fsync and retries it
// before its next write (and in Close), failing the write while it still fails.
func (j *Journal) compactLocked() (renamed bool, err error) {
	if j.f == nil {
		return false, fmt.Errorf("client: journal: compact: %w", ErrJournalClosed)
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
		return false, fmt.Errorf("client: journal: compact: %w", err)
	}
	if _, err := f.Write(buf.Bytes()); err != nil {
		_ = f.Close()
		_ = os.Remove(tmp)
		return false, fmt.Errorf("client: journal: compact: write: %w", err)
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		_ = os.Remove(tmp)
		return false, fmt.Errorf("client: journal: compact: sync: %w", err)
	}
	if err := os.Rename(tmp, j.path); err != nil {
		_ = f.Close()
		_ = os.Remove(tmp)
		return false, fmt.Errorf("client: journal: compact: rename: %w", err)
	}
	// The new file is the journal now, whatever the directory fsync says: carry on
	// with it. Until that fsync succeeds a crash may bring back the old file, which
	// holds every intent of the new one (and, after a Prune, the finished ones it
	// dropped), but not anything appended to the new one; so the fsync is owed, and
	// every write retries it first.
	_ = j.f.Close()
	j.f, j.size, j.records = f, int64(buf.Len()), records
	j.dirPending = true
	if err := j.syncCompactedDirLocked(); err != nil {
		return true, fmt.Errorf("client: journal: compact: renamed, but the directory fsync failed, so the compaction may not survive a crash (retried before the next write): %w", err)
	}
	return true, nil
}
