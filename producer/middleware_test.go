package producer_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/producer"
)

// testApp is a handler with a real effect: every execution inserts one test_writes
// row through the middleware's transaction. test_writes has no unique constraint on
// the key, so counting rows shows every execution that committed — a double effect
// cannot hide.
//
// Its routes misbehave on purpose:
//
//	POST /ok           201 + JSON + X-Test header
//	POST /reject       400 from the handler (a final answer: stored)
//	POST /busy         429 on the first call, then 201 (a "not now": never stored)
//	POST /flaky        500 on the first call after writing, then 201
//	POST /panic        panics on the first call after writing, then 201
//	POST /block        writes, signals entered, waits for release (or fail), 201
//	GET  /ok           200, no key needed
type testApp struct {
	calls   atomic.Int64 // executions, committed or not
	entered chan struct{}
	release chan struct{}
	stop    chan struct{} // closed at cleanup, so a failed test never strands a handler
	// failAfterRelease makes /block answer 500 once released, instead of 201.
	failAfterRelease atomic.Bool
}

func newTestApp(t *testing.T) *testApp {
	a := &testApp{entered: make(chan struct{}, 8), release: make(chan struct{}), stop: make(chan struct{})}
	// Registered after pgtest.New, so it runs before the pool is closed: a handler
	// still holding a connection would block pool.Close.
	t.Cleanup(func() { close(a.stop) })
	return a
}

