// Package paypage_test drives the reference application's payment page (GET /pay,
// the browser client behind a Pay button) in headless Chromium against a real
// worker on a real Postgres and JetStream, and counts ledger_entries rows: one per
// intent however the request is lost, repeated or restored, and two when the
// journal is wiped (the negative control).
//
// Without Chromium the test skips, unless IDEM_REQUIRE_BROWSER=1 (CI), where it
// fails.
package paypage_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/inspector"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/app/refapp"
	"github.com/idemkit/idem/internal/app/refapptest"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/test/internal/browsertest"
)

// stepTimeout bounds one wait in the browser.
const stepTimeout = 30 * time.Second

// gate holds fresh executions at the ingress after their commit, before their
// response is written: the request is in flight, its effect decided, its answer
// not yet on the wire.
type gate struct {
	mu      sync.Mutex
	holding bool
	held    []string
	open    chan struct{}
}

// arm holds every fresh execution from now until release.
func (g *gate) arm() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.holding, g.held, g.open = true, nil, make(chan struct{})
}

// release lets the held requests answer, and holds no more.
func (g *gate) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.holding {
		g.holding = false
		close(g.open)
	}
}

// keys are the keys held since arm.
func (g *gate) keys() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.held)
}

func (g *gate) hit(ctx context.Context, keys []string) error {
	g.mu.Lock()
	if !g.holding {
		g.mu.Unlock()
		return nil
	}
	g.held = append(g.held, keys...)
	open := g.open
	g.mu.Unlock()
	select {
	case <-open:
		return nil
	case <-ctx.Done(): // the page went away: its connection is gone
		return ctx.Err()
	}
}

// world is one worker serving the page, and one browser.
type world struct {
	t       *testing.T
	env     *testenv.Env
	base    string
	gate    *gate
	browser context.Context
}

// profile is one browser profile (a BrowserContext): its own IndexedDB and locks.
type profile struct {
	w    *world
	root context.Context
}

// tab is one page of a profile.
type tab struct {
	p      *profile
	ctx    context.Context
	cancel context.CancelFunc
}

// row is one intent as the page shows it (the data- attributes of its row).
type row struct {
	Key        string `json:"key"`
	Status     string `json:"status"`
	Attempts   string `json:"attempts"`
	HTTPStatus string `json:"httpStatus"`
	Replayed   string `json:"replayed"`
	Event      string `json:"event"`
	Ledger     string `json:"ledger"`
}

