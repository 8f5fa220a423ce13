package client

import (
	"errors"
	"fmt"
	"path/filepath"
	"reflect"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gofrs/flock"
)

// errDiskGone is what an injected directory fsync failure wraps.
var errDiskGone = errors.New("injected: directory fsync failed")

// syncRecorder stands in for Journal.syncDir: it records every directory the journal
// asks to fsync, fails with errDiskGone while fail says so, and otherwise really
// fsyncs.
type syncRecorder struct {
	mu   sync.Mutex
	dirs []string
	fail func(dir string) bool
}

func (s *syncRecorder) sync(dir string) error {
	s.mu.Lock()
	s.dirs = append(s.dirs, dir)
	fail := s.fail
	s.mu.Unlock()
	if fail != nil && fail(dir) {
		return fmt.Errorf("fsync %s: %w", dir, errDiskGone)
	}
	return syncDir(dir)
}

func (s *syncRecorder) failOn(dir string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if dir == "" {
		s.fail = nil
		return
	}
	s.fail = func(d string) bool { return d == dir }
}

func (s *syncRecorder) synced() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.dirs)
}

// openJournalSync is OpenJournal with syncDir replaced by rec.sync.
func openJournalSync(t *testing.T, path string, rec *syncRecorder) (*Journal, error) {
	t.Helper()
	j := &Journal{path: path, syncDir: rec.sync}
	if err := j.open(func(l *flock.Flock) (bool, error) { return l.TryLock() }); err != nil {
		return nil, err
	}
	t.Cleanup(func() { _ = j.Close() })
	return j, nil
}

// A directory entry is only durable once its parent directory is fsynced. OpenJournal
// creates the journal's missing directories (~/.local/state/idem/ on first use) and
// fsyncs the parent of each one, and the journal's own directory, before it returns:
// otherwise a power cut right after the first Append could lose the whole journal
// though Append reported the key durable. A failure of any of those fsyncs fails
// OpenJournal.
func TestJournalSyncsCreatedDirectories(t *testing.T) {
	root := t.TempDir()
	path := filepath.Join(root, "a", "b", "c", "j")
	rec := &syncRecorder{}
	j, err := openJournalSync(t, path, rec)
	if err != nil {
		t.Fatal(err)
	}
	got := rec.synced()
	for _, want := range []string{
		root,                               // holds the new a
		filepath.Join(root, "a"),           // holds the new b
		filepath.Join(root, "a", "b"),      // holds the new c
		filepath.Join(root, "a", "b", "c"), // holds the new journal file
	} {
		if !slices.Contains(got, want) {
			t.Errorf("directory %s was not fsynced; fsynced: %q", want, got)
		}
	}
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}

	// Reopening an existing journal fsyncs its directory too: a previous process may
	// have created the file or renamed a compaction over it and died before its own
	// directory fsync, and appends made now must not sit in an inode the directory
	// could still forget.
	rec = &syncRecorder{}
	if _, err := openJournalSync(t, path, rec); err != nil {
		t.Fatal(err)
	}
	if got := rec.synced(); !slices.Contains(got, filepath.Dir(path)) {
		t.Errorf("reopen did not fsync %s; fsynced: %q", filepath.Dir(path), got)
	}

	// The fsync of a created directory's parent fails: OpenJournal fails with it.
	rec = &syncRecorder{}
	rec.failOn(filepath.Join(root, "x"))
	if _, err := openJournalSync(t, filepath.Join(root, "x", "y", "j"), rec); !errors.Is(err, errDiskGone) {
		t.Fatalf("OpenJournal with the fsync of a created directory failing: err = %v, want %v", err, errDiskGone)
	}
}

// Compaction renames the new file over the journal; until the directory is fsynced
// the rename may not survive a crash, and a record appended to the new file would
// then be lost with it. So a failed directory fsync fails Compact, and the journal
// retries it before its next write, failing that write (the key is not reported
// durable, so the Client never sends it) until the fsync succeeds.
func TestJournalCompactDirectoryFsyncFails(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	rec := &syncRecorder{}
	j, err := openJournalSync(t, path, rec)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := j.Append(t.Context(), testIntent(i)); err != nil {
			t.Fatal(err)
		}
		if err := j.RecordAttempt(t.Context(), testIntent(i).Key); err != nil {
			t.Fatal(err)
		}
	}
	if err := j.Done(t.Context(), testIntent(0).Key, 202, []byte(`{"ok":true}`), IntentDone); err != nil {
		t.Fatal(err)
	}

	rec.failOn(filepath.Dir(path))
	if err := j.Compact(); !errors.Is(err, errDiskGone) {
		t.Fatalf("Compact with the directory fsync failing: err = %v, want %v", err, errDiskGone)
	}
	late := testIntent(5)
	if err := j.Append(t.Context(), late); !errors.Is(err, errDiskGone) {
		t.Fatalf("Append while the compacted journal's directory is not durable: err = %v, want %v", err, errDiskGone)
	}
	if _, ok := j.Get(late.Key); ok {
		t.Fatal("a failed Append left its intent in the journal")
	}

	rec.failOn("") // the disk recovers
	if err := j.Append(t.Context(), late); err != nil {
		t.Fatalf("Append once the directory fsync works again: %v", err)
	}
	want := keysOf(allOf(t, j))
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	j = openJournalT(t, path)
	if got := keysOf(allOf(t, j)); !reflect.DeepEqual(got, want) {
		t.Fatalf("after reopen:\n got %v\nwant %v", got, want)
	}
}

// Close does not report success while a compaction's rename is not durable.
func TestJournalCloseAfterUndurableCompaction(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	rec := &syncRecorder{}
	j, err := openJournalSync(t, path, rec)
	if err != nil {
		t.Fatal(err)
	}
	if err := j.Append(t.Context(), testIntent(1)); err != nil {
		t.Fatal(err)
	}
	rec.failOn(filepath.Dir(path))
	if err := j.Compact(); !errors.Is(err, errDiskGone) {
		t.Fatalf("Compact: err = %v, want %v", err, errDiskGone)
	}
	if err := j.Close(); !errors.Is(err, errDiskGone) {
		t.Fatalf("Close with the compaction not durable: err = %v, want %v", err, errDiskGone)
	}
}

// Prune whose compaction renamed the new file but could not fsync the directory
// reports the error, and its in-memory state is the new file's (the pruned intents
// are gone), not the old one's: a record written later must agree with the file it
// lands in.
func TestJournalPruneDirectoryFsyncFails(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	rec := &syncRecorder{}
	j, err := openJournalSync(t, path, rec)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := j.Append(t.Context(), testIntent(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := j.Done(t.Context(), testIntent(0).Key, 202, []byte(`{}`), IntentDone); err != nil {
		t.Fatal(err)
	}

	rec.failOn(filepath.Dir(path))
	n, err := j.Prune(time.Now().Add(time.Hour))
	if !errors.Is(err, errDiskGone) || n != 1 {
		t.Fatalf("Prune with the directory fsync failing = %d, %v; want 1 and %v", n, err, errDiskGone)
	}
	if _, ok := j.Get(testIntent(0).Key); ok {
		t.Fatal("the pruned intent is still in memory, though the file in place no longer has it")
	}

	rec.failOn("")
	if err := j.Forget(testIntent(1).Key); err != nil {
		t.Fatal(err)
	}
	want := keysOf(allOf(t, j))
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	j = openJournalT(t, path) // a record contradicting the file would make this ErrJournalCorrupt
	if got := keysOf(allOf(t, j)); !reflect.DeepEqual(got, want) {
		t.Fatalf("after reopen:\n got %v\nwant %v", got, want)
	}
}
