package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// testIntent is a distinct, valid intent for test number i.
func testIntent(i int) Intent {
	return Intent{
		Key:       idem.Key(fmt.Sprintf("key-%04d", i)),
		Scope:     "tenant-a",
		Method:    "POST",
		Path:      "/v1/payments",
		Payload:   []byte(fmt.Sprintf(`{"account":"acct_%d","amount_cents":%d}`, i, 100+i)),
		CreatedAt: time.Date(2025, 1, 2, 3, 4, 5, i, time.UTC),
	}
}

func openJournalT(t *testing.T, path string) *Journal {
	t.Helper()
	j, err := OpenJournal(path)
	if err != nil {
		t.Fatalf("OpenJournal(%s): %v", path, err)
	}
	t.Cleanup(func() { _ = j.Close() })
	return j
}

// fileSize is the size of the journal file, which is where the next record
// will start.
func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

// pendingOf and allOf are s.Pending and s.All for a test, which an error fails.
func pendingOf(t testing.TB, s Store) []Intent {
	t.Helper()
	in, err := s.Pending(t.Context())
	if err != nil {
		t.Fatalf("Pending: %v", err)
	}
	return in
}

func allOf(t testing.TB, s Store) []Intent {
	t.Helper()
	in, err := s.All(t.Context())
	if err != nil {
		t.Fatalf("All: %v", err)
	}
	return in
}

// keysOf lists the keys of intents with their status, to compare states.
func keysOf(in []Intent) []string {
	var out []string
	for _, x := range in {
		out = append(out, fmt.Sprintf("%s:%s:%d:%d", x.Key, x.Status, x.Attempts, x.HTTPStatus))
	}
	return out
}

func TestJournalRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sub", "dir", "j.journal") // OpenJournal creates dirs
	j := openJournalT(t, path)
	for i := range 4 {
		if err := j.Append(t.Context(), testIntent(i)); err != nil {
			t.Fatal(err)
		}
	}
	k := func(i int) idem.Key { return testIntent(i).Key }
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(j.RecordAttempt(t.Context(), k(0)))
	must(j.RecordAttempt(t.Context(), k(0)))
	must(j.Done(t.Context(), k(0), 202, []byte(`{"id":1}`), IntentDone))
	must(j.RecordAttempt(t.Context(), k(1)))
	must(j.Done(t.Context(), k(1), 422, []byte(`{"error":"mismatch"}`), IntentRejected))
	must(j.RecordAttempt(t.Context(), k(2)))
	must(j.Forget(k(3)))

	want := allOf(t, j)
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}

	j2 := openJournalT(t, path)
	got := allOf(t, j2)
	if !reflect.DeepEqual(keysOf(got), keysOf(want)) {
		t.Fatalf("after reopen:\n got %v\nwant %v", keysOf(got), keysOf(want))
	}
	for i := range got {
		g, w := got[i], want[i]
		if !bytes.Equal(g.Payload, w.Payload) || !bytes.Equal(g.Response, w.Response) ||
			!g.CreatedAt.Equal(w.CreatedAt) || g.Scope != w.Scope || g.Method != w.Method || g.Path != w.Path {
			t.Errorf("intent %s differs after reopen:\n got %+v\nwant %+v", g.Key, g, w)
		}
	}
	wantStates := []string{"key-0000:done:2:202", "key-0001:rejected:1:422", "key-0002:pending:1:0"}
	if !reflect.DeepEqual(keysOf(got), wantStates) {
		t.Fatalf("states: got %v want %v", keysOf(got), wantStates)
	}
	if p := pendingOf(t, j2); len(p) != 1 || p[0].Key != k(2) {
		t.Fatalf("Pending() = %v, want only %s", keysOf(p), k(2))
	}
	if _, ok := j2.Get(k(3)); ok {
		t.Fatal("forgotten key is back after reopen")
	}
	if j2.Torn() != 0 {
		t.Fatalf("clean journal reports %d torn bytes", j2.Torn())
	}
}

