package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// fakeIngress behaves like the idem ingress as far as a client can tell: the
// first request with a (scope, key) executes and its response is stored; a repeat
// gets the stored response again with Idempotent-Replayed: true; a repeat with a
// different body is a 422; no key is a 400. fail, when set, injects failures: it is
// called for every request (numbered from 1) before anything else and returns true
// when it has answered (or broken) the request itself.
type fakeIngress struct {
	t    *testing.T
	srv  *httptest.Server
	fail func(n int, w http.ResponseWriter, r *http.Request, body []byte) bool

	mu       sync.Mutex
	requests int
	seen     []string // scoped key of every request, in order
	scopes   []string // Idempotency-Scope of every request
	stored   map[string]storedResponse
	executed []string // scoped keys that executed (the "effect")
}

type storedResponse struct {
	body   []byte
	status int
	resp   []byte
}

func newFakeIngress(t *testing.T) *fakeIngress {
	f := &fakeIngress{t: t, stored: make(map[string]storedResponse)}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeIngress) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	key := r.Header.Get(idem.HeaderKey)
	scope := r.Header.Get(idem.HeaderScope)
	scoped := idem.ScopedKey(scope, idem.Key(key))

	f.mu.Lock()
	f.requests++
	n := f.requests
	f.seen = append(f.seen, scoped)
	f.scopes = append(f.scopes, scope)
	fail := f.fail
	f.mu.Unlock()
	if fail != nil && fail(n, w, r, body) {
		return
	}
	f.respond(w, key, scoped, body)
}

