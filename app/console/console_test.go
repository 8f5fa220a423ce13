package console_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/console"
	"github.com/idemkit/idem/deadletter"
	"github.com/idemkit/idem/internal/ops"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// noDB fails every transaction: the handler tests below never reach the database.
type noDB struct{}

func (noDB) BeginTx(context.Context, pgx.TxOptions) (pgx.Tx, error) {
	return nil, errors.New("no database in this test")
}

func server(t *testing.T, cfg console.Config) *httptest.Server {
	t.Helper()
	if cfg.Ops == nil {
		r, err := ops.New(noDB{}, ops.Config{})
		if err != nil {
			t.Fatal(err)
		}
		cfg.Ops = r
	}
	h, err := console.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/console", h)
	mux.Handle("/console/", h)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

func browser(t *testing.T) *http.Client {
	jar, _ := cookiejar.New(nil)
	return &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

func get(t *testing.T, c *http.Client, u string, hdr ...string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, u, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return do(t, c, req)
}

func post(t *testing.T, c *http.Client, u string, form url.Values, hdr ...string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, u, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return do(t, c, req)
}

func do(t *testing.T, c *http.Client, req *http.Request) (int, string) {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

func csrf(t *testing.T, body string) string {
	t.Helper()
	m := csrfRE.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no CSRF token in the page:\n%s", body)
	}
	return m[1]
}

func TestPostWithoutCSRFTokenIsForbidden(t *testing.T) {
	srv := server(t, console.Config{})
	c := browser(t)
	replay := srv.URL + "/console/dead-letters/replay"

	// No cookie, no token.
	if code, body := post(t, c, replay, url.Values{"id": {"1"}, "confirm": {"yes"}}); code != http.StatusForbidden {
		t.Fatalf("POST without a token: %d %s, want 403", code, body)
	}
	// The cookie (from a page load) but a forged token.
	code, page := get(t, c, srv.URL+"/console/login")
	if code != http.StatusOK {
		t.Fatalf("login page: %d", code)
	}
	tok := csrf(t, page)
	if code, _ := post(t, c, replay, url.Values{"id": {"1"}, "csrf": {tok + "x"}}); code != http.StatusForbidden {
		t.Fatalf("POST with a forged token: %d, want 403", code)
	}
	// A token from another browser (another cookie) does not fit this one.
	other := browser(t)
	if code, _ := post(t, other, replay, url.Values{"id": {"1"}, "csrf": {tok}}); code != http.StatusForbidden {
		t.Fatalf("POST with another browser's token: %d, want 403", code)
	}
	// The right token from another origin.
	if code, _ := post(t, c, replay, url.Values{"id": {"1"}, "csrf": {tok}}, "Origin", "http://evil.example"); code != http.StatusForbidden {
		t.Fatalf("cross-origin POST: %d, want 403", code)
	}
	// The right token passes the check (this console has no dead letters: 404).
	if code, body := post(t, c, replay, url.Values{"id": {"1"}, "csrf": {tok}}, "Origin", srv.URL); code != http.StatusNotFound {
		t.Fatalf("POST with the token: %d %s, want 404 past the CSRF check", code, body)
	}
	// GET never changes state: replay is POST only.
	if code, _ := get(t, c, replay+"?id=1&confirm=yes&csrf="+url.QueryEscape(tok)); code != http.StatusMethodNotAllowed {
		t.Fatalf("GET of the replay action: %d, want 405", code)
	}
}

func TestTokenAuth(t *testing.T) {
	srv := server(t, console.Config{Token: "s3cret"})
	c := browser(t)
	inspect := srv.URL + "/console/inspect"
	if code, _ := get(t, c, inspect); code != http.StatusSeeOther {
		t.Fatalf("GET without the token: %d, want a redirect to the login page", code)
	}
	if code, _ := post(t, c, srv.URL+"/console/dead-letters/replay", url.Values{"id": {"1"}}); code != http.StatusUnauthorized {
		t.Fatalf("POST without the token: %d, want 401", code)
	}
	if code, _ := get(t, c, inspect, "Authorization", "Bearer wrong"); code != http.StatusUnauthorized && code != http.StatusSeeOther {
		t.Fatalf("GET with a wrong token: %d, want refused", code)
	}
	if code, body := get(t, c, inspect, "Authorization", "Bearer s3cret"); code != http.StatusOK || !strings.Contains(body, "Key inspector") {
		t.Fatalf("GET with the bearer token: %d", code)
	}
	// The login page: a wrong token is refused, the right one sets the cookie.
	_, page := get(t, c, srv.URL+"/console/login")
	tok := csrf(t, page)
	if code, _ := post(t, c, srv.URL+"/console/login", url.Values{"csrf": {tok}, "token": {"nope"}}); code != http.StatusUnauthorized {
		t.Fatalf("login with a wrong token: %d, want 401", code)
	}
	if code, _ := post(t, c, srv.URL+"/console/login", url.Values{"csrf": {tok}, "token": {"s3cret"}}); code != http.StatusSeeOther {
		t.Fatalf("login: %d, want a redirect", code)
	}
	if code, _ := get(t, c, inspect); code != http.StatusOK {
		t.Fatalf("GET after login: %d, want 200", code)
	}
}

func TestBasicAuth(t *testing.T) {
	srv := server(t, console.Config{BasicUser: "ops", BasicPassword: "pw"})
	c := browser(t)
	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/console/inspect", nil)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized || !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), "Basic") {
		t.Fatalf("no credentials: %d %q, want 401 with a Basic challenge", resp.StatusCode, resp.Header.Get("WWW-Authenticate"))
	}
	req, _ = http.NewRequest(http.MethodGet, srv.URL+"/console/inspect", nil)
	req.SetBasicAuth("ops", "wrong")
	if code, _ := do(t, c, req); code != http.StatusUnauthorized {
		t.Fatalf("wrong password: %d, want 401", code)
	}
	req, _ = http.NewRequest(http.MethodGet, srv.URL+"/console/inspect", nil)
	req.SetBasicAuth("ops", "pw")
	if code, _ := do(t, c, req); code != http.StatusOK {
		t.Fatalf("right password: %d, want 200", code)
	}
}

func TestNewValidates(t *testing.T) {
	if _, err := console.New(console.Config{}); err == nil {
		t.Fatal("New without Ops succeeded")
	}
}

// Keys and payloads are the clients': the page shows them as text, never as markup.
func TestKeysAndPayloadsAreEscaped(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	const key = `<script>alert("key")</script>`
	const payload = `{"note":"<img src=x onerror=alert(1)>","html":"</pre><b>bold</b>"}`
	ob := outbox.New(env.Inst)
	err := pgx.BeginFunc(context.Background(), env.DB.Pool, func(tx pgx.Tx) error {
		return ob.Enqueue(context.Background(), tx, idem.Message{Key: key, Subject: testenv.Subject, Payload: []byte(payload)})
	})
	if err != nil {
		t.Fatal(err)
	}
	r, err := ops.New(env.DB.Pool, ops.Config{})
	if err != nil {
		t.Fatal(err)
	}
	srv := server(t, console.Config{Ops: r})
	code, body := get(t, browser(t), srv.URL+"/console/inspect?key="+url.QueryEscape(key))
	if code != http.StatusOK {
		t.Fatalf("inspect: %d\n%s", code, body)
	}
	for _, raw := range []string{"<script>alert", "<img src=x", "<b>bold</b>"} {
		if strings.Contains(body, raw) {
			t.Errorf("the page holds %q unescaped", raw)
		}
	}
	for _, esc := range []string{"&lt;script&gt;alert(&#34;key&#34;)&lt;/script&gt;", "&lt;img src=x onerror=alert(1)&gt;", "&lt;b&gt;bold&lt;/b&gt;"} {
		if !strings.Contains(body, esc) {
			t.Errorf("the page lacks the escaped %q", esc)
		}
	}
	if !strings.Contains(body, "pending, not yet published") {
		t.Errorf("the page does not show the outbox row's state")
	}
}

// A console without credentials is reached through a loopback listener; a web
// page that rebinds its own name to 127.0.0.1 (DNS rebinding) makes the
// operator's browser send requests there with Host and Origin naming the page.
// The console answers only requests addressed to the loopback names, and takes a
// POST only with an Origin of the same host.
func TestOpenConsoleRefusesForeignHostAndOrigin(t *testing.T) {
	srv := server(t, console.Config{})
	port := srv.Listener.Addr().(*net.TCPAddr).Port
	c := browser(t)
	send := func(method, path, host string, form url.Values, hdr ...string) (int, string) {
		t.Helper()
		var body io.Reader
		if form != nil {
			body = strings.NewReader(form.Encode())
		}
		req, _ := http.NewRequest(method, srv.URL+path, body)
		req.Host = host
		if form != nil {
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		}
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		return do(t, c, req)
	}
	evil := fmt.Sprintf("attacker.example:%d", port)

	// The rebinding page reads nothing: no page, no CSRF token.
	for _, path := range []string{"/console/login", "/console/inspect", "/console/dead-letters", "/console/static/console.js"} {
		code, body := send(http.MethodGet, path, evil, nil)
		if code != http.StatusForbidden || strings.Contains(body, `name="csrf"`) || !strings.Contains(body, "localhost, 127.0.0.1 or [::1]") {
			t.Errorf("GET %s with Host %s: %d %q, want 403 naming the hosts it answers", path, evil, code, body)
		}
	}
	// The loopback names work, with any port (an SSH tunnel's).
	for _, host := range []string{fmt.Sprintf("127.0.0.1:%d", port), fmt.Sprintf("localhost:%d", port), fmt.Sprintf("[::1]:%d", port), "LOCALHOST:9999", "localhost"} {
		if code, body := send(http.MethodGet, "/console/login", host, nil); code != http.StatusOK {
			t.Errorf("GET with Host %s: %d %s, want 200", host, code, body)
		}
	}
	// A token had legitimately, replayed from the rebinding page: refused.
	local := fmt.Sprintf("localhost:%d", port)
	_, page := send(http.MethodGet, "/console/login", local, nil)
	tok := csrf(t, page)
	replay := url.Values{"csrf": {tok}, "confirm": {"yes"}, "all": {"1"}, "replayed": {"1"}, "force": {"1"}}
	if code, body := send(http.MethodPost, "/console/dead-letters/replay", evil, replay, "Origin", "http://"+evil); code != http.StatusForbidden {
		t.Errorf("POST with forged Host and Origin: %d %s, want 403", code, body)
	}
	// A POST without Origin is refused; with a loopback Host but a foreign Origin too.
	if code, body := send(http.MethodPost, "/console/dead-letters/replay", local, replay); code != http.StatusForbidden || !strings.Contains(body, "Origin") {
		t.Errorf("POST without Origin: %d %s, want 403", code, body)
	}
	if code, body := send(http.MethodPost, "/console/dead-letters/replay", local, replay, "Origin", "http://"+evil); code != http.StatusForbidden {
		t.Errorf("POST from a foreign Origin: %d %s, want 403", code, body)
	}
	// The console's own page's POST passes (this console has no dead letters: 404).
	if code, body := send(http.MethodPost, "/console/dead-letters/replay", local, replay, "Origin", "http://"+local); code != http.StatusNotFound {
		t.Errorf("POST from the console's origin: %d %s, want 404 past the checks", code, body)
	}

	// With credentials, the name does not matter: a rebinding page has no token.
	authed := server(t, console.Config{Token: "s3cret"})
	req, _ := http.NewRequest(http.MethodGet, authed.URL+"/console/inspect", nil)
	req.Host = "console.internal.example"
	req.Header.Set("Authorization", "Bearer s3cret")
	if code, body := do(t, browser(t), req); code != http.StatusOK {
		t.Errorf("GET with a token under another name: %d %s, want 200", code, body)
	}
}

// "Replay all matching the filter" shows a dry run, and its confirmation replays
// exactly the dead letters the dry run listed: not one filed in between, which
// the filter (here a relative since=1h) would take in if evaluated again.
func TestReplayAllConfirmsTheDryRunsList(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := context.Background()
	file := func(key string) {
		t.Helper()
		if _, err := env.DB.Pool.Exec(ctx, `INSERT INTO idem_dead_letters (consumer, key, subject, payload, reason, inbox_expires_at)
		      VALUES ('charges', $1, $2, '{}', 'permanent handler error: test', now() + interval '2 days')`, key, testenv.Subject); err != nil {
			t.Fatal(err)
		}
	}
	file("k-1")
	file("k-2")
	r, err := ops.New(env.DB.Pool, ops.Config{})
	if err != nil {
		t.Fatal(err)
	}
	dls := deadletter.New(env.Inst)
	srv := server(t, console.Config{Ops: r, DeadLetters: dls})
	c := browser(t)
	_, page := get(t, c, srv.URL+"/console/dead-letters?consumer=charges&since=1h")
	tok := csrf(t, page)

	code, dry := post(t, c, srv.URL+"/console/dead-letters/replay",
		url.Values{"csrf": {tok}, "all": {"1"}, "consumer": {"charges"}, "since": {"1h"}}, "Origin", srv.URL)
	if code != http.StatusOK || !strings.Contains(dry, "2 would be replayed") {
		t.Fatalf("dry run: %d\n%s", code, dry)
	}
	confirm := url.Values{}
	form := regexp.MustCompile(`(?s)<form[^>]*id="confirm-form">(.*?)</form>`).FindStringSubmatch(dry)
	if form == nil {
		t.Fatalf("no confirmation form:\n%s", dry)
	}
	for _, m := range regexp.MustCompile(`<input type="hidden" name="([^"]+)" value="([^"]*)">`).FindAllStringSubmatch(form[1], -1) {
		confirm.Add(m[1], m[2])
	}

	// Filed after the dry run, matching its filter.
	file("k-3")
	code, done := post(t, c, srv.URL+"/console/dead-letters/replay", confirm, "Origin", srv.URL)
	if code != http.StatusOK || !strings.Contains(done, "Replayed 2, refused 0") {
		t.Fatalf("confirmation: %d\n%s", code, done)
	}
	var replayed string
	if err := env.DB.Pool.QueryRow(ctx, `SELECT string_agg(key, ',' ORDER BY key) FROM idem_dead_letters WHERE replayed_at IS NOT NULL`).Scan(&replayed); err != nil {
		t.Fatal(err)
	}
	if replayed != "k-1,k-2" {
		t.Fatalf("replayed %q, want the dry run's k-1,k-2 (k-3 was filed after it)", replayed)
	}
}

// The overview's live part, as the page's script reads it: each consumer's lag
// and rate in the table and as a line in two server-drawn SVG plots, and the
// consumer that falls behind marked.
func TestLivePartPlotsEachConsumer(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	r, err := ops.New(env.DB.Pool, ops.Config{})
	if err != nil {
		t.Fatal(err)
	}
	hist := ops.NewLagHistory(15 * time.Minute)
	t0 := time.Now().Add(-2 * time.Minute)
	for i := range 13 {
		n := uint64(i)
		hist.Add(&ops.JetStreamStats{Stream: "S", At: t0.Add(time.Duration(i) * 10 * time.Second), LastSeq: 150 * n, Consumers: []ops.ConsumerLag{
			{Name: "fast", FilterSubjects: []string{"s.fast"}, Delivered: 100 * n},
			{Name: "slow", FilterSubjects: []string{"s.slow"}, NumPending: 250 * n, NumAckPending: 10, Lag: 250*n + 10, Delivered: 250*n + 10},
		}})
	}
	srv := server(t, console.Config{Ops: r, Lag: hist})
	code, body := get(t, browser(t), srv.URL+"/console/live")
	if code != http.StatusOK || !strings.HasPrefix(body, `<div id="live"`) || strings.Contains(body, "<html") {
		t.Fatalf("live part: %d\n%s", code, body)
	}
	for _, want := range []string{
		`data-src="/console/live"`,
		`<tr class="consumer behind" data-consumer="slow">`, `falls behind</span>`,
		`<tr class="consumer" data-consumer="fast">`, `<td class="num rate">10.0/s</td>`, `<td class="num rate">25.0/s</td>`,
		`id="lag-plot"`, `id="rate-plot"`, `<li><span class="swatch s1"></span>slow: 3010</li>`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("the live part lacks %s", want)
		}
	}
	// 13 readings of each: 13 points of lag, 12 rates.
	pts := regexp.MustCompile(`<polyline class="line s\d" data-consumer="(\w+)" points="([^"]*)">`).FindAllStringSubmatch(body, -1)
	var got []string
	for _, m := range pts {
		got = append(got, fmt.Sprintf("%s:%d", m[1], len(strings.Fields(m[2]))))
	}
	if strings.Join(got, ",") != "fast:13,slow:13,fast:12,slow:12" {
		t.Errorf("plot lines %v, want lag and rate of fast and slow with 13 and 12 points", got)
	}
}