func TestJournalMisuse(t *testing.T) {
	j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
	in := testIntent(1)
	if err := j.Append(t.Context(), in); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		err  error
		want error
	}{
		{"duplicate append", j.Append(t.Context(), in), ErrDuplicateIntent},
		{"invalid key", j.Append(t.Context(), Intent{Key: "bad\nkey"}), idem.ErrMalformedKey},
		{"empty key", j.Append(t.Context(), Intent{}), idem.ErrMissingKey},
		{"attempt unknown", j.RecordAttempt(t.Context(), "nope"), ErrUnknownIntent},
		{"done unknown", j.Done(t.Context(), "nope", 200, nil, IntentDone), ErrUnknownIntent},
		{"forget unknown", j.Forget("nope"), ErrUnknownIntent},
		{"done first", j.Done(t.Context(), in.Key, 200, nil, IntentDone), nil},
		{"done twice", j.Done(t.Context(), in.Key, 200, nil, IntentDone), ErrIntentFinished},
		{"attempt after done", j.RecordAttempt(t.Context(), in.Key), ErrIntentFinished},
	} {
		if !errors.Is(tc.err, tc.want) {
			t.Errorf("%s: err = %v, want %v", tc.name, tc.err, tc.want)
		}
	}
	if err := j.Done(t.Context(), in.Key, 200, nil, IntentPending); err == nil {
		t.Error("Done with a non-final status succeeded")
	}
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	if err := j.Append(t.Context(), testIntent(2)); !errors.Is(err, ErrJournalClosed) {
		t.Errorf("append after close: err = %v, want ErrJournalClosed", err)
	}
}