// respond is the ingress proper: claim the key or replay its first response.
func (f *fakeIngress) respond(w http.ResponseWriter, key, scoped string, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	if key == "" {
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"error":"missing Idempotency-Key"}`))
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if s, ok := f.stored[scoped]; ok {
		if !bytes.Equal(s.body, body) {
			w.WriteHeader(http.StatusUnprocessableEntity)
			_, _ = w.Write([]byte(`{"error":"same key, different body"}`))
			return
		}
		w.Header().Set(idem.HeaderReplayed, "true")
		w.WriteHeader(s.status)
		_, _ = w.Write(s.resp)
		return
	}
	f.executed = append(f.executed, scoped)
	resp, _ := json.Marshal(map[string]any{"key": key, "id": fmt.Sprintf("pay_%d", len(f.executed))})
	f.stored[scoped] = storedResponse{body: body, status: http.StatusAccepted, resp: resp}
	w.WriteHeader(http.StatusAccepted)
	_, _ = w.Write(resp)
}

func (f *fakeIngress) snapshot() (seen, executed []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.seen...), append([]string(nil), f.executed...)
}

// testConfig has tiny backoffs (the tests wait on nothing) and no keep-alives,
// so net/http never retries a request on its own behind the client's back and the
// server's request count is exactly the client's attempt count.
func testConfig(t *testing.T, f *fakeIngress, s Store) Config {
	return Config{
		Store:       s,
		BaseURL:     f.srv.URL,
		HTTPClient:  &http.Client{Transport: &http.Transport{DisableKeepAlives: true}},
		BackoffBase: time.Microsecond,
		BackoffMax:  time.Millisecond,
		Timeout:     5 * time.Second,
	}
}

func newClientT(t *testing.T, cfg Config) *Client {
	t.Helper()
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

var payment = Request{Path: "/v1/payments", Body: []byte(`{"account":"acct_1","amount_cents":1250}`)}

func distinct(keys []string) []string {
	var out []string
	seen := map[string]bool{}
	for _, k := range keys {
		if !seen[k] {
			seen[k] = true
			out = append(out, k)
		}
	}
	return out
}

// Every failure that leaves the outcome open is retried with the same key, and the
// effect happens once.
func TestClientRetriesKeepKey(t *testing.T) {
	failures := map[string]func(w http.ResponseWriter, r *http.Request){
		"503": func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusServiceUnavailable) },
		"409": func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusConflict)
			_, _ = w.Write([]byte(`{"error":"in flight"}`))
		},
		"500 after executing": nil, // set below: the effect commits, the response is lost
		"connection reset": func(w http.ResponseWriter, _ *http.Request) {
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				_ = conn.Close()
			}
		},
		"timeout": func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() },
	}
	for name, fail := range failures {
		t.Run(name, func(t *testing.T) {
			f := newFakeIngress(t)
			f.fail = func(n int, w http.ResponseWriter, r *http.Request, body []byte) bool {
				if n > 2 {
					return false
				}
				if fail == nil {
					// Execute, then fail the response: the retries must be replays.
					key := r.Header.Get(idem.HeaderKey)
					f.respond(httptest.NewRecorder(), key, idem.ScopedKey(r.Header.Get(idem.HeaderScope), idem.Key(key)), body)
					w.WriteHeader(http.StatusBadGateway)
					return true
				}
				fail(w, r)
				return true
			}
			j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
			cfg := testConfig(t, f, j)
			cfg.Scope = "tenant-a"
			wantAttempts := 3
			if name == "timeout" {
				cfg.Timeout = 300 * time.Millisecond
			}
			c := newClientT(t, cfg)

			res, err := c.Submit(t.Context(), payment)
			if err != nil {
				t.Fatalf("Submit: %v", err)
			}
			// A loaded machine may time out the good attempt too: then there is one
			// more attempt, still with the same key (checked below).
			if res.Status != IntentDone || res.HTTPStatus != http.StatusAccepted || res.Attempts < wantAttempts ||
				(name != "timeout" && res.Attempts != wantAttempts) {
				t.Fatalf("result = %+v, want done, 202, %d attempts", res, wantAttempts)
			}
			seen, executed := f.snapshot()
			if want := idem.ScopedKey("tenant-a", res.Key); len(distinct(seen)) != 1 || seen[0] != want {
				t.Fatalf("keys sent = %q, want only %q", distinct(seen), want)
			}
			if len(executed) != 1 {
				t.Fatalf("executed %d times, want once", len(executed))
			}
			var body struct{ Key string }
			if err := json.Unmarshal(res.Response, &body); err != nil || body.Key != string(res.Key) {
				t.Fatalf("response %s does not name key %s (%v)", res.Response, res.Key, err)
			}
			in, _ := j.Get(res.Key)
			if in.Status != IntentDone || in.Attempts != 3 || !bytes.Equal(in.Response, res.Response) {
				t.Fatalf("journal = %+v, want done with 3 attempts and the response", in)
			}
		})
	}
}

// A final 4xx is a verdict on the request, not a lost response: no retry, and the
// rejection is recorded so Resume leaves it alone.
func TestClientStopsOnClientError(t *testing.T) {
	for _, code := range []int{http.StatusBadRequest, http.StatusUnprocessableEntity, http.StatusNotFound} {
		t.Run(fmt.Sprint(code), func(t *testing.T) {
			f := newFakeIngress(t)
			f.fail = func(_ int, w http.ResponseWriter, _ *http.Request, _ []byte) bool {
				w.WriteHeader(code)
				_, _ = w.Write([]byte(`{"error":"no"}`))
				return true
			}
			j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
			c := newClientT(t, testConfig(t, f, j))
			res, err := c.Submit(t.Context(), payment)
			if err != nil {
				t.Fatalf("Submit: %v", err)
			}
			if res.Status != IntentRejected || res.HTTPStatus != code || res.Attempts != 1 {
				t.Fatalf("result = %+v, want rejected, %d, 1 attempt", res, code)
			}
			if seen, _ := f.snapshot(); len(seen) != 1 {
				t.Fatalf("server saw %d requests, want 1", len(seen))
			}
			if p := pendingOf(t, j); len(p) != 0 {
				t.Fatalf("rejected intent still pending: %v", keysOf(p))
			}
		})
	}
}

// When the attempts run out the intent stays pending with its key, and a later
// Resume finishes it with that same key.
func TestClientGivesUpThenResumes(t *testing.T) {
	f := newFakeIngress(t)
	var healthy atomic.Bool
	f.fail = func(_ int, w http.ResponseWriter, _ *http.Request, _ []byte) bool {
		if healthy.Load() {
			return false
		}
		w.WriteHeader(http.StatusServiceUnavailable)
		return true
	}
	j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
	cfg := testConfig(t, f, j)
	cfg.MaxAttempts = 3
	c := newClientT(t, cfg)

	res, err := c.Submit(t.Context(), payment)
	if !errors.Is(err, ErrStillPending) {
		t.Fatalf("Submit: err = %v, want ErrStillPending", err)
	}
	if res.Status != IntentPending || res.Attempts != 3 || res.Key == "" {
		t.Fatalf("result = %+v, want pending after 3 attempts, with its key", res)
	}

	healthy.Store(true)
	results, err := c.Resume(t.Context(), nil)
	if err != nil {
		t.Fatalf("Resume: %v", err)
	}
	if len(results) != 1 || results[0].Key != res.Key || results[0].Status != IntentDone || results[0].Attempts != 4 {
		t.Fatalf("Resume = %+v, want key %s done after 4 attempts in all", results, res.Key)
	}
	seen, executed := f.snapshot()
	if len(distinct(seen)) != 1 || len(executed) != 1 {
		t.Fatalf("keys %q, executions %d; want one key and one execution", distinct(seen), len(executed))
	}
}

// Pending intents older than the key lifetime are never re-sent: the server may have
// forgotten the key and a late retry would be a second charge.
func TestClientResumeSkipsExpired(t *testing.T) {
	f := newFakeIngress(t)
	j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
	old := Intent{Key: idem.NewKey(), Method: "POST", Path: "/v1/payments", Payload: []byte(`{}`), CreatedAt: time.Now().Add(-25 * time.Hour)}
	fresh := Intent{Key: idem.NewKey(), Method: "POST", Path: "/v1/payments", Payload: []byte(`{}`), CreatedAt: time.Now().Add(-time.Hour)}
	for _, in := range []Intent{old, fresh} {
		if err := j.Append(t.Context(), in); err != nil {
			t.Fatal(err)
		}
	}
	c := newClientT(t, testConfig(t, f, j)) // default KeyLifetime: 24h

	var calls []string
	results, err := c.Resume(t.Context(), func(done, total int, r Result) {
		calls = append(calls, fmt.Sprintf("%d/%d %s", done, total, r.Status))
	})
	if err != nil {
		t.Fatalf("Resume: %v", err)
	}
	if len(results) != 2 || results[0].Key != old.Key || results[0].Status != IntentExpired || results[0].Attempts != 0 ||
		results[1].Key != fresh.Key || results[1].Status != IntentDone {
		t.Fatalf("results = %+v, want [expired old, done fresh]", results)
	}
	if want := []string{"1/2 expired", "2/2 done"}; fmt.Sprint(calls) != fmt.Sprint(want) {
		t.Fatalf("progress calls = %v, want %v", calls, want)
	}
	if seen, _ := f.snapshot(); len(seen) != 1 || seen[0] != string(fresh.Key) {
		t.Fatalf("server saw %q, want only the fresh key", seen)
	}
	// The expired intent stays in the journal, pending, for a human to reconcile,
	// and List reports it as expired.
	if p := pendingOf(t, j); len(p) != 1 || p[0].Key != old.Key {
		t.Fatalf("pending = %v, want the expired intent", keysOf(p))
	}
	if l, err := c.List(t.Context()); err != nil || len(l) != 2 || l[0].Status != IntentExpired || l[1].Status != IntentDone {
		t.Fatalf("List = %+v, %v", l, err)
	}
}

// A client that crashes after journaling, before or during the send, loses nothing:
// the next process resumes with the same key, and the effect happens once. The crash
// is real: a child process (this test binary) exits in the middle of the send.
func TestClientCrashThenResume(t *testing.T) {
	for _, mode := range []string{"before-send", "after-send"} {
		t.Run(mode, func(t *testing.T) {
			f := newFakeIngress(t)
			path := filepath.Join(t.TempDir(), "j")
			cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestClientCrashHelper$")
			cmd.Env = append(os.Environ(), "IDEM_CRASH_JOURNAL="+path, "IDEM_CRASH_URL="+f.srv.URL, "IDEM_CRASH_MODE="+mode)
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != 3 {
				t.Fatalf("child: err = %v, want exit 3; output:\n%s", err, out)
			}

			// The dead child's lock is gone with it.
			j := openJournalT(t, path)
			pending := pendingOf(t, j)
			if len(pending) != 1 {
				t.Fatalf("pending after crash = %v, want 1 intent", keysOf(pending))
			}
			c := newClientT(t, testConfig(t, f, j))
			results, err := c.Resume(t.Context(), nil)
			if err != nil {
				t.Fatalf("Resume: %v", err)
			}
			if len(results) != 1 || results[0].Key != pending[0].Key || results[0].Status != IntentDone || results[0].Attempts != 2 {
				t.Fatalf("Resume = %+v, want %s done after 2 attempts (one crashed)", results, pending[0].Key)
			}
			seen, executed := f.snapshot()
			if len(executed) != 1 || len(distinct(seen)) != 1 || seen[len(seen)-1] != string(pending[0].Key) {
				t.Fatalf("requests %q, executions %d; want one key, one execution", seen, len(executed))
			}
			if wantReplay := mode == "after-send"; results[0].Replayed != wantReplay {
				t.Fatalf("replayed = %v, want %v", results[0].Replayed, wantReplay)
			}
		})
	}
}

// crashTransport kills the process in the middle of a send: before the request
// leaves, or after the server has answered but before the client records it.
type crashTransport struct{ mode string }

func (c crashTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if c.mode == "before-send" {
		os.Exit(3)
	}
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err == nil {
		_, _ = io.ReadAll(resp.Body)
	}
	os.Exit(3)
	return nil, nil
}

// TestClientCrashHelper is the child process of TestClientCrashThenResume; it does
// nothing in a normal test run.
func TestClientCrashHelper(t *testing.T) {
	path := os.Getenv("IDEM_CRASH_JOURNAL")
	if path == "" {
		t.Skip("child process of TestClientCrashThenResume")
	}
	j, err := OpenJournal(path)
	if err != nil {
		t.Fatal(err)
	}
	c, err := New(Config{
		Store:      j,
		BaseURL:    os.Getenv("IDEM_CRASH_URL"),
		HTTPClient: &http.Client{Transport: crashTransport{mode: os.Getenv("IDEM_CRASH_MODE")}},
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Submit(context.Background(), payment)
	t.Fatalf("Submit returned (%v); the transport should have exited the process", err)
}

func TestClientScopeAndHeaders(t *testing.T) {
	f := newFakeIngress(t)
	j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
	cfg := testConfig(t, f, j)

	if _, err := newClientT(t, cfg).Submit(t.Context(), payment); err != nil {
		t.Fatal(err)
	}
	cfg.Scope = "tenant-b"
	if _, err := newClientT(t, cfg).Submit(t.Context(), payment); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	scopes := append([]string(nil), f.scopes...)
	f.mu.Unlock()
	if fmt.Sprint(scopes) != fmt.Sprint([]string{"", "tenant-b"}) {
		t.Fatalf("Idempotency-Scope headers = %q, want none then tenant-b", scopes)
	}
	// Two submits of identical payloads are two intents: two keys, two effects. The
	// key names the intent, not the content.
	if _, executed := f.snapshot(); len(executed) != 2 {
		t.Fatalf("executions = %d, want 2", len(executed))
	}
}

func TestConfigValidate(t *testing.T) {
	j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
	c, err := New(Config{Store: j})
	if err != nil {
		t.Fatal(err)
	}
	got := c.cfg
	if got.BaseURL != DefaultBaseURL || got.MaxAttempts != DefaultMaxAttempts || got.BackoffBase != defaultBackoffBase ||
		got.BackoffMax != defaultBackoffMax || got.Timeout != DefaultTimeout || got.KeyLifetime != DefaultKeyLifetime ||
		got.HTTPClient == nil || got.Logger == nil {
		t.Fatalf("defaults not applied: %+v", got)
	}
	for name, cfg := range map[string]Config{
		"no store":         {},
		"bad url":          {Store: j, BaseURL: "127.0.0.1:8080"},
		"bad scope":        {Store: j, Scope: "a\tb"},
		"negative timeout": {Store: j, Timeout: -time.Second},
		"max below base":   {Store: j, BackoffBase: time.Second, BackoffMax: time.Millisecond},
		"negative tries":   {Store: j, MaxAttempts: -1},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: NewClient succeeded", name)
		}
	}
	c, _ = New(Config{Store: j})
	if _, err := c.Submit(t.Context(), Request{Path: "v1/payments"}); err == nil {
		t.Error("Submit with a relative path succeeded")
	}
}

// A cancelled context stops the retries; the intent stays pending with its key.
func TestClientContextCancelled(t *testing.T) {
	f := newFakeIngress(t)
	ctx, cancel := context.WithCancel(t.Context())
	f.fail = func(_ int, w http.ResponseWriter, _ *http.Request, _ []byte) bool {
		cancel() // the user hits ^C while the server is failing
		w.WriteHeader(http.StatusServiceUnavailable)
		return true
	}
	j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
	c := newClientT(t, testConfig(t, f, j))
	res, err := c.Submit(ctx, payment)
	if !errors.Is(err, ErrStillPending) || !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want ErrStillPending and context.Canceled", err)
	}
	if res.Status != IntentPending || res.Key == "" {
		t.Fatalf("result = %+v, want pending with a key", res)
	}
	if p := pendingOf(t, j); len(p) != 1 || p[0].Key != res.Key {
		t.Fatalf("journal pending = %v, want %s", keysOf(p), res.Key)
	}
}

// A server's Retry-After is the least wait before the next attempt: a 429 or 409
// answered with "Retry-After: 1" is not retried a microsecond later, however small
// the backoff; and BackoffMax caps it, so a server cannot park a client for hours.
func TestClientHonoursRetryAfter(t *testing.T) {
	cases := []struct {
		name       string
		status     int
		retryAfter string
		backoffMax time.Duration
		minGap     time.Duration
	}{
		{"429 delay-seconds", http.StatusTooManyRequests, "1", 5 * time.Second, time.Second},
		{"409 http-date", http.StatusConflict, "", 5 * time.Second, time.Second}, // date set below
		{"capped at BackoffMax", http.StatusServiceUnavailable, "3600", 200 * time.Millisecond, 200 * time.Millisecond},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFakeIngress(t)
			var mu sync.Mutex
			var arrivals []time.Time
			f.fail = func(n int, w http.ResponseWriter, _ *http.Request, _ []byte) bool {
				mu.Lock()
				arrivals = append(arrivals, time.Now())
				mu.Unlock()
				if n > 1 {
					return false
				}
				ra := tc.retryAfter
				if ra == "" {
					// HTTP dates have whole seconds: 2s ahead is at least 1s ahead.
					ra = time.Now().Add(2 * time.Second).UTC().Format(http.TimeFormat)
				}
				w.Header().Set("Retry-After", ra)
				w.WriteHeader(tc.status)
				return true
			}
			cfg := testConfig(t, f, openJournalT(t, filepath.Join(t.TempDir(), "j")))
			cfg.BackoffMax = tc.backoffMax
			res, err := newClientT(t, cfg).Submit(t.Context(), payment)
			if err != nil || res.Status != IntentDone || res.Attempts != 2 {
				t.Fatalf("Submit = %+v, %v; want done after 2 attempts", res, err)
			}
			mu.Lock()
			defer mu.Unlock()
			least := tc.minGap
			if tc.retryAfter == "" {
				least = time.Second
			}
			if gap := arrivals[1].Sub(arrivals[0]); gap < least {
				t.Fatalf("second attempt %v after the first, want at least %v (Retry-After %q)", gap, least, tc.retryAfter)
			}
			if tc.retryAfter == "3600" {
				if gap := arrivals[1].Sub(arrivals[0]); gap > time.Minute {
					t.Fatalf("second attempt %v after the first: Retry-After was not capped at BackoffMax", gap)
				}
			}
		})
	}
}

func TestParseRetryAfter(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	cases := []struct {
		in   string
		want time.Duration
	}{
		{"", 0},
		{"0", 0},
		{"-5", 0},
		{"3", 3 * time.Second},
		{" 7 ", 7 * time.Second},
		{"99999999999", 24 * time.Hour},
		{"soon", 0},
		{"1.5", 0},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second},
		{now.Add(-time.Minute).Format(http.TimeFormat), 0},
	}
	for _, tc := range cases {
		if got := parseRetryAfter(tc.in, now); got != tc.want {
			t.Errorf("parseRetryAfter(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}
