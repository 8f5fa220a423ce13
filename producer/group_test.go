package producer_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/producer"
)

// groupApp is the handler of the group-commit tests. Every POST writes one
// test_writes row through the intent's transaction; the row's tx column is
// txid_current(), the top-level transaction even inside a savepoint, so counting
// distinct tx values counts commits. Then, by path:
//
//	/ok       enqueues a message, 201 with the write's id
//	/fail     500 (rolled back)
//	/panic    panics (rolled back)
//	/orphan   also writes a row that breaks a deferred foreign key: COMMIT fails
//	/block    as /ok, but first signals gate(name).entered and waits for its release
//	          (?gate=name)
//
// ?quiet=1 enqueues nothing (no relay wake before the response).
type groupApp struct {
	calls atomic.Int64
	stop  chan struct{}
	mu    sync.Mutex
	gates map[string]*gate
}

type gate struct{ entered, release chan struct{} }

func newGroupApp(t *testing.T) *groupApp {
	a := &groupApp{stop: make(chan struct{}), gates: map[string]*gate{}}
	t.Cleanup(func() { close(a.stop) })
	return a
}

func (a *groupApp) gate(name string) *gate {
	a.mu.Lock()
	defer a.mu.Unlock()
	g := a.gates[name]
	if g == nil {
		g = &gate{entered: make(chan struct{}, 64), release: make(chan struct{})} // room for every request of a test
		a.gates[name] = g
	}
	return g
}

func (a *groupApp) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.calls.Add(1)
	ctx := r.Context()
	in, ok := producer.IntentFrom(ctx)
	if !ok {
		http.Error(w, "no intent", http.StatusInternalServerError)
		return
	}
	var id int64
	if err := in.Tx.QueryRow(ctx, `INSERT INTO test_writes (key) VALUES ($1) RETURNING id`, in.ScopedKey()).Scan(&id); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	switch r.URL.Path {
	case "/fail":
		http.Error(w, "failed", http.StatusInternalServerError)
		return
	case "/panic":
		panic("boom")
	case "/orphan":
		if _, err := in.Tx.Exec(ctx, `INSERT INTO test_child (parent) VALUES (42)`); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
	case "/block":
		g := a.gate(r.URL.Query().Get("gate"))
		g.entered <- struct{}{}
		select {
		case <-g.release:
		case <-a.stop:
			http.Error(w, "test over", http.StatusServiceUnavailable)
			return
		}
	}
	if r.URL.Query().Get("quiet") == "" {
		if err := in.Enqueue(ctx, "test.created", []byte(`{}`), nil); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	body, _ := json.Marshal(map[string]any{"write_id": id, "key": in.ScopedKey()})
	_, _ = w.Write(body)
}

// newGroupDB is newDB plus what the group tests measure: the transaction of every
// write, and a deferred foreign key for /orphan.
func newGroupDB(t *testing.T) *pgtest.DB {
	t.Helper()
	db := newDB(t, pgtest.Options{})
	if _, err := db.Pool.Exec(context.Background(), `
ALTER TABLE test_writes ADD COLUMN tx bigint NOT NULL DEFAULT txid_current();
CREATE TABLE test_parent (id int PRIMARY KEY);
CREATE TABLE test_child (parent int REFERENCES test_parent DEFERRABLE INITIALLY DEFERRED)`); err != nil {
		t.Fatal(err)
	}
	return db
}

// sendAsync sends q in a goroutine; the response arrives on the channel.
func sendAsync(h http.Handler, q req) <-chan *httptest.ResponseRecorder {
	ch := make(chan *httptest.ResponseRecorder, 1)
	go func() { ch <- q.send(h) }()
	return ch
}

// formGroup makes lead and rest one group, deterministically: lead (a /block
// request on gate "lead") holds the group's connection in its handler until every
// other request has joined the group, then is released. It returns the responses,
// lead's first.
func formGroup(t *testing.T, mw *producer.Middleware, app *groupApp, lead req, rest ...req) []*httptest.ResponseRecorder {
	t.Helper()
	h := mw.Wrap(app)
	g := app.gate("lead")
	chans := []<-chan *httptest.ResponseRecorder{sendAsync(h, lead)}
	recv(t, g.entered, "the lead to enter its handler")
	for _, q := range rest {
		chans = append(chans, sendAsync(h, q))
	}
	waitFor(t, "every request to join the lead's group", func() bool { return producer.NewestGroupJoined(mw) == 1+len(rest) })
	close(g.release)
	var out []*httptest.ResponseRecorder
	for i, ch := range chans {
		out = append(out, recv(t, ch, "response "+string(rune('0'+i))))
	}
	return out
}

