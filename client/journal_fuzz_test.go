package client

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/idemkit/idem"
)

// fuzzSeeds are valid records of every kind, including empty and maximal-ish
// fields. The fuzzer mutates them, both framed and bare.
func fuzzSeeds() []record {
	return []record{
		{Kind: kindIntent, Key: "k", Method: "POST", Path: "/v1/payments",
			CreatedAt: 1735787045000000000, Payload: []byte(`{"account":"acct_1","amount_cents":1250}`)},
		{Kind: kindIntent, Key: "0190a5f2-7d3c-7c4e-9b1a-2f6d8e0c1b3a", Scope: "tenant-a",
			Method: "POST", Path: "/v1/emails", CreatedAt: -1, Attempts: 7, Payload: []byte(`{"to":"a@example.com"}`)},
		{Kind: kindIntent, Key: "k", Attempts: 1<<32 - 1},
		{Kind: kindAttempt, Key: "k", At: 42},
		{Kind: kindDone, Key: "k", At: 43, Status: doneOK, HTTPStatus: 202, Response: []byte(`{"id":"p_1"}`)},
		{Kind: kindDone, Key: "k", At: 44, Status: doneRejected, HTTPStatus: 422},
		{Kind: kindForget, Key: "k", At: 45},
	}
}

// FuzzJournalDecode feeds arbitrary bytes to the decoders OpenJournal relies on.
// They must never panic, and whatever they accept must re-encode to exactly the
// bytes they consumed: a record has one encoding, so replay and compaction cannot
// drift.
//
// The input is tried both as a frame (checksum and length) and as a bare payload,
// because random mutations almost never carry a valid checksum and the payload
// decoder would otherwise go unexplored.
func FuzzJournalDecode(f *testing.F) {
	for _, rec := range fuzzSeeds() {
		f.Add(encodeFrame(rec))
		f.Add(encodeRecord(rec))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if rec, n, err := decodeFrame(b); err == nil {
			if n < frameHeader || n > len(b) {
				t.Fatalf("frame length %d outside input of %d bytes", n, len(b))
			}
			if re := encodeFrame(rec); !bytes.Equal(re, b[:n]) {
				t.Fatalf("frame re-encodes differently:\n in %x\nout %x", b[:n], re)
			}
		}
		if rec, err := decodeRecord(b); err == nil {
			if re := encodeRecord(rec); !bytes.Equal(re, b) {
				t.Fatalf("record re-encodes differently:\n in %x\nout %x", b, re)
			}
		}
		// Replay a whole file made of this input: OpenJournal's recovery (resync scan,
		// semantic checks) must not panic on anything either, and must never claim
		// more intact bytes than there are.
		file := append([]byte(magic), b...)
		j := &Journal{intents: make(map[idem.Key]*Intent)}
		if end, err := j.replay(file); err == nil && (end < len(magic) || end > len(file)) {
			t.Fatalf("replay: intact end %d outside file of %d bytes", end, len(file))
		}
	})
}

// TestJournalWriteFuzzSeeds regenerates the committed seed corpus under
// testdata/fuzz/FuzzJournalDecode when IDEM_WRITE_FUZZ_SEEDS=1; otherwise it checks
// that every committed seed is still present and decodes.
func TestJournalWriteFuzzSeeds(t *testing.T) {
	dir := filepath.Join("testdata", "fuzz", "FuzzJournalDecode")
	write := os.Getenv("IDEM_WRITE_FUZZ_SEEDS") == "1"
	if write {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	kinds := map[recordKind]string{kindIntent: "intent", kindAttempt: "attempt", kindDone: "done", kindForget: "forget"}
	for i, rec := range fuzzSeeds() {
		for _, form := range []struct {
			name string
			b    []byte
		}{{"frame", encodeFrame(rec)}, {"record", encodeRecord(rec)}} {
			path := filepath.Join(dir, fmt.Sprintf("%s-%s-%d", form.name, kinds[rec.Kind], i))
			want := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", form.b)
			if write {
				if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
					t.Fatal(err)
				}
				continue
			}
			got, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("seed corpus: %v (regenerate with IDEM_WRITE_FUZZ_SEEDS=1 go test ./client/ -run TestJournalWriteFuzzSeeds)", err)
			}
			if string(got) != want {
				t.Fatalf("seed %s is stale (regenerate with IDEM_WRITE_FUZZ_SEEDS=1)", path)
			}
		}
	}
}