func (a *testApp) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet || r.Method == http.MethodHead {
		if _, ok := producer.IntentFrom(r.Context()); ok {
			http.Error(w, "a safe method must not get an intent", http.StatusInternalServerError)
			return
		}
		_, _ = w.Write([]byte("hello"))
		return
	}
	n := a.calls.Add(1)
	ctx := r.Context()
	in, ok := producer.IntentFrom(ctx)
	if !ok {
		http.Error(w, "no intent in context", http.StatusInternalServerError)
		return
	}
	if r.URL.Path == "/reject" {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"error":"the handler says no"}`))
		return
	}
	var id int64
	if err := in.Tx.QueryRow(ctx, `INSERT INTO test_writes (key) VALUES ($1) RETURNING id`, in.ScopedKey()).Scan(&id); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	switch r.URL.Path {
	case "/busy":
		if n == 1 {
			http.Error(w, "slow down", http.StatusTooManyRequests)
			return
		}
	case "/flaky":
		if n == 1 {
			http.Error(w, "transient failure", http.StatusInternalServerError)
			return
		}
	case "/panic":
		if n == 1 {
			panic("boom")
		}
	case "/block":
		a.entered <- struct{}{}
		select {
		case <-a.release:
		case <-a.stop:
			http.Error(w, "test over", http.StatusServiceUnavailable)
			return
		}
		if a.failAfterRelease.Load() {
			http.Error(w, "failed while others waited", http.StatusInternalServerError)
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Test", "first")
	w.WriteHeader(http.StatusCreated)
	body, _ := json.Marshal(map[string]any{"write_id": id, "call": n, "path": r.URL.Path})
	_, _ = w.Write(body)
}

// outcomes records the ingress events an Observer is told.
type outcomes struct {
	mu   sync.Mutex
	list []idem.Outcome
}

func (o *outcomes) observe(e idem.Event) {
	if e.Component != idem.ComponentIngress || e.Count != 1 {
		panic(fmt.Sprintf("unexpected event %+v", e))
	}
	o.mu.Lock()
	o.list = append(o.list, e.Outcome)
	o.mu.Unlock()
}

func (o *outcomes) len() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.list)
}

func (o *outcomes) last() idem.Outcome {
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.list) == 0 {
		return ""
	}
	return o.list[len(o.list)-1]
}

// req is one request of a test.
type req struct {
	method string // default POST
	path   string
	key    *string // nil: no Idempotency-Key header at all
	scope  string
	body   string
	ctx    context.Context // the request's context (fault points); nil: background
}

func key(s string) *string { return &s }

func (q req) send(h http.Handler) *httptest.ResponseRecorder {
	method := q.method
	if method == "" {
		method = http.MethodPost
	}
	r := httptest.NewRequest(method, q.path, strings.NewReader(q.body))
	if q.ctx != nil {
		r = r.WithContext(q.ctx)
	}
	if q.key != nil {
		r.Header[idem.HeaderKey] = []string{*q.key} // raw, so an empty value is sent as such
	}
	if q.scope != "" {
		r.Header.Set(idem.HeaderScope, q.scope)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// newDB is a fresh database with idem's tables and the test's own business table.
func newDB(t *testing.T, opts pgtest.Options) *pgtest.DB {
	t.Helper()
	db := pgtest.NewWith(t, opts)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE public.test_writes (id bigserial PRIMARY KEY, key text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return db
}

// testStream is the stream of the tests' installations: its subjects bound what
// Intent.Enqueue accepts.
var testStream = install.Stream{Name: "TEST", Subjects: []string{"test.>"}}

// installOf is the installation of pool's public schema on testStream, without a
// NATS connection (the middleware needs only the tables), changed by edits.
func installOf(t *testing.T, pool *pgxpool.Pool, edits ...func(*install.Config)) *install.Installation {
	t.Helper()
	cfg := install.Config{Stream: testStream}
	for _, edit := range edits {
		edit(&cfg)
	}
	inst, err := install.New(pool, nil, cfg)
	if err != nil {
		t.Fatalf("install.New: %v", err)
	}
	return inst
}

// observedBy puts obs on the installation.
func observedBy(obs idem.Observer) func(*install.Config) {
	return func(c *install.Config) { c.Observer = obs }
}

// newMiddleware is the ingress of installOf(pool, edits...).
func newMiddleware(t *testing.T, pool *pgxpool.Pool, cfg producer.Config, edits ...func(*install.Config)) *producer.Middleware {
	t.Helper()
	mw, err := producer.NewMiddleware(installOf(t, pool, edits...), cfg)
	if err != nil {
		t.Fatalf("NewMiddleware: %v", err)
	}
	return mw
}

func errCode(t *testing.T, w *httptest.ResponseRecorder) string {
	t.Helper()
	var body struct{ Error, Code string }
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
		t.Fatalf("error body %q is not JSON: %v", w.Body.String(), err)
	}
	if body.Error == "" {
		t.Errorf("error body %q has no message", w.Body.String())
	}
	return body.Code
}

// TestMiddlewareStatusCodes walks every answer of the protocol. Each case is a
// sequence of requests on a fresh database; after it, test_writes shows how many
// executions committed and idem_requests how many keys were claimed.
func TestMiddlewareStatusCodes(t *testing.T) {
	t.Parallel()
	type step struct {
		req
		status   int
		replayed bool
		code     string       // JSON error code of a middleware answer
		outcome  idem.Outcome // reported to the Observer ("" for safe methods)
		sameAs   int          // 1-based index of an earlier step whose body must be repeated
	}
	body := `{"amount":1}`
	cases := []struct {
		name        string
		cfg         producer.Config
		steps       []step
		wantWrites  int
		wantRecords int
	}{
		{
			name: "first executes, duplicate replays status, headers and body",
			steps: []step{
				{req: req{path: "/ok", key: key("k1"), body: body}, status: 201, outcome: "new"},
				{req: req{path: "/ok", key: key("k1"), body: body}, status: 201, replayed: true, outcome: "replayed", sameAs: 1},
				{req: req{path: "/ok", key: key("k1"), body: body}, status: 201, replayed: true, outcome: "replayed", sameAs: 1},
			},
			wantWrites: 1, wantRecords: 1,
		},
		{
			name: "two keys are two intents even with identical bodies",
			steps: []step{
				{req: req{path: "/ok", key: key("k1"), body: body}, status: 201, outcome: "new"},
				{req: req{path: "/ok", key: key("k2"), body: body}, status: 201, outcome: "new"},
			},
			wantWrites: 2, wantRecords: 2,
		},
		{
			name: "missing key is 400 and claims nothing",
			steps: []step{
				{req: req{path: "/ok", body: body}, status: 400, code: "missing_idempotency_key", outcome: "rejected"},
			},
		},
		{
			name: "malformed keys are 400",
			steps: []step{
				{req: req{path: "/ok", key: key(""), body: body}, status: 400, code: "malformed_idempotency_key", outcome: "rejected"},
				{req: req{path: "/ok", key: key(strings.Repeat("k", 256)), body: body}, status: 400, code: "malformed_idempotency_key", outcome: "rejected"},
				{req: req{path: "/ok", key: key("k\x01"), body: body}, status: 400, code: "malformed_idempotency_key", outcome: "rejected"},
				{req: req{path: "/ok", key: key("ключ"), body: body}, status: 400, code: "malformed_idempotency_key", outcome: "rejected"},
				// The longest valid key still works.
				{req: req{path: "/ok", key: key(strings.Repeat("k", 255)), body: body}, status: 201, outcome: "new"},
			},
			wantWrites: 1, wantRecords: 1,
		},
		{
			name: "malformed scope is 400",
			cfg:  producer.Config{ScopeFromHeader: true},
			steps: []step{
				{req: req{path: "/ok", key: key("k1"), scope: strings.Repeat("s", 256), body: body}, status: 400, code: "malformed_idempotency_scope", outcome: "rejected"},
			},
		},
		{
			name: "same key with a different body or path is 422",
			steps: []step{
				{req: req{path: "/ok", key: key("k1"), body: body}, status: 201, outcome: "new"},
				{req: req{path: "/ok", key: key("k1"), body: `{"amount":2}`}, status: 422, code: "idempotency_key_mismatch", outcome: "mismatch"},
				{req: req{path: "/flaky", key: key("k1"), body: body}, status: 422, code: "idempotency_key_mismatch", outcome: "mismatch"},
				{req: req{method: http.MethodPut, path: "/ok", key: key("k1"), body: body}, status: 422, code: "idempotency_key_mismatch", outcome: "mismatch"},
				// The mismatch did not disturb the record.
				{req: req{path: "/ok", key: key("k1"), body: body}, status: 201, replayed: true, outcome: "replayed", sameAs: 1},
			},
			wantWrites: 1, wantRecords: 1,
		},
		{
			name: "oversize body is 413 and does not use up the key",
			cfg:  producer.Config{MaxBodyBytes: 16},
			steps: []step{
				{req: req{path: "/ok", key: key("k1"), body: strings.Repeat("x", 17)}, status: 413, code: "body_too_large", outcome: "rejected"},
				{req: req{path: "/ok", key: key("k1"), body: strings.Repeat("x", 16)}, status: 201, outcome: "new"},
			},
			wantWrites: 1, wantRecords: 1,
		},
		{
			name: "a response over MaxResponseBytes rolls back and is not stored",
			cfg:  producer.Config{MaxResponseBytes: 16},
			steps: []step{
				{req: req{path: "/ok", key: key("k1"), body: body}, status: 500, code: "response_too_large", outcome: "failed"},
				{req: req{path: "/ok", key: key("k1"), body: body}, status: 500, code: "response_too_large", outcome: "failed"},
			},
			wantWrites: 0, wantRecords: 0,
		},
		{
			name: "a handler 4xx is final: stored and replayed",
			steps: []step{
				{req: req{path: "/reject", key: key("k1"), body: body}, status: 400, outcome: "new"},
				{req: req{path: "/reject", key: key("k1"), body: body}, status: 400, replayed: true, outcome: "replayed", sameAs: 1},
			},
			wantWrites: 0, wantRecords: 1,
		},
		{
			name: "a handler 429 is not final: rolled back, retry executes",
			steps: []step{
				{req: req{path: "/busy", key: key("k1"), body: body}, status: 429, outcome: "failed"},
				{req: req{path: "/busy", key: key("k1"), body: body}, status: 201, outcome: "new"},
			},
			wantWrites: 1, wantRecords: 1,
		},
		{
			name: "a handler 5xx rolls back everything, retry executes once more",
			steps: []step{
				{req: req{path: "/flaky", key: key("k1"), body: body}, status: 500, outcome: "failed"},
				{req: req{path: "/flaky", key: key("k1"), body: body}, status: 201, outcome: "new"},
				{req: req{path: "/flaky", key: key("k1"), body: body}, status: 201, replayed: true, outcome: "replayed", sameAs: 2},
			},
			wantWrites: 1, wantRecords: 1,
		},
		{
			name: "a handler panic rolls back everything, retry executes once more",
			steps: []step{
				{req: req{path: "/panic", key: key("k1"), body: body}, status: 500, code: "internal_error", outcome: "failed"},
				{req: req{path: "/panic", key: key("k1"), body: body}, status: 201, outcome: "new"},
			},
			wantWrites: 1, wantRecords: 1,
		},
		{
			name: "the query string is part of the request: the same key with another one is a mismatch",
			steps: []step{
				{req: req{path: "/ok?amount=1", key: key("k1"), body: body}, status: 201, outcome: "new"},
				{req: req{path: "/ok?amount=100", key: key("k1"), body: body}, status: 422, code: "idempotency_key_mismatch", outcome: "mismatch"},
				{req: req{path: "/ok?amount=1", key: key("k1"), body: body}, status: 201, replayed: true, outcome: "replayed", sameAs: 1},
			},
			wantWrites: 1, wantRecords: 1,
		},
		{
			name: "by default a client's scope header is refused, not trusted",
			steps: []step{
				{req: req{path: "/ok", key: key("k1"), scope: "tenant-a", body: body}, status: 400, code: "idempotency_scope_not_accepted", outcome: "rejected"},
				{req: req{path: "/ok", key: key("k1"), body: body}, status: 201, outcome: "new"},
			},
			wantWrites: 1, wantRecords: 1,
		},
		{
			name: "safe methods pass through without a key",
			steps: []step{
				{req: req{method: http.MethodGet, path: "/ok"}, status: 200},
				{req: req{method: http.MethodHead, path: "/ok"}, status: 200},
			},
		},
		{
			name: "the same key in another scope is another intent",
			cfg:  producer.Config{ScopeFromHeader: true},
			steps: []step{
				{req: req{path: "/ok", key: key("k1"), scope: "tenant-a", body: body}, status: 201, outcome: "new"},
				{req: req{path: "/ok", key: key("k1"), scope: "tenant-b", body: `{"amount":2}`}, status: 201, outcome: "new"},
				{req: req{path: "/ok", key: key("k1"), body: body}, status: 201, outcome: "new"},
				{req: req{path: "/ok", key: key("k1"), scope: "tenant-a", body: body}, status: 201, replayed: true, outcome: "replayed", sameAs: 1},
			},
			wantWrites: 3, wantRecords: 3,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := newDB(t, pgtest.Options{})
			var got outcomes
			h := newMiddleware(t, db.Pool, tc.cfg, observedBy(got.observe)).Wrap(newTestApp(t))

			var answers []*httptest.ResponseRecorder
			for i, s := range tc.steps {
				before := got.len()
				w := s.send(h)
				answers = append(answers, w)
				if w.Code != s.status {
					t.Fatalf("step %d: status %d, want %d; body %s", i+1, w.Code, s.status, w.Body)
				}
				if replayed := w.Header().Get(idem.HeaderReplayed) == "true"; replayed != s.replayed {
					t.Errorf("step %d: replayed=%v, want %v", i+1, replayed, s.replayed)
				}
				if s.code != "" {
					if c := errCode(t, w); c != s.code {
						t.Errorf("step %d: error code %q, want %q", i+1, c, s.code)
					}
					if ct := w.Header().Get("Content-Type"); ct != "application/json" {
						t.Errorf("step %d: error Content-Type %q", i+1, ct)
					}
				}
				if s.outcome == "" && got.len() != before {
					t.Errorf("step %d: unexpected outcome %q", i+1, got.last())
				}
				if s.outcome != "" && got.last() != s.outcome {
					t.Errorf("step %d: outcome %q, want %q", i+1, got.last(), s.outcome)
				}
				if s.sameAs > 0 {
					first := answers[s.sameAs-1]
					if !bytes.Equal(w.Body.Bytes(), first.Body.Bytes()) {
						t.Errorf("step %d: replayed body %q, want %q", i+1, w.Body, first.Body)
					}
					for _, h := range []string{"Content-Type", "X-Test"} {
						if w.Header().Get(h) != first.Header().Get(h) {
							t.Errorf("step %d: header %s = %q, want %q", i+1, h, w.Header().Get(h), first.Header().Get(h))
						}
					}
				}
			}
			if n := db.Count(t, `SELECT count(*) FROM test_writes`); n != tc.wantWrites {
				t.Errorf("test_writes: %d rows, want %d", n, tc.wantWrites)
			}
			if n := db.Count(t, `SELECT count(*) FROM idem_requests`); n != tc.wantRecords {
				t.Errorf("idem_requests: %d rows, want %d", n, tc.wantRecords)
			}
			if n := db.Count(t, `SELECT count(*) FROM idem_requests WHERE status <> 'done' OR response_code IS NULL`); n != 0 {
				t.Errorf("idem_requests: %d rows committed without a response", n)
			}
		})
	}
}

// recv receives from ch, failing the test instead of hanging when nothing comes.
func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(30 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
		panic("unreachable")
	}
}

// waitFor polls cond until it holds; the test's deadline bounds it.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(20 * time.Second)
	for !cond() {
		select {
		case <-tick.C:
		case <-deadline:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// lockWaiters counts backends of this test's database blocked on a heavyweight
// lock: a duplicate's INSERT waiting on the first arrival's uncommitted row.
func lockWaiters(t *testing.T, db *pgtest.DB) int {
	return db.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`)
}

