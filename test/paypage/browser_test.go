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
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
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

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/refapptest"
	"github.com/idemkit/idem/clients/browser"
	"github.com/idemkit/idem/consumer"
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
	svc     *refapp.Service
	cfg     refapp.Config
	ctx     context.Context // the service's, with its fault points
}

// newWorld starts a browser and a worker with the payment page on a database of
// its own, its ingress gated (world.gate).
func newWorld(t *testing.T) *world {
	t.Helper()
	bctx := browsertest.New(t) // first: skip before starting anything
	env := testenv.New(t)
	g := &gate{}
	ctx := faults.With(context.Background(), faults.New().Func(faults.IngressAfterCommit, g.hit))
	cfg := refapp.Config{
		HTTPAddr: "127.0.0.1:0",
		PayPage:  true,
		Charges:  consumer.Config{AckWait: 5 * time.Second},
	}
	svc := refapptest.StartContext(t, ctx, env.DB.Pool, env.NC, cfg)
	t.Cleanup(g.release) // before the shutdown, which a held request would hold up
	return &world{t: t, env: env, base: "http://" + svc.Addr(), gate: g, browser: bctx, svc: svc, cfg: cfg, ctx: ctx}
}

// stop shuts the worker down: its port refuses connections until restart.
func (w *world) stop() {
	w.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), stepTimeout)
	defer cancel()
	if err := w.svc.Shutdown(ctx); err != nil {
		w.t.Fatalf("stop the worker: %v", err)
	}
}

// restart starts the worker again on the address it had.
func (w *world) restart() {
	w.t.Helper()
	cfg := w.cfg
	cfg.HTTPAddr = w.svc.Addr()
	w.svc = refapptest.StartContext(w.t, w.ctx, w.env.DB.Pool, w.env.NC, cfg)
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
	Key         string `json:"key"`
	PreviousKey string `json:"previousKey"`
	Status      string `json:"status"`
	Code        string `json:"code"`
	Cause       string `json:"cause"`
	Attempts    string `json:"attempts"`
	HTTPStatus  string `json:"httpStatus"`
	Replayed    string `json:"replayed"`
	Event       string `json:"event"`
	Ledger      string `json:"ledger"`
}

