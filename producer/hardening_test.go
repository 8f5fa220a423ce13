package producer_test

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/producer"
)

// slowBody is a request body that says when it is first read, then holds the
// reader until released: a client trickling its body in.
type slowBody struct {
	reading chan struct{}
	release chan struct{}
	rest    io.Reader
	started bool
}

func (b *slowBody) Read(p []byte) (int, error) {
	if !b.started {
		b.started = true
		close(b.reading)
		<-b.release
	}
	return b.rest.Read(p)
}

// A request takes its slot among the MaxInFlight before its body is read: a
// client holding a body half sent holds the slot, so the bodies buffered at once
// are bounded by MaxInFlight and not by how many connections are open.
func TestMiddlewareTakesASlotBeforeReadingTheBody(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	h := newMiddleware(t, db.Pool, producer.Config{MaxInFlight: 1, MaxInFlightWait: -1}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))
	body := &slowBody{reading: make(chan struct{}), release: make(chan struct{}), rest: strings.NewReader("{}")}
	slow := httptest.NewRequest(http.MethodPost, "/ok", body)
	slow.Header.Set(idem.HeaderKey, "k-slow")
	done := make(chan int, 1)
	go func() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, slow)
		done <- w.Code
	}()
	recv(t, body.reading, "the middleware to start reading the slow body")

	busy := req{path: "/ok", key: key("k-other"), body: "{}"}.send(h)
	if busy.Code != http.StatusServiceUnavailable || errCode(t, busy) != "too_many_requests_in_flight" {
		t.Errorf("while a body is being read with MaxInFlight 1: %d %s, want 503 too_many_requests_in_flight", busy.Code, busy.Body)
	}
	close(body.release)
	if code := recv(t, done, "the slow request"); code != http.StatusCreated {
		t.Errorf("slow request: %d, want 201", code)
	}
}