// TestMiddlewareConflictWhileFirstRuns holds the first request's transaction open
// inside the handler and shows that a duplicate whose Wait runs out gets 409 with
// Retry-After, claims nothing, and that the first still completes and is replayed.
func TestMiddlewareConflictWhileFirstRuns(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	app := newTestApp(t)
	var got outcomes
	h := newMiddleware(t, db.Pool, producer.Config{Wait: 50 * time.Millisecond}, observedBy(got.observe)).Wrap(app)

	q := req{path: "/block", key: key("k1"), body: `{}`}
	first := make(chan *httptest.ResponseRecorder, 1)
	go func() { first <- q.send(h) }()
	recv(t, app.entered, "the first to enter the handler") // it has claimed the key and holds its transaction open

	w := q.send(h)
	if w.Code != http.StatusConflict {
		t.Fatalf("duplicate: status %d, want 409; body %s", w.Code, w.Body)
	}
	if c := errCode(t, w); c != "idempotency_key_in_use" {
		t.Errorf("duplicate: code %q", c)
	}
	if ra := w.Header().Get("Retry-After"); ra != "1" {
		t.Errorf("duplicate: Retry-After %q, want 1", ra)
	}
	if got.last() != idem.OutcomeConflict {
		t.Errorf("outcome %q, want conflict", got.last())
	}

	close(app.release)
	w1 := recv(t, first, "the first response")
	if w1.Code != http.StatusCreated {
		t.Fatalf("first: status %d; body %s", w1.Code, w1.Body)
	}
	w3 := q.send(h)
	if w3.Code != http.StatusCreated || w3.Header().Get(idem.HeaderReplayed) != "true" || w3.Body.String() != w1.Body.String() {
		t.Fatalf("retry after the first finished: %d %q replayed=%q, want the first's answer", w3.Code, w3.Body, w3.Header().Get(idem.HeaderReplayed))
	}
	if n := db.Count(t, `SELECT count(*) FROM test_writes`); n != 1 {
		t.Errorf("test_writes: %d rows, want 1", n)
	}
}