func TestPayPage(t *testing.T) {
	t.Parallel()
	bctx := browsertest.New(t) // first: skip before starting anything
	env := testenv.New(t)
	g := &gate{}
	ctx := faults.With(context.Background(), faults.New().Func(faults.IngressAfterCommit, g.hit))
	svc := refapptest.StartContext(t, ctx, env.DB.Pool, env.NC, refapp.Config{
		HTTPAddr: "127.0.0.1:0",
		PayPage:  true,
		Charges:  consumer.Config{AckWait: 5 * time.Second},
	})
	t.Cleanup(g.release) // before the shutdown, which a held request would hold up
	w := &world{t: t, env: env, base: "http://" + svc.Addr(), gate: g, browser: bctx}
	start := time.Now()
	defer func() { t.Logf("seven scenarios in %v", time.Since(start).Round(time.Millisecond)) }()

	t.Run("response dropped, automatic retry: one row", func(t *testing.T) {
		w.t = t
		p := w.profile()
		tb := p.open()
		tb.pay("acct_drop", "#net-drop")
		r := tb.waitRow("the intent done", func(r row) bool { return r.Status == "done" })
		if r.Attempts != "2" || r.Replayed != "true" || r.HTTPStatus != "202" {
			t.Errorf("intent %+v: want 2 attempts and the server's replay of its 202", r)
		}
		w.expectLedger("acct_drop", r.Key)
		tb.waitRow("the page showing the ledger row", func(r row) bool { return r.Ledger == "1" })
		// Everything the page loaded came from the worker itself.
		if others := tb.eval(`performance.getEntriesByType("resource").map(e => e.name).filter(u => !u.startsWith(location.origin + "/")).join(" ")`); others != "" {
			t.Errorf("the page loaded from elsewhere: %s", others)
		}
	})

	t.Run("page reloaded while the request is in flight: one row, same key", func(t *testing.T) {
		w.t = t
		g.arm()
		defer g.release()
		tb := w.profile().open()
		tb.pay("acct_reload", "")
		key := w.heldKey()
		tb.waitRow("the intent in flight", func(r row) bool { return r.Key == key && r.Status == "pending" })
		tb.do("reload", chromedp.Reload(), chromedp.WaitReady(chromedp.CSS(`body[data-ready=true]`)))
		r := tb.waitRow("the reloaded page finishing it", func(r row) bool { return r.Key == key && r.Status == "done" })
		if r.Attempts != "2" || r.Replayed != "true" {
			t.Errorf("intent %+v: want the reloaded page's second attempt answered by the server's replay", r)
		}
		g.release()
		w.expectLedger("acct_reload", key)
	})

	t.Run("tab crashed mid-request and opened again: one row", func(t *testing.T) {
		w.t = t
		g.arm()
		defer g.release()
		p := w.profile()
		first := p.open()
		first.pay("acct_crash", "")
		key := w.heldKey()
		first.crash()
		second := p.open()
		r := second.waitRow("the reopened tab finishing it", func(r row) bool { return r.Key == key && r.Status == "done" })
		if r.Attempts != "2" || r.Replayed != "true" {
			t.Errorf("intent %+v: want the reopened tab's second attempt answered by the server's replay", r)
		}
		g.release()
		w.expectLedger("acct_crash", key)
	})

	t.Run("offline at the press, online later: one row", func(t *testing.T) {
		w.t = t
		tb := w.profile().open()
		tb.offline(true)
		tb.pay("acct_offline", "")
		r := tb.waitRow("the intent waiting for the network", func(r row) bool { return r.Event == "offline" })
		if r.Status != "pending" || r.Attempts != "0" {
			t.Errorf("intent %+v: want it pending with no attempt spent while offline", r)
		}
		key := r.Key
		tb.offline(false)
		r = tb.waitRow("the intent sent once back online", func(r row) bool { return r.Key == key && r.Status == "done" })
		if r.Attempts != "1" {
			t.Errorf("intent %+v: want one attempt", r)
		}
		w.expectLedger("acct_offline", key)
	})

	t.Run("two tabs restored from one page state: one row, one request", func(t *testing.T) {
		w.t = t
		p := w.profile()
		// The page state: an intent pending in the profile's journal, its tab gone.
		a := p.open()
		a.offline(true)
		a.pay("acct_tabs", "")
		key := a.waitRow("the intent pending", func(r row) bool { return r.Event == "offline" }).Key
		a.close()
		before := w.requests()
		g.arm()
		defer g.release()
		b, c := p.open(), p.open()
		// One tab sends the intent (held at the server); the other must not.
		if got := w.heldKey(); got != key {
			t.Fatalf("held %s, want the journaled %s", got, key)
		}
		for _, tb := range []*tab{b, c} {
			tb.waitRow("both tabs taking the intent up", func(r row) bool {
				return r.Key == key && (r.Event == "sending" || r.Event == "waiting" || r.Event == "finished")
			})
		}
		g.release()
		for _, tb := range []*tab{b, c} {
			r := tb.waitRow("both tabs seeing it done", func(r row) bool { return r.Key == key && r.Status == "done" })
			if r.Attempts != "1" {
				t.Errorf("intent %+v: want one attempt between the two tabs", r)
			}
		}
		if n := w.requests() - before; n != 1 {
			t.Errorf("the server got %d requests for the intent, want 1: both tabs sent it", n)
		}
		w.expectLedger("acct_tabs", key)
	})

	t.Run("two presses: two rows, two keys", func(t *testing.T) {
		w.t = t
		p := w.profile()
		a, b := p.open(), p.open()
		a.pay("acct_twice", "")
		b.pay("acct_twice", "")
		done := func(rs []row) bool {
			return len(rs) == 2 && rs[0].Status == "done" && rs[1].Status == "done"
		}
		rows := a.waitRows("both presses done", done)
		b.waitRows("both presses done, in the other tab too", done)
		if rows[0].Key == rows[1].Key || rows[0].Attempts != "1" || rows[1].Attempts != "1" {
			t.Errorf("intents %+v: want two keys, one per press, each sent once", rows)
		}
		w.expectLedger("acct_twice", rows[0].Key, rows[1].Key)
	})

	t.Run("journal wiped before the retry (negative control): two rows", func(t *testing.T) {
		w.t = t
		tb := w.profile().open()
		tb.pay("acct_wiped", "#net-hold")
		first := tb.waitRow("the intent in flight", func(r row) bool { return r.Status == "pending" }).Key
		tb.do("the held response", chromedp.WaitVisible(chromedp.CSS(`#held li[data-key="`+first+`"]`)))
		tb.do("wipe the journal", chromedp.Click(chromedp.ID("wipe")))
		tb.waitRows("the journal empty", func(rs []row) bool { return len(rs) == 0 })
		tb.do("drop the held response", chromedp.Click(chromedp.CSS(`#held li[data-key="`+first+`"] button.drop`)))
		tb.do("the intent reported lost", chromedp.WaitVisible(chromedp.CSS(`#lost li[data-key="`+first+`"]`)))
		tb.pay("acct_wiped", "#net-deliver")
		second := tb.waitRow("the press after the wipe done", func(r row) bool { return r.Status == "done" }).Key
		if second == first {
			t.Fatalf("the press after the wipe reused %s", first)
		}
		w.expectLedger("acct_wiped", first, second)
		tb.do("the page counting two rows", chromedp.WaitVisible(chromedp.CSS(`#account-ledger[data-rows="2"]`)))
	})
}

