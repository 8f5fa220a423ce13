// Package console_test drives the operator console in a real browser (headless
// Chromium through chromedp) against a real reference worker on a real Postgres
// and JetStream, holding real data.
//
// Without Chromium the test skips, unless IDEM_REQUIRE_BROWSER=1 (CI), where it
// fails. IDEM_CONSOLE_SCREENSHOTS=DIR saves a PNG of each page into DIR.
package console_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/refapptest"
	"github.com/idemkit/idem/client"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/test/internal/browsertest"
)

// dropFirstResponse loses the first response after the server sent it.
type dropFirstResponse struct{ dropped bool }

func (d *dropFirstResponse) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err != nil || d.dropped {
		return resp, err
	}
	d.dropped = true
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return nil, fmt.Errorf("response %d dropped by the test", resp.StatusCode)
}

func TestConsoleInABrowser(t *testing.T) {
	t.Parallel()
	bctx := browsertest.New(t) // first: skip before starting anything
	env := testenv.New(t)
	ctx := context.Background()
	svc := refapptest.Start(t, env.DB.Pool, env.NC, refapp.Config{
		HTTPAddr: "127.0.0.1:0",
		Charges:  consumer.Config{AckWait: 2 * time.Second},
		Console:  refapp.ConsoleConfig{Enabled: true},
	})
	base := "http://" + svc.Addr()

	// A charge whose first response is lost: the client retries with its key and
	// gets the replayed answer.
	j, err := client.OpenJournal(filepath.Join(t.TempDir(), "journal"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.Close() })
	c, err := client.New(client.Config{Store: j, BaseURL: base, HTTPClient: &http.Client{Transport: &dropFirstResponse{}},
		BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.Submit(ctx, client.Request{Path: "/v1/payments", Body: []byte(`{"account":"acct_console","amount_cents":4200}`)})
	if err != nil {
		t.Fatal(err)
	}
	if res.Attempts != 2 || !res.Replayed {
		t.Fatalf("submit = %+v, want a replayed answer on the second attempt", res)
	}
	key := string(res.Key)
	testenv.Eventually(t, 45*time.Second, "charge consumed", func() bool {
		return env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'charges' AND key = $1`, key) == 1
	})
	// The same message delivered again (as after a lost ack): the inbox folds it.
	var payload []byte
	if err := env.DB.Pool.QueryRow(ctx, `SELECT payload FROM idem_outbox WHERE key = $1`, key).Scan(&payload); err != nil {
		t.Fatal(err)
	}
	msg := nats.NewMsg(refapp.SubjectCharge)
	msg.Header.Set(idem.HeaderKey, key)
	msg.Header.Set(idem.HeaderMsgID, key+"-again")
	msg.Data = payload
	if _, err := svc.Worker().Installation().JetStream().PublishMsg(ctx, msg); err != nil {
		t.Fatal(err)
	}

	// Two charges no retry can fix: dead letters, one with markup in its payload.
	ob := svc.Worker().Outbox()
	err = pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error {
		return ob.Enqueue(ctx, tx,
			idem.Message{Key: "bad-<b>markup</b>", Subject: refapp.SubjectCharge, Payload: []byte(`{"bogus":"<script>alert(1)</script>"}`)},
			idem.Message{Key: "bad-2", Subject: refapp.SubjectCharge, Payload: []byte(`{"account":""}`)})
	})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 45*time.Second, "two dead letters and the fold", func() bool {
		return env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters`) == 2 && foldCount(t, base) >= 1
	})

	shots := os.Getenv("IDEM_CONSOLE_SCREENSHOTS")
	// run runs one browser step, bounded, and logs its time.
	step := func(what string, f func(ctx context.Context) error) {
		t.Helper()
		start := time.Now()
		tctx, cancel := context.WithTimeout(bctx, 30*time.Second)
		defer cancel()
		if err := f(tctx); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		t.Logf("browser: %s in %v", what, time.Since(start).Round(time.Millisecond))
	}
	do := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		step(what, func(ctx context.Context) error { return chromedp.Do(ctx, steps...) })
	}
	text := func(css string) string {
		t.Helper()
		var v string
		step("read "+css, func(ctx context.Context) (err error) {
			v, err = chromedp.Run(ctx, chromedp.Text(chromedp.CSS(css)))
			return err
		})
		return v
	}
	eval := func(js string) string {
		t.Helper()
		var v string
		step("evaluate", func(ctx context.Context) (err error) {
			v, err = chromedp.Run(ctx, chromedp.Evaluate[string](js))
			return err
		})
		return v
	}
	// waitURL waits until the page's URL holds want: a click that submits a
	// form has loaded the next page.
	waitURL := func(want string) {
		t.Helper()
		step("wait for "+want, func(ctx context.Context) error {
			for {
				href, err := chromedp.Run(ctx, chromedp.Evaluate[string](`location.href`))
				if err == nil && strings.Contains(href, want) {
					return chromedp.Do(ctx, chromedp.WaitReady(chromedp.CSS("body")))
				}
				select {
				case <-ctx.Done():
					return fmt.Errorf("URL %q never held %q: %w", href, want, ctx.Err())
				case <-time.After(20 * time.Millisecond):
				}
			}
		})
	}
	shot := func(name string) {
		t.Helper()
		if shots == "" {
			return
		}
		step("screenshot "+name, func(ctx context.Context) error {
			buf, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
			if err != nil {
				return err
			}
			if err := os.MkdirAll(shots, 0o755); err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(shots, name+".png"), buf, 0o644)
		})
	}
	contains := func(what, got string, wants ...string) {
		t.Helper()
		for _, w := range wants {
			if !strings.Contains(got, w) {
				t.Errorf("%s: %q lacks %q", what, got, w)
			}
		}
	}

	// Overview.
	do("overview", chromedp.Navigate(base+"/console"), chromedp.WaitVisible(chromedp.ID("dead")))
	dead, folds, backlog := text("#dead"), text("#folds"), text("#backlog")
	contains("dead letters card", dead, "2", "not replayed")
	contains("folds card", folds, "duplicates absorbed")
	contains("backlog card", backlog, "0", "outbox backlog")
	contains("published card", text("#intents-rate"), "messages/s into the stream")
	if strings.HasPrefix(strings.TrimSpace(folds), "0") {
		t.Errorf("folds card %q: want the redelivery's fold counted", folds)
	}
	// The live part refreshes by itself: a newer reading of the consumers
	// appears while the page stays loaded (a mark left on the window survives:
	// no reload).
	firstAt := eval(`document.getElementById("live").dataset.at || ""`)
	eval(`window.idemNoReload = "kept"; ""`)
	// The worker reads its consumers every 10 s: wait for a newer reading, and
	// for two of charges (the first may have been taken before the page).
	step("the overview refreshes by itself", func(ctx context.Context) error {
		for {
			at, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.getElementById("live").dataset.at || ""`))
			if err == nil && at != "" && at != firstAt {
				n, err := chromedp.Run(ctx, chromedp.Evaluate[int](`(document.querySelector("#lag-plot polyline[data-consumer=charges]") || {getAttribute: () => ""}).getAttribute("points").split(" ").filter(Boolean).length`))
				if err == nil && n >= 2 {
					return nil
				}
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("the live part still shows the reading at %s: %w", firstAt, ctx.Err())
			case <-time.After(100 * time.Millisecond):
			}
		}
	})
	if mark := eval(`window.idemNoReload || "reloaded"`); mark != "kept" {
		t.Errorf("the page was reloaded to refresh (%s)", mark)
	}
	if s := text("#live-status"); !strings.Contains(s, "refreshes by itself") {
		t.Errorf("live status %q", s)
	}
	// Each consumer's lag and rate: in the table, and over the last 15 minutes a
	// line each, drawn by the server as SVG and named in the legend. Two readings
	// of charges are in: two points of lag, one rate between them.
	contains("lag table", text("#lag"), refapp.ChargeConsumer, refapp.SubjectCharge, "/s")
	points := func(id string) string {
		return eval(`Array.from(document.querySelectorAll("#` + id + ` polyline")).map(l => l.dataset.consumer + ":" + l.getAttribute("points").split(" ").filter(Boolean).length).join(",")`)
	}
	if lines := points("lag-plot"); !strings.Contains(lines, refapp.ChargeConsumer+":") || strings.Contains(lines, refapp.ChargeConsumer+":0") || strings.Contains(lines, refapp.ChargeConsumer+":1,") || strings.HasSuffix(lines, refapp.ChargeConsumer+":1") {
		t.Errorf("lag plot lines %q: want charges with two points or more", lines)
	}
	if lines := points("rate-plot"); !strings.Contains(lines, refapp.ChargeConsumer+":") || strings.Contains(lines, refapp.ChargeConsumer+":0") {
		t.Errorf("rate plot lines %q: want charges with a point", lines)
	}
	contains("lag legend", text("#lag-plot .legend"), refapp.ChargeConsumer+":")
	contains("rate legend", text("#rate-plot .legend"), refapp.ChargeConsumer+":", "/s")
	shot("overview")

	// Dead letters: filter, then replay one with a dry run and a confirmation.
	rows := func() string { return eval(`document.querySelectorAll("tr.dl").length + ""`) }
	do("dead letters: a filter that matches none", chromedp.Navigate(base+"/console/dead-letters"),
		chromedp.SetValue(chromedp.CSS(`input[name=reason]`), "max deliveries"),
		chromedp.Click(chromedp.ID("apply-filter")))
	waitURL("reason=max+deliveries")
	if n := rows(); n != "0" {
		t.Errorf("filter reason=max deliveries: %s rows, want 0", n)
	}
	do("dead letters: filter by consumer, reason and time",
		chromedp.SetValue(chromedp.CSS(`input[name=reason]`), "permanent"),
		chromedp.SetValue(chromedp.CSS(`input[name=consumer]`), "charges"),
		chromedp.SetValue(chromedp.CSS(`input[name=since]`), "1h"),
		chromedp.Click(chromedp.ID("apply-filter")))
	waitURL("since=1h")
	if n := rows(); n != "2" {
		t.Errorf("filter consumer=charges reason=permanent since=1h: %s rows, want 2", n)
	}
	if !strings.Contains(eval(`location.search`), "consumer=charges") {
		t.Errorf("the filter is not in the URL")
	}
	list := text("#dead-letters")
	shot("dead-letters")
	contains("dead-letter list", list, "bad-2", "bad-<b>markup</b>", "permanent", `<script>alert(1)</script>`)
	// The payload's <script> and the key's <b> are text on the page, not elements.
	if n := eval(`document.querySelectorAll("main script, main b").length + ""`); n != "0" {
		t.Errorf("%s elements made of the data's markup, want 0", n)
	}

	do("replay one: dry run", chromedp.Click(chromedp.CSS(`tr.dl input[name=id]`)), // the newest row
		chromedp.Click(chromedp.ID("replay-selected")))
	waitURL("/dead-letters/replay")
	if !strings.Contains(eval(`document.body.innerHTML`), `id="dry-run"`) {
		t.Fatalf("no dry run: %s", eval(`document.body.innerText`))
	}
	contains("dry run", text("#dry-run"), "nothing was written", "1 would be replayed")
	shot("replay-dry-run")
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NOT NULL`); n != 0 {
		t.Fatalf("after the dry run %d dead letters are marked replayed, want 0", n)
	}
	do("replay one: confirm", chromedp.Click(chromedp.ID("confirm")))
	do("replay confirmed", chromedp.WaitVisible(chromedp.ID("replayed")))
	contains("replayed", text("#replayed"), "Replayed 1", "refused 0")
	shot("replayed")
	testenv.Eventually(t, 45*time.Second, "the dead letter marked replayed", func() bool {
		return env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NOT NULL`) == 1
	})

	// Key inspector: the charge with the dropped response and the redelivery.
	do("inspect the key", chromedp.Navigate(base+"/console/inspect"),
		chromedp.SendKeys(chromedp.CSS(`input[name=key]`), key),
		chromedp.Click(chromedp.ID("inspect-button")))
	waitURL("key=")
	do("inspector loaded", chromedp.WaitVisible(chromedp.ID("summary")))
	contains("summary", text("#summary"), key)
	contains("request record", text("#request"), "POST", "/v1/payments", "done", "202")
	contains("outbox", text(".outbox"), "published", "consumed by charges", refapp.SubjectCharge)
	contains("inbox", text("#inbox"), "charges", "done")
	contains("application rows", eval(`Array.from(document.querySelectorAll("h3.effect-name")).map(e => e.textContent).join("|")`),
		"payments (1)", "emails (0)", "ledger_entries (1)")
	contains("ledger row", text(`table.effect[data-table=ledger_entries]`), "acct_console", "4200")
	if n := eval(`document.querySelectorAll(".attention").length + ""`); n != "0" {
		t.Errorf("the inspector flags %s problems with a key charged once", n)
	}
	shot("inspect")

	// Consumers and streams.
	do("consumers and streams", chromedp.Navigate(base+"/console/streams"), chromedp.WaitVisible(chromedp.ID("consumers")))
	contains("stream", text("#stream"), "idem.>")
	contains("consumers", text("#consumers"), "charges", "AckExplicit", "2s")
	shot("streams")

	// A state-changing request without the page's token is refused.
	resp, err := http.PostForm(base+"/console/dead-letters/replay", map[string][]string{"id": {"1"}, "confirm": {"yes"}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("POST without a CSRF token: %d, want 403", resp.StatusCode)
	}
}

// foldCount is the worker's count of duplicates its inboxes folded.
func foldCount(t *testing.T, base string) int {
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "idem_consumer_messages_total{") && strings.Contains(line, `outcome="duplicate"`) && !strings.HasSuffix(line, " 0") {
			n++
		}
	}
	return n
}