// Set-Cookie is never stored nor replayed, whatever the spelling of its name: a
// handler that writes the header map directly gets its name sent as written.
func TestMiddlewareNeverReplaysSetCookieInAnySpelling(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	for i, name := range []string{"set-cookie", "SET-COOKIE", "Set-cookie"} {
		h := newMiddleware(t, db.Pool, producer.Config{}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header()[name] = []string{"session=secret-" + name}
			w.WriteHeader(http.StatusCreated)
		}))
		k := fmt.Sprintf("k%d", i)
		first := req{path: "/ok", key: key(k), body: "{}"}.send(h)
		if first.Code != http.StatusCreated || len(cookies(first.Header())) != 1 {
			t.Fatalf("%s: first response %d %v; want 201 with the cookie", name, first.Code, first.Header())
		}
		replay := req{path: "/ok", key: key(k), body: "{}"}.send(h)
		if replay.Header().Get(idem.HeaderReplayed) != "true" {
			t.Fatalf("%s: replay %v", name, replay.Header())
		}
		if c := cookies(replay.Header()); len(c) != 0 {
			t.Errorf("%s: the replay carries the first caller's cookie: %q", name, c)
		}
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_requests WHERE response_headers::text ILIKE '%secret-%'`); n != 0 {
		t.Errorf("a cookie is stored in %d records", n)
	}
}

// cookies are the Set-Cookie values of h, under any spelling of the name.
func cookies(h http.Header) []string {
	var out []string
	for name, values := range h {
		if strings.EqualFold(name, "Set-Cookie") {
			out = append(out, values...)
		}
	}
	return out
}

// keyMintedAt is a UUIDv7 key, as idem.NewKey mints, stamped with t.
func keyMintedAt(t *testing.T, at time.Time) string {
	t.Helper()
	var id uuid.UUID
	if _, err := rand.Read(id[:]); err != nil {
		t.Fatal(err)
	}
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(at.UnixMilli()))
	copy(id[:6], ms[2:])
	id[6] = id[6]&0x0f | 0x70 // version 7
	id[8] = id[8]&0x3f | 0x80 // RFC 4122 variant
	if id.Version() != 7 {
		t.Fatalf("%s is not a UUIDv7", id)
	}
	return id.String()
}

// A UUIDv7 key older than the ingress remembers keys, with no live record, is
// refused (422 idempotency_key_expired) instead of executed: its first request
// may have run and been forgotten. A live record still answers it; a fresh
// UUIDv7, and keys that carry no time, are unaffected.
func TestMiddlewareRefusesKeysOlderThanItsMemory(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	ctx := context.Background()
	var got outcomes
	app := newTestApp(t)
	h := newMiddleware(t, db.Pool, producer.Config{KeyLifetime: 48 * time.Hour}, observedBy(got.observe)).Wrap(app)
	now := time.Now()

	old := keyMintedAt(t, now.Add(-49*time.Hour))
	w := req{path: "/ok", key: key(old), body: "{}"}.send(h)
	if w.Code != http.StatusUnprocessableEntity || errCode(t, w) != "idempotency_key_expired" || got.last() != idem.OutcomeRejected {
		t.Fatalf("a 49h-old UUIDv7 key: %d %s (outcome %q), want 422 idempotency_key_expired", w.Code, w.Body, got.last())
	}
	if !strings.Contains(w.Body.String(), "mint a new key only for a new intent") {
		t.Errorf("the refusal does not say what to do: %s", w.Body)
	}
	// Within the margin for clocks, too: 47h30m is past 48h less an hour.
	if w := (req{path: "/ok", key: key(keyMintedAt(t, now.Add(-47*time.Hour-30*time.Minute))), body: "{}"}).send(h); w.Code != http.StatusUnprocessableEntity {
		t.Errorf("a 47h30m-old UUIDv7 key: %d, want 422", w.Code)
	}
	if n := db.Count(t, `SELECT count(*) FROM test_writes`); n != 0 || app.calls.Load() != 0 {
		t.Fatalf("refused keys ran the handler (%d calls, %d writes)", app.calls.Load(), n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_requests`); n != 0 {
		t.Fatalf("refused keys left %d records", n)
	}

	for name, k := range map[string]string{
		"a fresh UUIDv7":           keyMintedAt(t, now.Add(-time.Minute)),
		"a UUIDv7 minted in 46h":   keyMintedAt(t, now.Add(-46*time.Hour)),
		"a UUIDv4":                 uuid.NewString(),
		"a key that is no UUID":    "order-1",
		"a UUIDv7 in another form": strings.ReplaceAll(old, "-", ""),
	} {
		if w := (req{path: "/ok", key: key(k), body: "{}"}).send(h); w.Code != http.StatusCreated {
			t.Errorf("%s (%s): %d %s, want 201", name, k, w.Code, w.Body)
		}
	}

	// A key whose record is live is answered from it, however old the key: here a
	// record written by a middleware that keeps keys for 100h.
	long := newMiddleware(t, db.Pool, producer.Config{KeyLifetime: 100 * time.Hour}).Wrap(app)
	first := req{path: "/ok", key: key(old), body: `{"n":1}`}.send(long)
	if first.Code != http.StatusCreated {
		t.Fatalf("the old key under a 100h lifetime: %d %s", first.Code, first.Body)
	}
	if w := (req{path: "/ok", key: key(old), body: `{"n":1}`}).send(h); w.Code != http.StatusCreated || w.Header().Get(idem.HeaderReplayed) != "true" {
		t.Errorf("an old key with a live record: %d replayed=%q, want the stored 201 replayed", w.Code, w.Header().Get(idem.HeaderReplayed))
	}
	// Once that record has expired the key is refused, and the record is left to
	// the collector.
	if _, err := db.Pool.Exec(ctx, `UPDATE idem_requests SET expires_at = now() - interval '1 second' WHERE key = $1`, old); err != nil {
		t.Fatal(err)
	}
	writes := db.Count(t, `SELECT count(*) FROM test_writes`)
	if w := (req{path: "/ok", key: key(old), body: `{"n":1}`}).send(h); w.Code != http.StatusUnprocessableEntity || errCode(t, w) != "idempotency_key_expired" {
		t.Errorf("an old key whose record expired: %d %s, want 422 idempotency_key_expired", w.Code, w.Body)
	}
	if n := db.Count(t, `SELECT count(*) FROM test_writes`); n != writes {
		t.Errorf("the old key ran again: %d writes, want %d", n, writes)
	}
}