// TestMiddlewareDuplicateWaitsThenReplays shows the two ways a waiting duplicate
// wakes up: the first commits (the duplicate replays its response) or the first
// rolls back (the duplicate claims the key and executes itself). Either way there is
// exactly one committed effect.
func TestMiddlewareDuplicateWaitsThenReplays(t *testing.T) {
	t.Parallel()
	for _, firstFails := range []bool{false, true} {
		name := map[bool]string{false: "first commits", true: "first rolls back"}[firstFails]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := newDB(t, pgtest.Options{})
			app := newTestApp(t)
			app.failAfterRelease.Store(firstFails)
			h := newMiddleware(t, db.Pool, producer.Config{Wait: 20 * time.Second}).Wrap(app)

			q := req{path: "/block", key: key("k1"), body: `{}`}
			first := make(chan *httptest.ResponseRecorder, 1)
			go func() { first <- q.send(h) }()
			recv(t, app.entered, "the first to enter the handler")

			second := make(chan *httptest.ResponseRecorder, 1)
			go func() { second <- q.send(h) }()
			waitFor(t, "the duplicate to block on the first's claim", func() bool { return lockWaiters(t, db) == 1 })

			if firstFails {
				// The duplicate executes in turn, so it will block in the handler too;
				// let it through once the first is done.
				app.release <- struct{}{}
				w1 := recv(t, first, "the first response")
				if w1.Code != http.StatusInternalServerError {
					t.Fatalf("first: status %d, want 500", w1.Code)
				}
				recv(t, app.entered, "the duplicate to enter the handler") // it claimed the key and runs the handler
				app.failAfterRelease.Store(false)
				close(app.release)
				w2 := recv(t, second, "the duplicate's response")
				if w2.Code != http.StatusCreated || w2.Header().Get(idem.HeaderReplayed) != "" {
					t.Fatalf("duplicate: %d replayed=%q, want a fresh 201", w2.Code, w2.Header().Get(idem.HeaderReplayed))
				}
			} else {
				close(app.release)
				w1, w2 := recv(t, first, "the first response"), recv(t, second, "the duplicate's response")
				if w1.Code != http.StatusCreated {
					t.Fatalf("first: status %d", w1.Code)
				}
				if w2.Code != w1.Code || w2.Body.String() != w1.Body.String() || w2.Header().Get(idem.HeaderReplayed) != "true" {
					t.Fatalf("duplicate: %d %q replayed=%q, want the first's answer replayed", w2.Code, w2.Body, w2.Header().Get(idem.HeaderReplayed))
				}
			}
			if n := db.Count(t, `SELECT count(*) FROM test_writes`); n != 1 {
				t.Errorf("test_writes: %d rows, want 1", n)
			}
			if n := app.calls.Load(); n != map[bool]int64{false: 1, true: 2}[firstFails] {
				t.Errorf("handler ran %d times", n)
			}
		})
	}
}