func TestPayPage(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	g := w.gate
	start := time.Now()
	defer func() { t.Logf("ten scenarios in %v", time.Since(start).Round(time.Millisecond)) }()

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
			// The tab that waited hears the outcome too: its last event is finished.
			r := tb.waitRow("both tabs seeing it done and finished", func(r row) bool { return r.Key == key && r.Status == "done" && r.Event == "finished" })
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
		a.waitRow("the first press done", func(r row) bool { return r.Status == "done" })
		// Pay is off while a payment is on its way: the second press, in another
		// tab, is a second payment once the first is settled.
		b.waitEnabled("Pay in the other tab")
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
		first := tb.payHeldThenWipe("acct_wiped")
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

	t.Run("journal wiped, then the held answer delivered: the page reports the charge", func(t *testing.T) {
		w.t = t
		tb := w.profile().open()
		key := tb.payHeldThenWipe("acct_late")
		tb.do("deliver the held response", chromedp.Click(chromedp.CSS(`#held li[data-key="`+key+`"] button.deliver`)))
		tb.do("the charge reported", chromedp.WaitVisible(chromedp.CSS(`#notice[data-status="done"][data-key="`+key+`"]`)))
		if n := tb.eval(`String(document.querySelectorAll("#lost li").length)`); n != "0" {
			t.Errorf("%s intents reported lost, want none: the answer was in hand", n)
		}
		w.expectLedger("acct_late", key)
	})

	t.Run("two users on one origin: each sends, sees and forgets only their own", func(t *testing.T) {
		w.t = t
		p := w.profile()
		tb := p.open()
		tb.signIn("alice")
		tb.offline(true)
		tb.pay("acct_alice", "")
		alice := tb.waitRow("alice's payment waiting for the network", func(r row) bool { return r.Event == "offline" }).Key
		// Bob signs in on the same browser, alice never having signed out.
		tb.signIn("bob")
		tb.waitRows("bob's journal, empty", func(rs []row) bool { return len(rs) == 0 })
		tb.offline(false)
		tb.waitEnabled("bob's Pay")
		tb.pay("acct_bob", "")
		bob := tb.waitRow("bob's payment done", func(r row) bool { return r.Status == "done" }).Key
		w.expectScopedLedger("bob", "acct_bob", bob)
		// A second tab of bob's session resumes on load: nothing of alice's.
		other := p.open()
		other.waitRow("bob's second tab showing his payment alone", func(r row) bool { return r.Key == bob })
		other.close()
		if n := w.payments("alice", alice); n != 0 {
			t.Fatalf("alice's payment reached the server %d time(s) under bob's session", n)
		}
		// Bob signs out: his journal is forgotten; alice's stays hers.
		tb.signOut()
		if got := tb.journalOwners(); !slices.Equal(got, []string{"alice"}) {
			t.Errorf("the journal after bob signed out holds intents of %q, want alice's alone", got)
		}
		tb.signIn("alice")
		tb.waitRow("alice's payment sent once she is back", func(r row) bool { return r.Key == alice && r.Status == "done" })
		w.expectScopedLedger("alice", "acct_alice", alice)
		// Alice signs out with a payment still waiting: it is forgotten, never sent.
		tb.offline(true)
		tb.pay("acct_alice", "")
		late := tb.waitRows("alice's second payment waiting", func(rs []row) bool { return len(rs) == 2 && rs[0].Event == "offline" })[0].Key
		tb.signOut()
		tb.do("the sign-out saying what it forgot", chromedp.WaitVisible(chromedp.CSS(`#notice`)))
		if text := tb.eval(`document.getElementById("notice").textContent`); !strings.Contains(text, "2 payment(s)") && !strings.Contains(text, "1 payment(s)") {
			t.Errorf("the sign-out notice %q does not say a pending payment was forgotten", text)
		}
		tb.offline(false)
		tb.signIn("alice")
		tb.waitRows("alice's journal, empty after her sign-out", func(rs []row) bool { return len(rs) == 0 })
		if n := w.payments("alice", late); n != 0 {
			t.Errorf("the payment alice's sign-out forgot reached the server %d time(s)", n)
		}
		w.expectScopedLedger("alice", "acct_alice", alice)
		tb.signOut()
	})

	t.Run("a device clock 50 h behind: the payment is not lost, and is charged once", func(t *testing.T) {
		w.t = t
		tb := w.profile().openWith(`{ const real = Date.now.bind(Date); Date.now = () => real() - 50 * 3600 * 1000; }`)
		if skew := tb.eval(`String(Math.round((performance.timeOrigin + performance.now() - Date.now()) / 3600000))`); skew != "50" {
			t.Fatalf("the page's clock is %s h behind, want 50", skew)
		}
		tb.pay("acct_clock", "")
		r := tb.waitRow("the payment done", func(r row) bool { return r.Status == "done" })
		if r.PreviousKey == "" || r.Attempts != "2" {
			t.Errorf("intent %+v: want the first key refused for its age and the intent sent again under a second", r)
		}
		if n := w.payments("", r.PreviousKey); n != 0 {
			t.Errorf("the refused key %s has %d payments rows, want 0", r.PreviousKey, n)
		}
		w.expectLedger("acct_clock", r.Key)
		tb.do("the notice", chromedp.WaitVisible(chromedp.CSS(`#notice[data-status="done"]`)))
	})
}