// A UUIDv7 key dated ahead of the ingress's clock by more than the margin for
// clocks is refused (422 idempotency_key_clock_skew, not final: nothing of it ever
// ran), not counted as young; within the margin it executes.
func TestMiddlewareRefusesKeysDatedAhead(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	app := newTestApp(t)
	h := newMiddleware(t, db.Pool, producer.Config{KeyLifetime: 48 * time.Hour}).Wrap(app)
	now := time.Now()
	for _, ahead := range []time.Duration{2 * time.Hour, 30 * 24 * time.Hour, 10 * 365 * 24 * time.Hour} {
		w := req{path: "/ok", key: key(keyMintedAt(t, now.Add(ahead))), body: "{}"}.send(h)
		if w.Code != http.StatusUnprocessableEntity || errCode(t, w) != "idempotency_key_clock_skew" {
			t.Errorf("a key dated %v ahead: %d %s, want 422 idempotency_key_clock_skew", ahead, w.Code, w.Body)
		}
		if !strings.Contains(w.Body.String(), "send the intent again under a key minted on a corrected clock") {
			t.Errorf("the refusal does not say what to do: %s", w.Body)
		}
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_requests`); n != 0 || app.calls.Load() != 0 {
		t.Fatalf("keys dated ahead ran the handler (%d calls) or left %d records", app.calls.Load(), n)
	}
	if w := (req{path: "/ok", key: key(keyMintedAt(t, now.Add(30*time.Minute))), body: "{}"}).send(h); w.Code != http.StatusCreated {
		t.Errorf("a key dated 30m ahead (within the margin): %d %s, want 201", w.Code, w.Body)
	}
	// Behind: the expired refusal says how far, for a client that minted it just now.
	w := req{path: "/ok", key: key(keyMintedAt(t, now.Add(-50*time.Hour))), body: "{}"}.send(h)
	if errCode(t, w) != "idempotency_key_expired" || !strings.Contains(w.Body.String(), "the client's clock is about") {
		t.Errorf("a key dated 50h behind: %d %s, want idempotency_key_expired naming the clock", w.Code, w.Body)
	}
}

// An expired record is forgotten, and its key executed again, only when this
// process's clock agrees that it expired: here the database's clock is three days
// ahead of the ingress's, the record's expiry passed by the database's clock and
// not by the ingress's, and the request is a replay, not a second execution.
func TestExpiredRecordKeptWhileTheClocksDisagree(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	ctx := context.Background()
	app := newTestApp(t)
	m := newMiddleware(t, db.Pool, producer.Config{KeyLifetime: 48 * time.Hour})
	h := m.Wrap(app)
	k := key("clock-1")
	if w := (req{path: "/ok", key: k, body: "{}"}).send(h); w.Code != http.StatusCreated {
		t.Fatalf("first: %d %s", w.Code, w.Body)
	}
	// As a forward jump of the database's clock leaves it: expired by now().
	if _, err := db.Pool.Exec(ctx, `UPDATE idem_requests SET expires_at = now() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	producer.SetClock(m, func() time.Time { return time.Now().Add(-72 * time.Hour) })
	if w := (req{path: "/ok", key: k, body: "{}"}).send(h); w.Code != http.StatusCreated || w.Header().Get(idem.HeaderReplayed) != "true" {
		t.Errorf("retry after the database's clock jumped: %d replayed=%q, want the stored 201 replayed", w.Code, w.Header().Get(idem.HeaderReplayed))
	}
	if n := db.Count(t, `SELECT count(*) FROM test_writes`); n != 1 {
		t.Fatalf("writes = %d, want 1: the request ran again", n)
	}
	// Both clocks agree: the key names nothing any more and executes afresh.
	producer.SetClock(m, time.Now)
	if w := (req{path: "/ok", key: k, body: "{}"}).send(h); w.Code != http.StatusCreated || w.Header().Get(idem.HeaderReplayed) == "true" {
		t.Errorf("after the expiry by both clocks: %d replayed=%q, want a new 201", w.Code, w.Header().Get(idem.HeaderReplayed))
	}
}
