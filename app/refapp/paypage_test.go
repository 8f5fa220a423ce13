package refapp_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/refapptest"
)

// The payment page over plain HTTP: what it serves, its headers, its guard, its
// ledger endpoint. test/paypage drives it in a browser.
func TestPayPageHTTP(t *testing.T) {
	t.Parallel()
	env := newAppEnv(t)
	svc := refapptest.Start(t, env.DB.Pool, env.NC, refapp.Config{HTTPAddr: "127.0.0.1:0", PayPage: true})
	base := "http://" + svc.Addr()
	if _, err := env.DB.Pool.Exec(context.Background(), `INSERT INTO ledger_entries (idempotency_key, account, amount_cents)
		VALUES ('k-1', 'acct_a', 1250), ('k-2', 'acct_a', 99), ('tenant' || chr(31) || 'k-1', 'acct_b', 7)`); err != nil {
		t.Fatal(err)
	}

	get := func(path, host string) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, base+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		if host != "" {
			req.Host = host
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp, string(b)
	}

	for _, c := range []struct{ path, contentType, holds string }{
		{"/pay", "text/html", `src="/pay/assets/pay.js"`},
		{"/pay/assets/pay.js", "text/javascript", `from "/pay/idem/idem.js"`},
		{"/pay/assets/pay.css", "text/css", "#held li"},
		{"/pay/idem/idem.js", "text/javascript", "export { Client"},
		{"/pay/idem/journal.js", "text/javascript", "indexedDB.open"},
	} {
		resp, body := get(c.path, "")
		if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), c.contentType) || !strings.Contains(body, c.holds) {
			t.Errorf("GET %s: %d %q, body holds %q: %v", c.path, resp.StatusCode, resp.Header.Get("Content-Type"), c.holds, strings.Contains(body, c.holds))
		}
		csp := resp.Header.Get("Content-Security-Policy")
		for _, want := range []string{"default-src 'none'", "script-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"} {
			if !strings.Contains(csp, want) {
				t.Errorf("GET %s: CSP %q lacks %q", c.path, csp, want)
			}
		}
		if resp.Header.Get("X-Content-Type-Options") != "nosniff" {
			t.Errorf("GET %s: no nosniff", c.path)
		}
	}
	// Nothing inline, which the CSP would block anyway, and nothing from elsewhere.
	_, page := get("/pay", "")
	for _, bad := range []string{"<script>", "style=", "onclick", "http://", "https://"} {
		if strings.Contains(page, bad) {
			t.Errorf("the page holds %q", bad)
		}
	}

	for _, host := range []string{"localhost", "127.0.0.1", "[::1]:8080", "LOCALHOST:1"} {
		if resp, _ := get("/pay", host); resp.StatusCode != http.StatusOK {
			t.Errorf("Host %s: %d, want 200", host, resp.StatusCode)
		}
	}
	for _, path := range []string{"/pay", "/pay/ledger?account=acct_a", "/pay/idem/idem.js"} {
		if resp, body := get(path, "rebind.example:8080"); resp.StatusCode != http.StatusMisdirectedRequest || !strings.Contains(body, "DNS rebinding") {
			t.Errorf("GET %s with a host name: %d %s, want 421 naming DNS rebinding", path, resp.StatusCode, body)
		}
	}

	ledger := func(query string) []refapp.LedgerRow {
		t.Helper()
		resp, body := get("/pay/ledger?"+query, "")
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("ledger?%s: %d %s", query, resp.StatusCode, body)
		}
		var out struct{ Rows []refapp.LedgerRow }
		if err := json.Unmarshal([]byte(body), &out); err != nil {
			t.Fatal(err)
		}
		return out.Rows
	}
	if rows := ledger("account=acct_a"); len(rows) != 2 || rows[0].Key != "k-1" || rows[1].AmountCents != 99 {
		t.Errorf("ledger of acct_a: %+v", rows)
	}
	if rows := ledger("key=k-1"); len(rows) != 1 || rows[0].Account != "acct_a" {
		t.Errorf("ledger of k-1 without a scope: %+v", rows)
	}
	if rows := ledger("key=k-1&scope=tenant"); len(rows) != 1 || rows[0].Account != "acct_b" {
		t.Errorf("ledger of k-1 in scope tenant: %+v", rows)
	}
	if rows := ledger("account=nobody"); rows == nil || len(rows) != 0 {
		t.Errorf("ledger of an unknown account: %#v, want an empty list", rows)
	}
	for _, q := range []string{"", "key=k-1&account=acct_a", "key=" + strings.Repeat("x", 300)} {
		if resp, body := get("/pay/ledger?"+q, ""); resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "invalid_request") {
			t.Errorf("ledger?%s: %d %s, want 400", q, resp.StatusCode, body)
		}
	}
}

// Without Config.PayPage there is no page; with it, the ingress must be there.
func TestPayPageOff(t *testing.T) {
	t.Parallel()
	env := newAppEnv(t)
	svc := refapptest.Start(t, env.DB.Pool, env.NC, refapp.Config{HTTPAddr: "127.0.0.1:0"})
	resp, err := http.Get("http://" + svc.Addr() + "/pay")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET /pay without PayPage: %d, want 404", resp.StatusCode)
	}
	_, err = refapp.Start(context.Background(), env.DB.Pool, env.NC, refapp.Config{HTTPAddr: "127.0.0.1:0", PayPage: true, DisableIngress: true})
	if err == nil || !strings.Contains(err.Error(), "ingress") {
		t.Errorf("PayPage without the ingress: %v, want an error naming the ingress", err)
	}
}