func leadReq(k string) req { return req{path: "/block?gate=lead", key: key(k), body: `{}`} }

func okReq(k string) req { return req{path: "/ok", key: key(k), body: `{}`} }

// recvWithin receives from ch within d: the bound on a group that must not stall.
func recvWithin[T any](t *testing.T, ch <-chan T, d time.Duration, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(d):
		t.Fatalf("%s did not come within %v", what, d)
		panic("unreachable")
	}
}

// Concurrent requests in one group: each gets its own fresh, stored response and
// business row and outbox message, the Observer hears one "new" per request, and
// they all committed in one transaction. MaxRequests bounds every group.
func TestGroupCommitSharesOneCommit(t *testing.T) {
	t.Parallel()
	db := newGroupDB(t)
	app := newGroupApp(t)
	var got outcomes
	mw := newMiddleware(t, db.Pool, producer.Config{GroupCommit: producer.GroupCommit{MaxRequests: 16}, Observer: got.observe})

	const n = 10
	rest := make([]req, 0, n-1)
	for i := 1; i < n; i++ {
		rest = append(rest, okReq("g"+string(rune('a'+i))))
	}
	ws := formGroup(t, mw, app, leadReq("ga"), rest...)
	bodies := map[string]bool{}
	for i, w := range ws {
		if w.Code != http.StatusCreated || w.Header().Get(idem.HeaderReplayed) != "" {
			t.Fatalf("request %d: %d replayed=%q %s, want a fresh 201", i, w.Code, w.Header().Get(idem.HeaderReplayed), w.Body)
		}
		bodies[w.Body.String()] = true
	}
	if len(bodies) != n {
		t.Errorf("%d distinct bodies for %d requests", len(bodies), n)
	}
	if c := db.Count(t, `SELECT count(*) FROM test_writes`); c != n {
		t.Errorf("test_writes: %d rows, want %d", c, n)
	}
	if c := db.Count(t, `SELECT count(DISTINCT tx) FROM test_writes`); c != 1 {
		t.Errorf("the group's %d requests committed in %d transactions, want 1", n, c)
	}
	if c := db.Count(t, `SELECT count(*) FROM idem_requests WHERE status = 'done'`); c != n {
		t.Errorf("stored responses: %d, want %d", c, n)
	}
	if c := db.Count(t, `SELECT count(*) FROM idem_outbox`); c != n {
		t.Errorf("outbox rows: %d, want %d", c, n)
	}
	got.mu.Lock()
	for _, o := range got.list {
		if o != producer.OutcomeNew {
			t.Errorf("outcome %q, want new", o)
		}
	}
	if len(got.list) != n {
		t.Errorf("%d outcomes for %d requests", len(got.list), n)
	}
	got.mu.Unlock()

	// The same requests again replay, in groups or not, and execute nothing.
	h := mw.Wrap(app)
	var replays []<-chan *httptest.ResponseRecorder
	for _, q := range append([]req{leadReq("ga")}, rest...) {
		replays = append(replays, sendAsync(h, q))
	}
	for i, ch := range replays {
		if w := recv(t, ch, "a replay"); w.Code != http.StatusCreated || w.Header().Get(idem.HeaderReplayed) != "true" {
			t.Errorf("replay %d: %d replayed=%q", i, w.Code, w.Header().Get(idem.HeaderReplayed))
		}
	}
	if c := db.Count(t, `SELECT count(*) FROM test_writes`); c != n {
		t.Errorf("after the replays test_writes has %d rows, want %d", c, n)
	}

	// MaxRequests bounds a group: 12 requests, all held in their handlers, make
	// three groups of four, each with one member in its handler (holding the
	// group's connection) and three waiting for their turn.
	capMW := newMiddleware(t, db.Pool, producer.Config{GroupCommit: producer.GroupCommit{MaxRequests: 4}})
	capped := capMW.Wrap(app)
	var chans []<-chan *httptest.ResponseRecorder
	for i := range 12 {
		chans = append(chans, sendAsync(capped, req{path: "/block?gate=cap", key: key("c" + string(rune('a'+i))), body: `{}`}))
	}
	for range 3 {
		recv(t, app.gate("cap").entered, "a group's first member to enter its handler")
	}
	waitFor(t, "the third group to fill", func() bool { return producer.NewestGroupJoined(capMW) == 4 })
	close(app.gate("cap").release)
	for _, ch := range chans {
		if w := recv(t, ch, "a capped request"); w.Code != http.StatusCreated {
			t.Fatalf("capped: %d %s", w.Code, w.Body)
		}
	}
	if c := db.Count(t, `SELECT count(*) FROM (SELECT tx FROM test_writes WHERE key LIKE 'c%' GROUP BY tx HAVING count(*) = 4) groups`); c != 3 {
		t.Errorf("%d transactions of 4 requests, want 3 (MaxRequests = 4)", c)
	}
	if c := db.Count(t, `SELECT count(*) FROM test_writes WHERE key LIKE 'c%'`); c != 12 {
		t.Errorf("capped: %d rows, want 12", c)
	}
}