// tornFixture writes a journal whose last record is produced by last, and
// returns the file's bytes, the offset where the last record starts, and the state
// before the last record.
func tornFixture(t *testing.T, last func(ctx context.Context, j *Journal) error) (data []byte, lastStart int64, before []string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fixture")
	j := openJournalT(t, path)
	for i := range 3 {
		if err := j.Append(t.Context(), testIntent(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := j.RecordAttempt(t.Context(), testIntent(0).Key); err != nil {
		t.Fatal(err)
	}
	if err := j.Done(t.Context(), testIntent(1).Key, 202, []byte(`{"ok":true}`), IntentDone); err != nil {
		t.Fatal(err)
	}
	before = keysOf(allOf(t, j))
	lastStart = fileSize(t, path)
	if err := last(t.Context(), j); err != nil {
		t.Fatal(err)
	}
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(data)) <= lastStart {
		t.Fatal("last record wrote nothing")
	}
	return data, lastStart, before
}

var lastRecords = map[string]func(ctx context.Context, j *Journal) error{
	"intent":  func(ctx context.Context, j *Journal) error { return j.Append(ctx, testIntent(9)) },
	"attempt": func(ctx context.Context, j *Journal) error { return j.RecordAttempt(ctx, testIntent(2).Key) },
	"done": func(ctx context.Context, j *Journal) error {
		return j.Done(ctx, testIntent(2).Key, 422, []byte(`{"error":"x"}`), IntentRejected)
	},
	"forget": func(_ context.Context, j *Journal) error { return j.Forget(testIntent(0).Key) },
}

// A crash can cut the last write anywhere. For every byte offset inside the last
// record: OpenJournal succeeds, every earlier record is there, the torn one is not,
// the tail is truncated, and a later append survives a reopen (it is not stranded
// behind garbage).
func TestJournalTornTailEveryOffset(t *testing.T) {
	for name, last := range lastRecords {
		t.Run(name, func(t *testing.T) {
			data, lastStart, before := tornFixture(t, last)
			dir := t.TempDir()
			for cut := lastStart; cut < int64(len(data)); cut++ {
				path := filepath.Join(dir, fmt.Sprintf("cut-%d", cut))
				if err := os.WriteFile(path, data[:cut], 0o600); err != nil {
					t.Fatal(err)
				}
				j, err := OpenJournal(path)
				if err != nil {
					t.Fatalf("cut at %d: OpenJournal: %v", cut, err)
				}
				if got := keysOf(allOf(t, j)); !reflect.DeepEqual(got, before) {
					t.Fatalf("cut at %d: state\n got %v\nwant %v", cut, got, before)
				}
				if got, want := j.Torn(), cut-lastStart; got != want {
					t.Fatalf("cut at %d: Torn() = %d, want %d", cut, got, want)
				}
				if got := fileSize(t, path); got != lastStart {
					t.Fatalf("cut at %d: file is %d bytes after OpenJournal, want truncated to %d", cut, got, lastStart)
				}
				extra := testIntent(7)
				if err := j.Append(t.Context(), extra); err != nil {
					t.Fatalf("cut at %d: append after recovery: %v", cut, err)
				}
				if err := j.Close(); err != nil {
					t.Fatal(err)
				}
				j, err = OpenJournal(path)
				if err != nil {
					t.Fatalf("cut at %d: reopen: %v", cut, err)
				}
				if _, ok := j.Get(extra.Key); !ok {
					t.Fatalf("cut at %d: intent appended after recovery is lost on reopen", cut)
				}
				if j.Torn() != 0 {
					t.Fatalf("cut at %d: reopen found %d torn bytes", cut, j.Torn())
				}
				if err := j.Close(); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// A flipped bit anywhere in the last record is caught by the checksum: the record is
// dropped as torn and reported, never replayed with wrong contents.
func TestJournalFlippedByteInLastRecord(t *testing.T) {
	data, lastStart, before := tornFixture(t, lastRecords["done"])
	dir := t.TempDir()
	for pos := lastStart; pos < int64(len(data)); pos++ {
		bad := bytes.Clone(data)
		bad[pos] ^= 0x5a
		path := filepath.Join(dir, fmt.Sprintf("flip-%d", pos))
		if err := os.WriteFile(path, bad, 0o600); err != nil {
			t.Fatal(err)
		}
		j, err := OpenJournal(path)
		if err != nil {
			t.Fatalf("flip at %d: OpenJournal: %v", pos, err)
		}
		if got := keysOf(allOf(t, j)); !reflect.DeepEqual(got, before) {
			t.Fatalf("flip at %d: state\n got %v\nwant %v", pos, got, before)
		}
		if j.Torn() != int64(len(data))-lastStart {
			t.Fatalf("flip at %d: Torn() = %d, want %d", pos, j.Torn(), int64(len(data))-lastStart)
		}
		_ = j.Close()
	}
}

// Damage followed by intact records is not a torn tail: truncating would silently
// lose the intents after it. OpenJournal refuses and leaves the file untouched.
func TestJournalCorruptMiddleRefused(t *testing.T) {
	data, _, _ := tornFixture(t, lastRecords["intent"])
	bad := bytes.Clone(data)
	bad[len(magic)+frameHeader+3] ^= 0x01 // inside the first record's payload
	path := filepath.Join(t.TempDir(), "j")
	if err := os.WriteFile(path, bad, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenJournal(path); !errors.Is(err, ErrJournalCorrupt) {
		t.Fatalf("OpenJournal: err = %v, want ErrJournalCorrupt", err)
	}
	after, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(after, bad) {
		t.Fatal("OpenJournal modified a corrupt journal")
	}
}

func TestJournalNotAJournal(t *testing.T) {
	path := filepath.Join(t.TempDir(), "notes.txt")
	content := []byte("my shopping list\n")
	if err := os.WriteFile(path, content, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenJournal(path); !errors.Is(err, ErrNotJournal) {
		t.Fatalf("OpenJournal: err = %v, want ErrNotJournal", err)
	}
	if after, _ := os.ReadFile(path); !bytes.Equal(after, content) {
		t.Fatal("OpenJournal modified a file that is not a journal")
	}
}

// A crash while creating the journal can leave part of the header; that is an empty
// journal, not a foreign file.
func TestJournalTornHeader(t *testing.T) {
	for n := range len(magic) {
		path := filepath.Join(t.TempDir(), "j")
		if err := os.WriteFile(path, []byte(magic[:n]), 0o600); err != nil {
			t.Fatal(err)
		}
		j, err := OpenJournal(path)
		if err != nil {
			t.Fatalf("header cut at %d: %v", n, err)
		}
		if err := j.Append(t.Context(), testIntent(1)); err != nil {
			t.Fatal(err)
		}
		_ = j.Close()
		j = openJournalT(t, path)
		if len(allOf(t, j)) != 1 {
			t.Fatalf("header cut at %d: %d intents after append and reopen, want 1", n, len(allOf(t, j)))
		}
		_ = j.Close()
	}
}

// flock locks belong to an open file description, so a second OpenJournal in this
// process conflicts exactly as a second process would.
func TestJournalLock(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	first := openJournalT(t, path)

	if _, err := OpenJournal(path); !errors.Is(err, ErrJournalLocked) {
		t.Fatalf("second OpenJournal: err = %v, want ErrJournalLocked", err)
	}

	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	_, err := OpenJournalContext(ctx, path)
	if !errors.Is(err, ErrJournalLocked) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("OpenJournalContext with a short deadline: err = %v, want ErrJournalLocked and DeadlineExceeded", err)
	}

	// A waiter gets the journal once the holder closes it.
	type opened struct {
		j   *Journal
		err error
	}
	started := make(chan struct{})
	done := make(chan opened, 1)
	go func() {
		close(started)
		j, err := OpenJournalContext(t.Context(), path)
		done <- opened{j, err}
	}()
	<-started
	if err := first.Append(t.Context(), testIntent(1)); err != nil {
		t.Fatal(err)
	}
	select {
	case o := <-done:
		t.Fatalf("OpenJournalContext returned while the journal was held: %v", o.err)
	default:
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	o := <-done
	if o.err != nil {
		t.Fatalf("waiting OpenJournalContext: %v", o.err)
	}
	defer o.j.Close()
	if _, ok := o.j.Get(testIntent(1).Key); !ok {
		t.Fatal("the waiter does not see what the holder wrote")
	}
}

func TestJournalCompact(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	j := openJournalT(t, path)
	for i := range 10 {
		in := testIntent(i)
		if err := j.Append(t.Context(), in); err != nil {
			t.Fatal(err)
		}
		for range 3 {
			if err := j.RecordAttempt(t.Context(), in.Key); err != nil {
				t.Fatal(err)
			}
		}
		switch i % 3 {
		case 0:
			if err := j.Done(t.Context(), in.Key, 202, []byte(`{}`), IntentDone); err != nil {
				t.Fatal(err)
			}
		case 1:
			if err := j.Forget(in.Key); err != nil {
				t.Fatal(err)
			}
		}
	}
	want := keysOf(allOf(t, j))
	sizeBefore := fileSize(t, path)
	if err := j.Compact(); err != nil {
		t.Fatal(err)
	}
	if got := keysOf(allOf(t, j)); !reflect.DeepEqual(got, want) {
		t.Fatalf("in memory after compaction:\n got %v\nwant %v", got, want)
	}
	if after := fileSize(t, path); after >= sizeBefore {
		t.Fatalf("compaction did not shrink the file: %d -> %d bytes", sizeBefore, after)
	}
	// The compacted journal keeps working and keeps excluding other openers.
	if err := j.Append(t.Context(), testIntent(50)); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenJournal(path); !errors.Is(err, ErrJournalLocked) {
		t.Fatalf("OpenJournal during compacted session: err = %v, want ErrJournalLocked", err)
	}
	want = keysOf(allOf(t, j))
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	j = openJournalT(t, path)
	if got := keysOf(allOf(t, j)); !reflect.DeepEqual(got, want) {
		t.Fatalf("after compaction and reopen:\n got %v\nwant %v", got, want)
	}
}

// Prune drops finished intents whose response is older than the cutoff, never a
// pending one (not even one far past any key lifetime), and the file shrinks to
// match: a reopened journal has exactly the survivors.
func TestJournalPrune(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	j := openJournalT(t, path)
	for i := range 6 {
		if err := j.Append(t.Context(), testIntent(i)); err != nil { // created in 2025: all "old"
			t.Fatal(err)
		}
	}
	finish := func(i int, status IntentStatus) {
		t.Helper()
		if err := j.Done(t.Context(), testIntent(i).Key, 202, []byte(`{"ok":true}`), status); err != nil {
			t.Fatal(err)
		}
	}
	finish(0, IntentDone)
	finish(1, IntentRejected)
	cutoff := time.Now()
	finish(2, IntentDone) // finished after the cutoff: kept
	// 3, 4, 5 stay pending.

	if n, err := j.Prune(cutoff.Add(-time.Hour)); err != nil || n != 0 {
		t.Fatalf("Prune(an hour before) = %d, %v; want 0", n, err)
	}
	sizeBefore := fileSize(t, path)
	want := keysOf(allOf(t, j))[2:] // all but intents 0 and 1
	n, err := j.Prune(cutoff)
	if err != nil || n != 2 {
		t.Fatalf("Prune = %d, %v; want 2 (the done and the rejected intent finished before the cutoff)", n, err)
	}
	if got := keysOf(allOf(t, j)); !reflect.DeepEqual(got, want) {
		t.Fatalf("after prune:\n got %v\nwant %v", got, want)
	}
	if _, ok := j.Get(testIntent(0).Key); ok {
		t.Fatal("a pruned intent is still there")
	}
	if after := fileSize(t, path); after >= sizeBefore {
		t.Fatalf("prune did not shrink the file: %d -> %d bytes", sizeBefore, after)
	}
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	j = openJournalT(t, path)
	if got := keysOf(allOf(t, j)); !reflect.DeepEqual(got, want) {
		t.Fatalf("after prune and reopen:\n got %v\nwant %v", got, want)
	}
	if in, _ := j.Get(testIntent(2).Key); in.Status != IntentDone || string(in.Response) != `{"ok":true}` {
		t.Fatalf("the kept finished intent lost its response: %+v", in)
	}
	if got := len(pendingOf(t, j)); got != 3 {
		t.Fatalf("%d pending after prune and reopen, want 3", got)
	}
	if n, err := j.Prune(time.Now().Add(time.Hour)); err != nil || n != 1 {
		t.Fatalf("Prune(future) = %d, %v; want 1: every finished intent, and never a pending one", n, err)
	}
}

// OpenJournal compacts a journal that is mostly dead records. The file is built from raw
// frames to avoid thousands of fsyncs.
func TestJournalAutoCompactOnOpen(t *testing.T) {
	in := testIntent(1)
	var b bytes.Buffer
	b.WriteString(magic)
	b.Write(encodeFrame(record{Kind: kindIntent, Key: in.Key, Method: "POST", Path: "/x", Payload: in.Payload}))
	for range 2000 {
		b.Write(encodeFrame(record{Kind: kindAttempt, Key: in.Key, At: 1}))
	}
	path := filepath.Join(t.TempDir(), "j")
	if err := os.WriteFile(path, b.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	j := openJournalT(t, path)
	got, ok := j.Get(in.Key)
	if !ok || got.Attempts != 2000 {
		t.Fatalf("Get = %+v, %v; want 2000 attempts", got, ok)
	}
	if size := fileSize(t, path); size >= int64(b.Len())/10 {
		t.Fatalf("journal not compacted on open: %d bytes (was %d)", size, b.Len())
	}
	_ = j.Close()
	j = openJournalT(t, path)
	if got, _ := j.Get(in.Key); got.Attempts != 2000 {
		t.Fatalf("attempts after compaction and reopen = %d, want 2000", got.Attempts)
	}
}