// profile opens a fresh browser profile.
func (w *world) profile() *profile {
	w.t.Helper()
	root, cancel := chromedp.NewContext(w.browser, chromedp.WithNewBrowserContext())
	w.t.Cleanup(cancel)
	if err := chromedp.Do(root); err != nil {
		w.t.Fatalf("new browser context: %v", err)
	}
	return &profile{w: w, root: root}
}

// open opens the page in a new tab of p.
func (p *profile) open() *tab {
	p.w.t.Helper()
	ctx, cancel := chromedp.NewContext(p.root)
	p.w.t.Cleanup(cancel)
	// The first run makes the tab, which lives as long as the context of that run:
	// so not a bounded one.
	if err := chromedp.Do(ctx); err != nil {
		p.w.t.Fatalf("new tab: %v", err)
	}
	tb := &tab{p: p, ctx: ctx, cancel: cancel}
	tb.do("open "+refapp.PayPagePath, chromedp.Navigate(p.w.base+refapp.PayPagePath), chromedp.WaitReady(chromedp.CSS(`body[data-ready=true]`)))
	return tb
}

// do runs browser steps, bounded.
func (tb *tab) do(what string, steps ...chromedp.Action[chromedp.Void]) {
	tb.p.w.t.Helper()
	ctx, cancel := context.WithTimeout(tb.ctx, stepTimeout)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		tb.p.w.t.Fatalf("%s: %v", what, err)
	}
}

func (tb *tab) eval(js string) string {
	tb.p.w.t.Helper()
	ctx, cancel := context.WithTimeout(tb.ctx, stepTimeout)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[string](js))
	if err != nil {
		tb.p.w.t.Fatalf("evaluate %s: %v", js, err)
	}
	return v
}

// pay sets the account, clicks the network switch (if any) and presses Pay.
func (tb *tab) pay(account, network string) {
	tb.p.w.t.Helper()
	steps := []chromedp.Action[chromedp.Void]{chromedp.SetValue(chromedp.ID("account"), account)}
	if network != "" {
		steps = append(steps, chromedp.Click(chromedp.CSS(network)))
	}
	tb.do("pay", append(steps, chromedp.Click(chromedp.ID("pay")))...)
}

// rows reads the page's table of intents, newest first.
func (tb *tab) rows() []row {
	tb.p.w.t.Helper()
	var rs []row
	js := tb.eval(`JSON.stringify([...document.querySelectorAll("tr.intent")].map(tr => ({...tr.dataset})))`)
	if err := json.Unmarshal([]byte(js), &rs); err != nil {
		tb.p.w.t.Fatalf("rows %s: %v", js, err)
	}
	return rs
}