// A member whose handler fails (500, panic) is rolled back to its savepoint: its
// row and claim are gone, and the other members of its group commit. Its retry
// executes afresh.
func TestGroupCommitFailedMemberRollsBackAlone(t *testing.T) {
	t.Parallel()
	db := newGroupDB(t)
	app := newGroupApp(t)
	var got outcomes
	mw := newMiddleware(t, db.Pool, producer.Config{GroupCommit: producer.GroupCommit{MaxRequests: 8}, Observer: got.observe})
	ws := formGroup(t, mw, app, leadReq("k0"),
		okReq("k1"),
		req{path: "/fail", key: key("k2"), body: `{}`},
		okReq("k3"),
		req{path: "/panic", key: key("k4"), body: `{}`},
		okReq("k5"))
	want := []int{201, 201, 500, 201, 500, 201}
	for i, w := range ws {
		if w.Code != want[i] {
			t.Errorf("k%d: %d %s, want %d", i, w.Code, w.Body, want[i])
		}
	}
	if c := db.Count(t, `SELECT count(*) FROM test_writes WHERE key IN ('k0', 'k1', 'k3', 'k5')`); c != 4 {
		t.Errorf("the members that succeeded have %d rows, want 4", c)
	}
	if c := db.Count(t, `SELECT count(DISTINCT tx) FROM test_writes`); c != 1 {
		t.Errorf("%d transactions, want the group's 1", c)
	}
	if c := db.Count(t, `SELECT count(*) FROM test_writes WHERE key IN ('k2', 'k4')`); c != 0 {
		t.Errorf("the failed members left %d rows", c)
	}
	if c := db.Count(t, `SELECT count(*) FROM idem_requests WHERE key IN ('k2', 'k4')`); c != 0 {
		t.Errorf("the failed members left %d claims", c)
	}
	if c := db.Count(t, `SELECT count(*) FROM idem_outbox`); c != 4 {
		t.Errorf("outbox rows: %d, want 4", c)
	}
	if w := okReq("k2").send(mw.Wrap(app)); w.Code != http.StatusCreated || w.Header().Get(idem.HeaderReplayed) != "" {
		t.Errorf("retry of the failed member: %d replayed=%q, want a fresh 201", w.Code, w.Header().Get(idem.HeaderReplayed))
	}
	if got.len() != 7 {
		t.Errorf("%d outcomes, want 7", got.len())
	}
}