// The worker is down when the user presses Pay, and for a minute after; the page
// stays open. It keeps the payment, keeps Pay off, keeps sending by itself, and
// the payment goes through once when the worker is back: no reload, no second
// press.
func TestPayPageWorkerDown(t *testing.T) {
	t.Parallel()
	const outage = 60 * time.Second
	w := newWorld(t)
	tb := w.profile().open()
	tb.eval(`window.idemTestLoad = "the first load"; ""`)
	w.stop()
	pressed := time.Now()
	tb.pay("acct_down", "")
	key := tb.waitRow("the first round spent, the intent paused", func(r row) bool { return r.Event == "paused" }).Key
	for {
		// What the user has while the worker is away: one payment, pending, and no
		// Pay to press again.
		if !tb.payDisabled() {
			t.Fatalf("Pay is on %v into the outage, with the payment pending", time.Since(pressed).Round(time.Second))
		}
		tb.do("press Pay again", chromedp.Click(chromedp.ID("pay")))
		rs := tb.rows()
		if len(rs) != 1 || rs[0].Key != key || rs[0].Status != "pending" {
			t.Fatalf("%v into the outage the page shows %+v, want %s pending alone", time.Since(pressed).Round(time.Second), rs, key)
		}
		left := outage - time.Since(pressed)
		if left <= 0 {
			break
		}
		time.Sleep(min(left, 5*time.Second)) // the outage lasts a minute: a time, not a condition
	}
	during := tb.rows()[0]
	w.restart()
	back := time.Now()
	r := tb.waitRowFor("the open page sending it once the worker is back", 45*time.Second, func(r row) bool { return r.Key == key && r.Status == "done" })
	t.Logf("worker down %v from the press; the page sent the payment %v after the worker came back, at attempt %s (%s before the restart)",
		back.Sub(pressed).Round(time.Second), time.Since(back).Round(100*time.Millisecond), r.Attempts, during.Attempts)
	if n, _ := strconv.Atoi(during.Attempts); n <= 8 {
		t.Errorf("%d attempts during a minute's outage: want the page to keep trying past its first round of 8", n)
	}
	if r.Replayed != "false" || r.HTTPStatus != "202" {
		t.Errorf("intent %+v: want the worker's first answer, 202", r)
	}
	if load := tb.eval(`String(window.idemTestLoad)`); load != "the first load" {
		t.Errorf("the page was reloaded (%q)", load)
	}
	w.expectLedger("acct_down", key)
	tb.waitEnabled("Pay, once the payment is settled")
}

// A shop's page on another origin posts to the worker, whose CORS a deployment
// got wrong: first no CORS at all, then a preflight answered but no
// Access-Control-Allow-Origin on the response (the worker charges, the browser
// hides the answer), then right. The client names CORS, not an outage, keeps
// the intent pending under its key, and the fix ends it with one row.
func TestPayPageCrossOrigin(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	target, err := url.Parse(w.base)
	if err != nil {
		t.Fatal(err)
	}
	gate := browsertest.NewCORSGate(browsertest.CORSNone)
	api := httptest.NewServer(gate.Wrap(httputil.NewSingleHostReverseProxy(target)))
	t.Cleanup(api.Close)
	shop := http.NewServeMux()
	shop.Handle("GET /idem/", http.StripPrefix("/idem/", http.FileServerFS(browser.FS())))
	shop.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = io.WriteString(w, shopPage)
	})
	shopSrv := httptest.NewServer(shop)
	t.Cleanup(shopSrv.Close)
	down := browsertest.ClosedOrigin(t)
	tb := w.profile().openURL(shopSrv.URL + "/?" + url.Values{"api": {api.URL}, "down": {down}}.Encode())
	type result struct {
		Key, Status, Cause, Error string
		HTTPStatus                int
		Replayed                  bool
	}
	call := func(js string) result {
		t.Helper()
		var r result
		if err := json.Unmarshal([]byte(tb.evalAwait(js)), &r); err != nil {
			t.Fatal(err)
		}
		return r
	}
	r := call(`pay("acct_cors")`)
	if r.Status != "pending" || r.Cause != "cors" || !strings.Contains(r.Error, "Access-Control-Allow-Origin") {
		t.Fatalf("without CORS: %+v, want pending, cause cors, the contract in the error", r)
	}
	if n := w.payments("", r.Key); n != 0 {
		t.Fatalf("without CORS the worker ran the payment %d time(s): the preflight should have stopped it", n)
	}
	gate.Set(browsertest.CORSPreflightOnly)
	if r2 := call(`retryPayment(` + strconv.Quote(r.Key) + `)`); r2.Status != "pending" || r2.Cause != "cors" {
		t.Fatalf("with the preflight alone: %+v, want pending, cause cors", r2)
	}
	w.expectLedger("acct_cors", r.Key) // the worker charged; the browser hid its answer
	gate.Set(browsertest.CORSFull)
	if r3 := call(`retryPayment(` + strconv.Quote(r.Key) + `)`); r3.Status != "done" || r3.HTTPStatus != 202 || !r3.Replayed {
		t.Fatalf("with CORS right: %+v, want done, the worker's replay of its 202", r3)
	}
	w.expectLedger("acct_cors", r.Key)
	// The control: an origin where nothing listens is an outage, not CORS.
	if r4 := call(`payTo(params.get("down"), "acct_down_origin")`); r4.Status != "pending" || r4.Cause != "network" {
		t.Errorf("an unreachable origin: %+v, want pending, cause network", r4)
	}
}