// waitRows waits until the page's intents satisfy cond, and returns them.
func (tb *tab) waitRows(what string, cond func([]row) bool) []row {
	tb.p.w.t.Helper()
	deadline := time.Now().Add(stepTimeout)
	for {
		rs := tb.rows()
		if cond(rs) {
			return rs
		}
		if time.Now().After(deadline) {
			tb.p.w.t.Fatalf("timed out waiting for %s; the page shows %+v, and logged:\n%s", what, rs, tb.eval(`document.getElementById("log").innerText`))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitRow waits for the page to show one intent, its only one, satisfying cond.
func (tb *tab) waitRow(what string, cond func(row) bool) row {
	tb.p.w.t.Helper()
	rs := tb.waitRows(what, func(rs []row) bool { return len(rs) == 1 && cond(rs[0]) })
	return rs[0]
}

// crash crashes the tab's renderer (CDP Page.crash), as an out-of-memory kill
// would, waits until the browser reports it, and closes what is left of it.
func (tb *tab) crash() {
	tb.p.w.t.Helper()
	tb.do("crash the tab", chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		if _, err := cdp.Call(ctx, t, inspector.Enable, cdp.Empty{}); err != nil {
			return err
		}
		crashed := cdp.Events(ctx, t, inspector.TargetCrashed)
		// The renderer dies before it can answer: the call does not return.
		go func() { _, _ = cdp.Call(ctx, t, page.Crash, cdp.Empty{}) }()
		for _, err := range crashed {
			return err
		}
		return errors.New("the tab's session ended without a crash")
	}))
	tb.close()
}

func (tb *tab) close() { tb.cancel() }

// offline cuts the tab off the network, or connects it again, as the developer
// tools' Offline switch does: requests fail and navigator.onLine follows.
func (tb *tab) offline(off bool) {
	tb.p.w.t.Helper()
	rules := []*network.Conditions{}
	if off {
		rules = append(rules, &network.Conditions{Offline: true, DownloadThroughput: -1, UploadThroughput: -1})
	}
	tb.do(fmt.Sprintf("offline=%v", off), chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		if _, err := cdp.Call(ctx, t, network.Enable, network.EnableParams{}); err != nil {
			return err
		}
		if _, err := cdp.Call(ctx, t, network.EmulateNetworkConditionsByRule, network.EmulateNetworkConditionsByRuleParams{MatchedNetworkConditions: rules}); err != nil {
			return err
		}
		_, err := cdp.Call(ctx, t, network.OverrideNetworkState, network.OverrideNetworkStateParams{Offline: off, DownloadThroughput: -1, UploadThroughput: -1})
		return err
	}))
}

// heldKey waits for one request held at the ingress, and returns its key.
func (w *world) heldKey() string {
	w.t.Helper()
	var keys []string
	testenv.Eventually(w.t, stepTimeout, "a request held at the ingress", func() bool {
		keys = w.gate.keys()
		return len(keys) > 0
	})
	if len(keys) != 1 {
		w.t.Fatalf("held %q, want one request", keys)
	}
	return keys[0]
}

// expectLedger waits until every charge the ingress accepted is consumed, then
// checks the account's ledger rows: exactly one per key given.
func (w *world) expectLedger(account string, keys ...string) {
	w.t.Helper()
	db := w.env.DB
	testenv.Eventually(w.t, stepTimeout, "every accepted charge consumed", func() bool {
		return db.Count(w.t, `SELECT count(*) FROM idem_outbox o WHERE NOT EXISTS (
			SELECT 1 FROM idem_inbox i WHERE i.consumer = $1 AND i.key = o.key)`, refapp.ChargeConsumer) == 0
	})
	rows, err := db.Pool.Query(context.Background(), `SELECT idempotency_key FROM ledger_entries WHERE account = $1 ORDER BY id`, account)
	if err != nil {
		w.t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			w.t.Fatal(err)
		}
		got = append(got, k)
	}
	if err := rows.Err(); err != nil {
		w.t.Fatal(err)
	}
	want := slices.Clone(keys)
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		w.t.Errorf("ledger_entries for %s: %d rows under keys %q, want %d under %q", account, len(got), got, len(want), want)
	}
}

// requests is the ingress's count of the requests it answered, from /metrics.
func (w *world) requests() int {
	w.t.Helper()
	resp, err := http.Get(w.base + "/metrics")
	if err != nil {
		w.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		w.t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(line, "idem_ingress_requests_total{") {
			continue
		}
		v, err := strconv.ParseFloat(line[strings.LastIndex(line, " ")+1:], 64)
		if err != nil {
			w.t.Fatalf("metrics line %q: %v", line, err)
		}
		n += int(v)
	}
	return n
}