// A concurrent duplicate neither stalls a group nor executes twice. In the same
// group it is ejected before it claims (in the group's transaction it would find
// its twin's uncommitted record); in another group its claim times out at once and
// it is ejected; either way it then waits alone, as a lock waiter, and replays.
func TestGroupCommitDuplicates(t *testing.T) {
	t.Parallel()
	t.Run("same group", func(t *testing.T) {
		t.Parallel()
		db := newGroupDB(t)
		app := newGroupApp(t)
		mw := newMiddleware(t, db.Pool, producer.Config{Wait: time.Minute, GroupCommit: producer.GroupCommit{MaxRequests: 8}})
		h := mw.Wrap(app)
		first := sendAsync(h, leadReq("kd"))
		recv(t, app.gate("lead").entered, "the first to enter its handler") // kd is claimed, uncommitted
		dup := sendAsync(h, leadReq("kd"))
		waitFor(t, "the duplicate to wait alone on the first's claim", func() bool { return lockWaiters(t, db) == 1 })
		if j := producer.NewestGroupJoined(mw); j != 1 {
			t.Errorf("the group has %d members, want the first alone", j)
		}
		close(app.gate("lead").release)
		w1, w2 := recv(t, first, "the first response"), recv(t, dup, "the duplicate's response")
		if w1.Code != http.StatusCreated || w2.Code != http.StatusCreated || w2.Header().Get(idem.HeaderReplayed) != "true" || w2.Body.String() != w1.Body.String() {
			t.Fatalf("first %d %s; duplicate %d replayed=%q %s: want the first's answer replayed", w1.Code, w1.Body, w2.Code, w2.Header().Get(idem.HeaderReplayed), w2.Body)
		}
		if c := db.Count(t, `SELECT count(*) FROM test_writes`); c != 1 || app.calls.Load() != 1 {
			t.Errorf("%d rows, %d executions, want 1", c, app.calls.Load())
		}
	})
	t.Run("across groups", func(t *testing.T) {
		t.Parallel()
		db := newGroupDB(t)
		app := newGroupApp(t)
		const wait = time.Minute // a duplicate that stalled its group would hold it this long
		mw := newMiddleware(t, db.Pool, producer.Config{Wait: wait, GroupCommit: producer.GroupCommit{MaxRequests: 2}})
		h := mw.Wrap(app)
		// Group A: kd, which holds its claim uncommitted, and a filler that fills A.
		a1 := sendAsync(h, req{path: "/block?gate=a", key: key("kd"), body: `{}`})
		recv(t, app.gate("a").entered, "kd to enter its handler")
		a2 := sendAsync(h, okReq("kf"))
		waitFor(t, "group A to fill", func() bool { return producer.NewestGroupJoined(mw) == 2 })
		// Group B: kb first, holding B's connection, then the duplicate of kd.
		b1 := sendAsync(h, req{path: "/block?gate=b", key: key("kb"), body: `{}`})
		recv(t, app.gate("b").entered, "kb to enter its handler")
		b2 := sendAsync(h, req{path: "/block?gate=a", key: key("kd"), body: `{}`})
		waitFor(t, "the duplicate to join group B", func() bool { return producer.NewestGroupJoined(mw) == 2 })
		close(app.gate("b").release)
		// B commits while A, and with it kd, is still open.
		if w := recvWithin(t, b1, 10*time.Second, "group B's commit (kb's response)"); w.Code != http.StatusCreated {
			t.Fatalf("kb: %d %s", w.Code, w.Body)
		}
		waitFor(t, "the duplicate to wait alone on kd's claim", func() bool { return lockWaiters(t, db) == 1 })
		close(app.gate("a").release)
		w1, wf, w2 := recv(t, a1, "kd's response"), recv(t, a2, "kf's response"), recv(t, b2, "the duplicate's response")
		if w1.Code != http.StatusCreated || wf.Code != http.StatusCreated {
			t.Fatalf("group A: %d, %d", w1.Code, wf.Code)
		}
		if w2.Code != http.StatusCreated || w2.Header().Get(idem.HeaderReplayed) != "true" || w2.Body.String() != w1.Body.String() {
			t.Fatalf("duplicate: %d replayed=%q %s, want kd's answer replayed", w2.Code, w2.Header().Get(idem.HeaderReplayed), w2.Body)
		}
		if c := db.Count(t, `SELECT count(*) FROM test_writes WHERE key = 'kd'`); c != 1 {
			t.Errorf("kd executed %d times", c)
		}
	})
}