// shopPage is a page of another origin than the worker's: the client posts to
// the origin its query names (api), re-driving off so that each step is the
// test's.
const shopPage = `<!doctype html>
<meta charset="utf-8">
<title>a shop on another origin</title>
<body>
<script type="module">
import { Client } from "/idem/idem.js";
window.params = new URLSearchParams(location.search);
const opts = { maxAttempts: 2, backoffBase: 10, backoffMax: 100, redrive: false };
const client = new Client({ journal: "shop", baseURL: params.get("api"), ...opts });
window.pay = async (account) => JSON.stringify(await client.submit({ path: "/v1/payments", body: { account, amount_cents: 500 } }));
window.retryPayment = async (key) => JSON.stringify(await client.retry(key));
window.payTo = async (base, account) => JSON.stringify(await new Client({ journal: "shop-2", baseURL: base, ...opts }).submit({ path: "/v1/payments", body: { account, amount_cents: 500 } }));
document.body.dataset.ready = "true";
</script>
</body>
`

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
func (p *profile) open() *tab { return p.openWith("") }

// openWith opens the page in a new tab of p, running script first in every
// document the tab loads (a skewed clock, say).
func (p *profile) openWith(script string) *tab {
	return p.openAt(p.w.base+refapp.PayPagePath, script)
}

// openURL opens a page of another origin in a new tab of p.
func (p *profile) openURL(u string) *tab { return p.openAt(u, "") }

func (p *profile) openAt(u, script string) *tab {
	p.w.t.Helper()
	ctx, cancel := chromedp.NewContext(p.root)
	p.w.t.Cleanup(cancel)
	// The first run makes the tab, which lives as long as the context of that run:
	// so not a bounded one.
	if err := chromedp.Do(ctx); err != nil {
		p.w.t.Fatalf("new tab: %v", err)
	}
	tb := &tab{p: p, ctx: ctx, cancel: cancel}
	if script != "" {
		tb.do("a script before the page's", chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
			_, err := cdp.Call(ctx, t, page.AddScriptToEvaluateOnNewDocument, page.AddScriptToEvaluateOnNewDocumentParams{Source: script})
			return err
		}))
	}
	tb.do("open "+u, chromedp.Navigate(u), chromedp.WaitReady(chromedp.CSS(`body[data-ready=true]`)))
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

// evalAwait evaluates js, a promise of a string, and returns its value.
func (tb *tab) evalAwait(js string) string {
	tb.p.w.t.Helper()
	ctx, cancel := context.WithTimeout(tb.ctx, stepTimeout)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[string](js, chromedp.EvalAwaitPromise))
	if err != nil {
		tb.p.w.t.Fatalf("evaluate %s: %v", js, err)
	}
	return v
}