// TestMiddlewareDatabaseDown: with the database unreachable a state-changing
// request gets 503 with a message and Retry-After; a safe one still passes.
func TestMiddlewareDatabaseDown(t *testing.T) {
	t.Parallel()
	// Port 1 refuses connections at once; the pool connects lazily, so
	// construction succeeds, as it would for a service started before its database.
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var got outcomes
	app := newTestApp(t)
	h := newMiddleware(t, pool, producer.Config{}, observedBy(got.observe)).Wrap(app)

	w := req{path: "/ok", key: key("k1"), body: `{}`}.send(h)
	if w.Code != http.StatusServiceUnavailable {
		t.Fatalf("status %d, want 503; body %s", w.Code, w.Body)
	}
	if c := errCode(t, w); c != "database_unavailable" {
		t.Errorf("code %q", c)
	}
	if w.Header().Get("Retry-After") == "" {
		t.Error("no Retry-After")
	}
	if got.last() != idem.OutcomeUnavailable {
		t.Errorf("outcome %q", got.last())
	}
	if app.calls.Load() != 0 {
		t.Error("the handler ran without a transaction")
	}
	if w := (req{method: http.MethodGet, path: "/ok"}).send(h); w.Code != http.StatusOK {
		t.Errorf("GET: status %d, want 200", w.Code)
	}
}