// When the group's COMMIT fails, no member gets a 2xx and nothing is stored: the
// members answer as their own failed commit would have, and their retries execute.
func TestGroupCommitFailedCommitAnswersNoMember(t *testing.T) {
	t.Parallel()
	db := newGroupDB(t)
	app := newGroupApp(t)
	var got outcomes
	mw := newMiddleware(t, db.Pool, producer.Config{GroupCommit: producer.GroupCommit{MaxRequests: 8}, Observer: got.observe})
	ws := formGroup(t, mw, app, leadReq("k0"), okReq("k1"), req{path: "/orphan", key: key("k2"), body: `{}`}, okReq("k3"))
	for i, w := range ws {
		if w.Code != http.StatusInternalServerError || errCode(t, w) != "internal_error" {
			t.Errorf("k%d: %d %s, want 500 internal_error", i, w.Code, w.Body)
		}
	}
	for _, table := range []string{"test_writes", "idem_requests", "idem_outbox", "test_child"} {
		if c := db.Count(t, `SELECT count(*) FROM `+table); c != 0 {
			t.Errorf("%s: %d rows after the failed commit", table, c)
		}
	}
	got.mu.Lock()
	for _, o := range got.list {
		if o != producer.OutcomeUnavailable {
			t.Errorf("outcome %q, want unavailable", o)
		}
	}
	got.mu.Unlock()
	if w := okReq("k1").send(mw.Wrap(app)); w.Code != http.StatusCreated || w.Header().Get(idem.HeaderReplayed) != "" {
		t.Errorf("retry: %d replayed=%q, want a fresh 201", w.Code, w.Header().Get(idem.HeaderReplayed))
	}
}

// committedAtWrite is a ResponseWriter that, when the status is written, looks from
// another connection for the request's stored record.
type committedAtWrite struct {
	*httptest.ResponseRecorder
	db    *pgtest.DB
	key   string
	saw   int
	err   error
	wrote bool
}