// signIn signs user in on the page, as its session form does.
func (tb *tab) signIn(user string) {
	tb.p.w.t.Helper()
	tb.do("sign in as "+user, chromedp.SetValue(chromedp.ID("user"), user), chromedp.Click(chromedp.ID("sign-in")),
		chromedp.WaitReady(chromedp.CSS(`body[data-user="`+user+`"]`)))
}

// signOut presses Sign out.
func (tb *tab) signOut() {
	tb.p.w.t.Helper()
	tb.do("sign out", chromedp.Click(chromedp.ID("sign-out")), chromedp.WaitReady(chromedp.CSS(`body[data-user=""]`)))
}

// journalOwners reads the owners of every intent in the page's journal, as
// IndexedDB holds them.
func (tb *tab) journalOwners() []string {
	tb.p.w.t.Helper()
	js := tb.evalAwait(`new Promise((resolve, reject) => {
		const open = indexedDB.open("idem-pay");
		open.onerror = () => reject(open.error);
		open.onsuccess = () => {
			const db = open.result;
			const all = db.transaction("intents").objectStore("intents").getAll();
			all.onsuccess = () => { db.close(); resolve(JSON.stringify(all.result.map((r) => r.owner).sort())); };
		};
	})`)
	var owners []string
	if err := json.Unmarshal([]byte(js), &owners); err != nil {
		tb.p.w.t.Fatal(err)
	}
	return owners
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

// payHeldThenWipe pays with the response held at the page, wipes the journal
// while it is held, and returns the intent's key.
func (tb *tab) payHeldThenWipe(account string) string {
	tb.p.w.t.Helper()
	tb.pay(account, "#net-hold")
	key := tb.waitRow("the intent in flight", func(r row) bool { return r.Status == "pending" }).Key
	tb.do("the held response", chromedp.WaitVisible(chromedp.CSS(`#held li[data-key="`+key+`"]`)))
	tb.do("wipe the journal", chromedp.Click(chromedp.ID("wipe")))
	tb.waitRows("the journal empty", func(rs []row) bool { return len(rs) == 0 })
	return key
}

// payDisabled reports whether the page's Pay button is off.
func (tb *tab) payDisabled() bool {
	tb.p.w.t.Helper()
	return tb.eval(`String(document.getElementById("pay").disabled)`) == "true"
}

// waitEnabled waits until Pay is on.
func (tb *tab) waitEnabled(what string) {
	tb.p.w.t.Helper()
	tb.do(what, chromedp.WaitEnabled(chromedp.ID("pay")))
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
	return tb.waitRowsFor(what, stepTimeout, cond)
}

func (tb *tab) waitRowsFor(what string, d time.Duration, cond func([]row) bool) []row {
	tb.p.w.t.Helper()
	deadline := time.Now().Add(d)
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
	return tb.waitRowFor(what, stepTimeout, cond)
}

func (tb *tab) waitRowFor(what string, d time.Duration, cond func(row) bool) row {
	tb.p.w.t.Helper()
	rs := tb.waitRowsFor(what, d, func(rs []row) bool { return len(rs) == 1 && cond(rs[0]) })
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
	w.expectScopedLedger("", account, keys...)
}

// payments counts the payments rows the ingress wrote for one key of a scope:
// how often the worker ran the request.
func (w *world) payments(scope, key string) int {
	w.t.Helper()
	return w.env.DB.Count(w.t, `SELECT count(*) FROM payments WHERE scope = $1 AND idempotency_key = $2`, scope, key)
}

// expectScopedLedger is expectLedger for keys sent under an Idempotency-Scope.
func (w *world) expectScopedLedger(scope, account string, keys ...string) {
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
	var want []string
	for _, k := range keys {
		want = append(want, idem.ScopedKey(scope, idem.Key(k)))
	}
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