// TestMiddlewareExpiredKey: after its lifetime a key names nothing; the next request
// with it executes afresh, with any payload. (Deleting expired records is the
// worker's collector's job, tested there.)
func TestMiddlewareExpiredKey(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	mw := newMiddleware(t, db.Pool, producer.Config{KeyLifetime: time.Hour})
	h := mw.Wrap(newTestApp(t))

	if w := (req{path: "/ok", key: key("k1"), body: `{"a":1}`}).send(h); w.Code != http.StatusCreated {
		t.Fatalf("first: %d", w.Code)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_requests WHERE expires_at BETWEEN now() + interval '59 minutes' AND now() + interval '61 minutes'`); n != 1 {
		t.Fatalf("expires_at does not follow KeyLifetime")
	}
	// Before expiry another payload is a mismatch ...
	if w := (req{path: "/ok", key: key("k1"), body: `{"a":2}`}).send(h); w.Code != http.StatusUnprocessableEntity {
		t.Fatalf("before expiry: %d, want 422", w.Code)
	}
	// ... after it, a new intent. Age the record instead of sleeping through an hour.
	if _, err := db.Pool.Exec(context.Background(), `UPDATE idem_requests SET expires_at = now() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	w := req{path: "/ok", key: key("k1"), body: `{"a":2}`}.send(h)
	if w.Code != http.StatusCreated || w.Header().Get(idem.HeaderReplayed) != "" {
		t.Fatalf("after expiry: %d replayed=%q, want a fresh execution", w.Code, w.Header().Get(idem.HeaderReplayed))
	}
	if n := db.Count(t, `SELECT count(*) FROM test_writes`); n != 2 {
		t.Errorf("test_writes: %d, want 2", n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_requests WHERE key = 'k1' AND expires_at > now()`); n != 1 {
		t.Errorf("the expired record was not replaced by a live one")
	}
}

func TestMiddlewareConfig(t *testing.T) {
	t.Parallel()
	pool := pgtest.Unreachable(t) // validation queries nothing
	// The pool and the schema are the installation's, which refuses what no
	// middleware could use.
	if _, err := install.New(nil, nil, install.Config{Stream: testStream}); err == nil {
		t.Error("nil pool accepted")
	}
	if _, err := install.New(pool, nil, install.Config{Schema: "Not-A-Schema", Stream: testStream}); err == nil {
		t.Error("invalid schema accepted")
	}
	inst := installOf(t, pool)
	for _, cfg := range []producer.Config{
		{Wait: -time.Second},
		{KeyLifetime: time.Millisecond},
		{MaxBodyBytes: -1},
		{MaxResponseBytes: -1},
	} {
		_, err := producer.NewMiddleware(inst, cfg)
		if err == nil {
			t.Errorf("%+v accepted", cfg)
		} else if !strings.HasPrefix(err.Error(), "producer: ") {
			t.Errorf("%+v: error %q lacks the package's prefix", cfg, err)
		}
	}
	c := newMiddleware(t, pool, producer.Config{}).Config()
	if c.KeyLifetime != producer.DefaultKeyLifetime || c.Wait != producer.DefaultWait || c.MaxBodyBytes != producer.DefaultMaxBodyBytes ||
		c.MaxResponseBytes != producer.DefaultMaxResponseBytes || c.Scope == nil {
		t.Errorf("defaults not filled in: %+v", c)
	}
	if producer.DefaultKeyLifetime != 48*time.Hour {
		t.Errorf("DefaultKeyLifetime %v", producer.DefaultKeyLifetime)
	}
	// Outside the middleware there is no intent, rather than a panic.
	if in, ok := producer.IntentFrom(context.Background()); ok || in != nil {
		t.Error("IntentFrom outside the middleware")
	}
}

// TestMiddlewareScopeFunc: a service can derive the scope from authentication
// instead of trusting the header, and the handler sees it.
func TestMiddlewareScopeFunc(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	mw := newMiddleware(t, db.Pool, producer.Config{
		Scope: func(r *http.Request) (string, error) { return "user-" + r.Header.Get("X-User"), nil },
	})
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, _ := producer.IntentFrom(r.Context())
		_, _ = fmt.Fprintf(w, "%s|%s|%s", in.Scope, in.Key, in.ScopedKey())
	}))
	r := httptest.NewRequest(http.MethodPost, "/", nil)
	r.Header.Set(idem.HeaderKey, "k1")
	r.Header.Set(idem.HeaderScope, "forged") // ignored by this Scope func
	r.Header.Set("X-User", "42")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if want := "user-42|k1|" + idem.ScopedKey("user-42", "k1"); w.Body.String() != want {
		t.Errorf("handler saw %q, want %q", w.Body, want)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_requests WHERE scope = 'user-42' AND key = 'k1'`); n != 1 {
		t.Errorf("the request was not claimed in the derived scope")
	}
	// A Scope func's error rejects the request before anything is claimed.
	deny := newMiddleware(t, db.Pool, producer.Config{
		Scope: func(*http.Request) (string, error) { return "", fmt.Errorf("not signed in") },
	}).Wrap(newTestApp(t))
	if w := (req{path: "/ok", key: key("k2"), body: `{}`}).send(deny); w.Code != http.StatusBadRequest || errCode(t, w) != "malformed_idempotency_scope" {
		t.Errorf("Scope error: %d %s, want 400 malformed_idempotency_scope", w.Code, w.Body)
	}
}

// The fingerprint tells requests apart across field boundaries: path "/ab" with
// body "c" is not path "/a" with body "bc", so the second, with the same key, is a
// mismatch and not a replay of the first.
func TestMiddlewareFingerprintIsUnambiguous(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	h := newMiddleware(t, db.Pool, producer.Config{}).Wrap(newTestApp(t))
	if w := (req{path: "/ab", key: key("k1"), body: "c"}).send(h); w.Code != http.StatusCreated {
		t.Fatalf("first: %d", w.Code)
	}
	if w := (req{path: "/a", key: key("k1"), body: "bc"}).send(h); w.Code != http.StatusUnprocessableEntity {
		t.Fatalf("same key, /a + bc after /ab + c: %d, want 422", w.Code)
	}
	if w := (req{path: "/ab", key: key("k1"), body: "c"}).send(h); w.Code != http.StatusCreated || w.Header().Get(idem.HeaderReplayed) != "true" {
		t.Fatalf("the same request again: %d replayed=%q, want a replay", w.Code, w.Header().Get(idem.HeaderReplayed))
	}
}

// The fault point IngressAfterCommit is reached once per committed request, after
// the commit (the row is visible from another connection) and before the response
// is written; never for a replay or a rolled-back request. It is armed through the
// request's context.
func TestMiddlewareAfterCommit(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	type call struct {
		scopedKey string
		committed int
		written   bool
	}
	var calls []call
	h := newMiddleware(t, db.Pool, producer.Config{ScopeFromHeader: true}).Wrap(newTestApp(t))
	body := `{"amount":1}`
	for _, q := range []req{
		{path: "/ok", key: key("k1"), scope: "tenant-a", body: body},
		{path: "/ok", key: key("k1"), scope: "tenant-a", body: body}, // replay
		{path: "/flaky", key: key("k2"), body: body},                 // 500: rolled back
		{path: "/flaky", key: key("k2"), body: body},                 // the retry commits
	} {
		w := httptest.NewRecorder()
		q.ctx = faults.With(context.Background(), faults.New().Func(faults.IngressAfterCommit, func(_ context.Context, keys []string) error {
			_, k, _ := idem.ParseScopedKey(keys[0])
			calls = append(calls, call{keys[0], db.Count(t, `SELECT count(*) FROM idem_requests WHERE key = $1 AND status = 'done'`, string(k)), w.Body.Len() > 0})
			return nil
		}))
		r := httptest.NewRequest(http.MethodPost, q.path, strings.NewReader(q.body)).WithContext(q.ctx)
		r.Header.Set(idem.HeaderKey, *q.key)
		if q.scope != "" {
			r.Header.Set(idem.HeaderScope, q.scope)
		}
		h.ServeHTTP(w, r)
	}
	want := []call{{idem.ScopedKey("tenant-a", "k1"), 1, false}, {"k2", 1, false}}
	if !reflect.DeepEqual(calls, want) {
		t.Fatalf("IngressAfterCommit hits = %+v, want %+v", calls, want)
	}
}

// Intent.Enqueue writes the request's message into the outbox inside the request's
// transaction, stamped with the scoped key: it commits with the stored response,
// disappears with a rolled-back request, is not written again by a replay, and a
// subject outside the installation's stream's subjects fails the request.
func TestIntentEnqueue(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	var failOnce atomic.Bool
	failOnce.Store(true)
	h := newMiddleware(t, db.Pool, producer.Config{ScopeFromHeader: true}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, _ := producer.IntentFrom(r.Context())
		if err := in.Enqueue(r.Context(), r.URL.Query().Get("subject"), []byte(`{"n":1}`), map[string]string{"X-Trace": "t1"}); err != nil {
			producer.WriteError(w, http.StatusInternalServerError, "enqueue_failed", err.Error())
			return
		}
		if r.URL.Path == "/flaky" && failOnce.CompareAndSwap(true, false) {
			producer.WriteError(w, http.StatusServiceUnavailable, "try_again", "transient")
			return
		}
		w.WriteHeader(http.StatusAccepted)
	}))
	send := func(path, k, scope string) int {
		return req{path: path, key: key(k), scope: scope, body: `{}`}.send(h).Code
	}
	if c := send("/ok?subject=test.created", "k1", "tenant-a"); c != http.StatusAccepted {
		t.Fatalf("first: %d", c)
	}
	if c := send("/ok?subject=test.created", "k1", "tenant-a"); c != http.StatusAccepted {
		t.Fatalf("replay: %d", c)
	}
	if c := send("/flaky?subject=test.created", "k2", ""); c != http.StatusServiceUnavailable {
		t.Fatalf("flaky: %d, want 503", c)
	}
	if c := send("/flaky?subject=test.created", "k2", ""); c != http.StatusAccepted {
		t.Fatalf("flaky retry: %d", c)
	}
	w := req{path: "/ok?subject=orders.created", key: key("k3"), body: `{}`}.send(h)
	if w.Code != http.StatusInternalServerError || !strings.Contains(w.Body.String(), "outside the stream's subjects") {
		t.Fatalf("out-of-stream subject: %d %s, want 500 naming the subjects", w.Code, w.Body)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 2 {
		t.Fatalf("outbox rows = %d, want 2 (k1 once despite the replay, k2 once despite the rollback)", n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = $1 AND subject = 'test.created' AND msg_id = $2 AND headers->>'X-Trace' = 't1'`,
		idem.ScopedKey("tenant-a", "k1"), idem.MsgID("test.created", idem.ScopedKey("tenant-a", "k1"))); n != 1 {
		t.Errorf("the message does not carry the scoped key, its Msg-Id and headers")
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_requests WHERE key = 'k3'`); n != 0 {
		t.Errorf("the request whose enqueue failed was stored")
	}
}

// After a request that enqueued commits, the middleware wakes the relays: a relay
// LISTENing in another process gets a NOTIFY, and finds the row committed when it
// does.
func TestMiddlewareWakesTheRelayAfterCommit(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	ctx := context.Background()
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	listener := conn.Hijack() // LISTENing: never back to the pool
	t.Cleanup(func() { listener.Close(context.Background()) })
	if _, err := listener.Exec(ctx, `LISTEN idem_outbox`); err != nil {
		t.Fatal(err)
	}
	h := newMiddleware(t, db.Pool, producer.Config{}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, _ := producer.IntentFrom(r.Context())
		if err := in.Enqueue(r.Context(), "test.created", []byte(`{}`), nil); err != nil {
			producer.WriteError(w, http.StatusInternalServerError, "enqueue_failed", err.Error())
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	if w := (req{path: "/ok", key: key("k-wake"), body: `{}`}).send(h); w.Code != http.StatusCreated {
		t.Fatalf("request: %d %s", w.Code, w.Body)
	}
	waitCtx, cancel := context.WithTimeout(ctx, 45*time.Second)
	defer cancel()
	n, err := listener.WaitForNotification(waitCtx)
	if err != nil {
		t.Fatalf("no NOTIFY after the request committed: %v", err)
	}
	if n.Channel != "idem_outbox" {
		t.Errorf("NOTIFY on %q", n.Channel)
	}
	if c := db.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL`); c != 1 {
		t.Errorf("%d pending rows when the NOTIFY arrived, want 1", c)
	}
}

// With idem's tables in another schema the middleware claims and stores there, and
// its outbox writes there too.
func TestMiddlewareInOtherSchema(t *testing.T) {
	t.Parallel()
	const schema = "idem_app"
	db := newDB(t, pgtest.Options{Schema: schema})
	h := newMiddleware(t, db.Pool, producer.Config{}, func(c *install.Config) { c.Schema = schema }).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, _ := producer.IntentFrom(r.Context())
		if err := in.Enqueue(r.Context(), "test.created", []byte(`{}`), nil); err != nil {
			producer.WriteError(w, http.StatusInternalServerError, "enqueue_failed", err.Error())
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	for i, want := range []string{"", "true"} {
		w := req{path: "/ok", key: key("k1"), body: `{}`}.send(h)
		if w.Code != http.StatusCreated || w.Header().Get(idem.HeaderReplayed) != want {
			t.Fatalf("request %d: %d replayed=%q body %s, want 201 replayed=%q", i+1, w.Code, w.Header().Get(idem.HeaderReplayed), w.Body, want)
		}
	}
	if n := db.Count(t, `SELECT count(*) FROM `+schema+`.idem_requests WHERE key = 'k1' AND status = 'done'`); n != 1 {
		t.Errorf("%s.idem_requests rows = %d, want 1", schema, n)
	}
	if n := db.Count(t, `SELECT count(*) FROM `+schema+`.idem_outbox`); n != 1 {
		t.Errorf("%s.idem_outbox rows = %d, want 1", schema, n)
	}
	if n := db.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE 'idem_%'`); n != 0 {
		t.Errorf("public holds %d idem tables, want none", n)
	}
}

// A cookie set by the first response is that client's credential: the first
// response carries it, a replay (which anyone with the same key and body gets) does
// not, and it is not stored.
func TestMiddlewareNeverReplaysSetCookie(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	h := newMiddleware(t, db.Pool, producer.Config{}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.SetCookie(w, &http.Cookie{Name: "session", Value: "secret-of-the-first-caller"})
		w.Header().Set("X-Kept", "yes")
		w.WriteHeader(http.StatusCreated)
	}))
	first := req{path: "/ok", key: key("k1"), body: "{}"}.send(h)
	if first.Code != http.StatusCreated || first.Header().Get("Set-Cookie") == "" {
		t.Fatalf("first response: %d, Set-Cookie %q; want the cookie", first.Code, first.Header().Get("Set-Cookie"))
	}
	replay := req{path: "/ok", key: key("k1"), body: "{}"}.send(h)
	if replay.Header().Get(idem.HeaderReplayed) != "true" || replay.Header().Get("X-Kept") != "yes" {
		t.Fatalf("replay: %v", replay.Header())
	}
	if c := replay.Header().Get("Set-Cookie"); c != "" {
		t.Errorf("the replay carries the first caller's cookie: %q", c)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_requests WHERE response_headers::text LIKE '%secret-of-the-first-caller%'`); n != 0 {
		t.Errorf("the cookie is stored in %d records", n)
	}
}

// Beyond MaxInFlight a request is refused with 503 and Retry-After before it takes
// a connection, and claims nothing: its retry with the same key executes later.
func TestMiddlewareMaxInFlight(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	entered, release := make(chan struct{}), make(chan struct{})
	var got outcomes
	h := newMiddleware(t, db.Pool, producer.Config{MaxInFlight: 1}, observedBy(got.observe)).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			entered <- struct{}{}
			<-release
		}
		w.WriteHeader(http.StatusCreated)
	}))
	done := make(chan int, 1)
	go func() { done <- req{path: "/slow", key: key("k-slow"), body: "{}"}.send(h).Code }()
	recv(t, entered, "the first request to enter its handler")
	busy := req{path: "/fast", key: key("k-fast"), body: "{}"}.send(h)
	if busy.Code != http.StatusServiceUnavailable || busy.Header().Get("Retry-After") == "" || errCode(t, busy) != "too_many_requests_in_flight" {
		t.Fatalf("beyond MaxInFlight: %d %q Retry-After=%q", busy.Code, busy.Body.String(), busy.Header().Get("Retry-After"))
	}
	close(release)
	if code := recv(t, done, "the first request"); code != http.StatusCreated {
		t.Fatalf("first request: %d", code)
	}
	if again := (req{path: "/fast", key: key("k-fast"), body: "{}"}).send(h); again.Code != http.StatusCreated || again.Header().Get(idem.HeaderReplayed) != "" {
		t.Fatalf("retry after the refusal: %d replayed=%q, want a fresh execution", again.Code, again.Header().Get(idem.HeaderReplayed))
	}
	if got.last() != idem.OutcomeNew {
		t.Errorf("last outcome %q", got.last())
	}

}

// A request beyond MaxInFlight waits up to MaxInFlightWait for a slot, holding no
// connection, and gets its 503 only then; a slot that frees meanwhile lets it in.
func TestMiddlewareWaitsForASlot(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	const wait = 300 * time.Millisecond
	entered, release := make(chan struct{}, 1), make(chan struct{})
	h := newMiddleware(t, db.Pool, producer.Config{MaxInFlight: 1, MaxInFlightWait: wait}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			entered <- struct{}{}
			<-release
		}
		w.WriteHeader(http.StatusCreated)
	}))
	done := make(chan int, 1)
	go func() { done <- req{path: "/slow", key: key("k-slow"), body: "{}"}.send(h).Code }()
	recv(t, entered, "the slow request to enter its handler")

	start := time.Now()
	busy := req{path: "/fast", key: key("k-refused"), body: "{}"}.send(h)
	if waited := time.Since(start); busy.Code != http.StatusServiceUnavailable || waited < wait {
		t.Fatalf("with the only slot held: %d after %v, want 503 after at least %v", busy.Code, waited, wait)
	}

	queued := make(chan int, 1)
	go func() { queued <- req{path: "/fast", key: key("k-queued"), body: "{}"}.send(h).Code }()
	close(release)
	if code := recv(t, queued, "the queued request"); code != http.StatusCreated {
		t.Errorf("a request behind a slot that frees: %d, want 201", code)
	}
	if code := recv(t, done, "the slow request"); code != http.StatusCreated {
		t.Errorf("slow request: %d", code)
	}
}

// An intent that sends several messages on one subject names each: the outbox
// keeps the names, and each gets its own Msg-Id.
func TestIntentEnqueuesNamedMessages(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	h := newMiddleware(t, db.Pool, producer.Config{}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, ok := producer.IntentFrom(r.Context())
		if !ok {
			producer.WriteError(w, http.StatusInternalServerError, "no_intent", "no intent")
			return
		}
		for _, name := range []string{"line-1", "line-2"} {
			if err := in.EnqueueMessage(r.Context(), idem.Message{Subject: "test.lines", Name: name, Payload: []byte(`{}`)}); err != nil {
				producer.WriteError(w, http.StatusInternalServerError, "enqueue_failed", err.Error())
				return
			}
		}
		w.WriteHeader(http.StatusCreated)
	}))
	if w := (req{path: "/lines", key: key("k-lines"), body: `{}`}).send(h); w.Code != http.StatusCreated {
		t.Fatalf("request: %d %s", w.Code, w.Body)
	}
	if n := db.Count(t, `SELECT count(DISTINCT msg_id) FROM idem_outbox WHERE key = 'k-lines' AND message_name IN ('line-1', 'line-2')`); n != 2 {
		t.Errorf("named rows with distinct Msg-Ids = %d, want 2", n)
	}
}