func (c *committedAtWrite) WriteHeader(code int) {
	if !c.wrote {
		c.wrote = true
		c.err = c.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_requests WHERE key = $1 AND status = 'done'`, c.key).Scan(&c.saw)
	}
	c.ResponseRecorder.WriteHeader(code)
}

// A member's response is written only after the group's COMMIT: at the moment
// its status goes out, its record is visible from another connection, even for
// the lead, which finished long before the group's last member (held in its
// handler).
func TestGroupCommitRespondsAfterCommit(t *testing.T) {
	t.Parallel()
	db := newGroupDB(t)
	app := newGroupApp(t)
	mw := newMiddleware(t, db.Pool, producer.Config{GroupCommit: producer.GroupCommit{MaxRequests: 8}})
	h := mw.Wrap(app)
	// Open a few connections first, so that the check at the status does not
	// wait for one to be set up: it must be quick to see a response that would
	// go out before the COMMIT.
	var conns []*pgxpool.Conn
	for range 4 {
		c, err := db.Pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	send := func(q req) (<-chan struct{}, *committedAtWrite) {
		cw := &committedAtWrite{ResponseRecorder: httptest.NewRecorder(), db: db, key: *q.key}
		done := make(chan struct{})
		go func() {
			defer close(done)
			r := httptest.NewRequest(http.MethodPost, q.path, strings.NewReader(q.body))
			r.Header.Set(idem.HeaderKey, *q.key)
			h.ServeHTTP(cw, r)
		}()
		return done, cw
	}
	leadDone, lead := send(req{path: "/block?gate=lead&quiet=1", key: key("k0"), body: `{}`})
	recv(t, app.gate("lead").entered, "the lead to enter its handler")
	lastDone, last := send(req{path: "/block?gate=last", key: key("k1"), body: `{}`})
	waitFor(t, "the last member to join", func() bool { return producer.NewestGroupJoined(mw) == 2 })
	close(app.gate("lead").release)
	// The lead has stored its response and passed the connection on; the group
	// stays open while the last member runs.
	recv(t, app.gate("last").entered, "the last member to enter its handler")
	close(app.gate("last").release)
	recv(t, leadDone, "the lead's response")
	recv(t, lastDone, "the last member's response")
	for _, cw := range []*committedAtWrite{lead, last} {
		if cw.err != nil {
			t.Fatal(cw.err)
		}
		if cw.Code != http.StatusCreated || cw.saw != 1 {
			t.Errorf("%s: %d, with %d committed records when its status was written, want 201 after 1", cw.key, cw.Code, cw.saw)
		}
	}
}

// Many copies of one request among many other requests, all at once through
// group commit: the duplicated key executes once and every copy gets its answer;
// every other request executes once.
func TestGroupCommitManyDuplicatesAtOnce(t *testing.T) {
	t.Parallel()
	db := newGroupDB(t)
	app := newGroupApp(t)
	h := newMiddleware(t, db.Pool, producer.Config{Wait: 20 * time.Second, GroupCommit: producer.GroupCommit{MaxRequests: 8}}).Wrap(app)
	var dups, others []<-chan *httptest.ResponseRecorder
	for i := range 40 {
		dups = append(dups, sendAsync(h, okReq("dup")))
		others = append(others, sendAsync(h, okReq("other-"+strings.Repeat("x", i+1))))
	}
	var first string
	for _, ch := range dups {
		w := recv(t, ch, "a copy's response")
		if w.Code != http.StatusCreated {
			t.Fatalf("copy: %d %s", w.Code, w.Body)
		}
		if first == "" {
			first = w.Body.String()
		} else if w.Body.String() != first {
			t.Errorf("copies answered differently: %s and %s", first, w.Body)
		}
	}
	for _, ch := range others {
		if w := recv(t, ch, "another request's response"); w.Code != http.StatusCreated {
			t.Fatalf("other: %d %s", w.Code, w.Body)
		}
	}
	if c := db.Count(t, `SELECT count(*) FROM test_writes WHERE key = 'dup'`); c != 1 {
		t.Errorf("the duplicated key executed %d times", c)
	}
	if c := db.Count(t, `SELECT count(*) FROM test_writes`); c != 41 {
		t.Errorf("%d executions, want 41", c)
	}
}

func TestGroupCommitConfig(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	for _, g := range []producer.GroupCommit{
		{MaxRequests: -1},
		{MaxRequests: producer.MaxGroupRequests + 1},
		{MaxRequests: 4, MaxWait: -time.Millisecond},
	} {
		if _, err := producer.NewMiddleware(db.Pool, producer.Config{GroupCommit: g}); err == nil {
			t.Errorf("%+v accepted", g)
		}
	}
	if c := newMiddleware(t, db.Pool, producer.Config{}).Config(); c.GroupCommit != (producer.GroupCommit{}) {
		t.Errorf("group commit is on by default: %+v", c.GroupCommit)
	}
}

// With idem's tables in another schema, group commit claims, stores and enqueues
// there.
func TestGroupCommitInOtherSchema(t *testing.T) {
	t.Parallel()
	const schema = "idem_app"
	db := newDB(t, pgtest.Options{Schema: schema})
	app := newGroupApp(t)
	mw := newMiddleware(t, db.Pool, producer.Config{Schema: schema, GroupCommit: producer.GroupCommit{MaxRequests: 4}})
	for i, w := range formGroup(t, mw, app, leadReq("k0"), okReq("k1"), okReq("k2")) {
		if w.Code != http.StatusCreated {
			t.Fatalf("k%d: %d %s", i, w.Code, w.Body)
		}
	}
	if c := db.Count(t, `SELECT count(*) FROM `+schema+`.idem_requests WHERE status = 'done'`); c != 3 {
		t.Errorf("%s.idem_requests: %d done, want 3", schema, c)
	}
	if c := db.Count(t, `SELECT count(*) FROM `+schema+`.idem_outbox`); c != 3 {
		t.Errorf("%s.idem_outbox: %d rows, want 3", schema, c)
	}
}

// A grouped claim runs under a 1 ms lock_timeout, but the handler gets Wait back:
// after a fresh claim, and after a claim that replaced an expired record.
func TestGroupCommitHandlerGetsWait(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	h := newMiddleware(t, db.Pool, producer.Config{Wait: 20 * time.Second, GroupCommit: producer.GroupCommit{MaxRequests: 4}}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, _ := producer.IntentFrom(r.Context())
		var lt string
		if err := in.Tx.QueryRow(r.Context(), `SELECT current_setting('lock_timeout')`).Scan(&lt); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		_, _ = w.Write([]byte(lt))
	}))
	if w := (req{path: "/ok", key: key("k1"), body: `{"a":1}`}).send(h); w.Code != http.StatusOK || w.Body.String() != "20s" {
		t.Fatalf("fresh claim: %d, the handler saw lock_timeout %q, want 20s", w.Code, w.Body)
	}
	if _, err := db.Pool.Exec(context.Background(), `UPDATE idem_requests SET expires_at = now() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	w := req{path: "/ok", key: key("k1"), body: `{"a":2}`}.send(h)
	if w.Code != http.StatusOK || w.Header().Get(idem.HeaderReplayed) != "" || w.Body.String() != "20s" {
		t.Fatalf("claim after expiry: %d replayed=%q, the handler saw lock_timeout %q, want a fresh 200 with 20s", w.Code, w.Header().Get(idem.HeaderReplayed), w.Body)
	}
}
