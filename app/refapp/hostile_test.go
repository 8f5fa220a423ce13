package refapp_test

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/rawconn"

	"github.com/idemkit/idem/app/refapp"
)

// paymentRequest is a raw POST /v1/payments.
func paymentRequest(key, body string) string {
	return "POST /v1/payments HTTP/1.1\r\nHost: idem\r\nIdempotency-Key: " + key +
		"\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
}

// A request carrying both Content-Length and Transfer-Encoding, with a payment
// hidden in the rest of its declared body, is answered 400 and its connection
// closed, on the API's listener: the hidden payment is never executed, whatever
// route the carrying request names.
func TestSmuggledRequestIsRefused(t *testing.T) {
	s := setup(t)
	s.start(t, s.config())
	for _, outer := range []string{"POST /v1/payments", "GET /healthz"} {
		hidden := paymentRequest("k-hidden", `{"account":"acct_smuggled","amount_cents":100}`)
		body := "0\r\n\r\n" + hidden
		stream := outer + " HTTP/1.1\r\nHost: idem\r\nIdempotency-Key: k-outer\r\nContent-Type: application/json\r\n" +
			"Content-Length: " + strconv.Itoa(len(body)) + "\r\nTransfer-Encoding: chunked\r\n\r\n" + body
		out, closed := rawconn.Exchange(t, s.svc.Addr(), stream, 10*time.Second)
		if !strings.HasPrefix(out, "HTTP/1.1 400 Bad Request\r\n") || strings.Count(out, "HTTP/1.1 ") != 1 {
			t.Errorf("%s: responses %q, want one 400", outer, out)
		}
		if !closed {
			t.Errorf("%s: the connection was left open", outer)
		}
	}
	if n := s.env.DB.Count(t, `SELECT (SELECT count(*) FROM payments) + (SELECT count(*) FROM idem_requests)`); n != 0 {
		t.Fatalf("%d payments or claimed keys: a smuggled request ran", n)
	}
	// The listener still serves honest requests.
	if out, _ := rawconn.Exchange(t, s.svc.Addr(), paymentRequest("k-honest", `{"account":"acct_1","amount_cents":100}`)+
		"GET /healthz HTTP/1.1\r\nHost: idem\r\nConnection: close\r\n\r\n", 10*time.Second); !strings.HasPrefix(out, "HTTP/1.1 202 Accepted\r\n") || strings.Count(out, "HTTP/1.1 200 OK\r\n") != 1 {
		t.Errorf("honest requests after the refusals: %q", out)
	}
}

// Text a Postgres text column cannot hold, sent as raw bytes, is refused at the
// edge (400 invalid_text) and writes nothing, instead of failing in the INSERT.
func TestTextNoColumnCanHoldIsRefused(t *testing.T) {
	s := setup(t)
	s.start(t, s.config())
	for key, body := range map[string]string{
		"k-nul":  `{"account":"a\u0000","amount_cents":1}`,
		"k-utf8": "{\"account\":\"a\xc3\x28\",\"amount_cents\":1}",
	} {
		req := strings.Replace(paymentRequest(key, body), "HTTP/1.1\r\n", "HTTP/1.1\r\nConnection: close\r\n", 1)
		out, _ := rawconn.Exchange(t, s.svc.Addr(), req, 10*time.Second)
		if !strings.HasPrefix(out, "HTTP/1.1 400 Bad Request\r\n") || !strings.Contains(out, `"code":"invalid_text"`) {
			t.Errorf("%s: %q, want 400 invalid_text", key, out)
		}
	}
	if n := s.env.DB.Count(t, `SELECT count(*) FROM payments`); n != 0 {
		t.Errorf("%d payments written", n)
	}
}

// The consumers apply the same rule: a message whose text no column can hold is
// refused by the decoder, which dead-letters it at once.
func TestDecodersRefuseTextNoColumnCanHold(t *testing.T) {
	t.Parallel()
	if _, err := refapp.DecodeCharge([]byte(`{"account":"a\u0000","amount_cents":1}`)); err == nil || !strings.Contains(err.Error(), "NUL") {
		t.Errorf("DecodeCharge with a NUL: %v", err)
	}
	if _, _, err := refapp.DecodeEmail([]byte(`{"to":"a@example.com","subject":"\u0000","body":""}`)); err == nil || !strings.Contains(err.Error(), "NUL") {
		t.Errorf("DecodeEmail with a NUL: %v", err)
	}
}

// The console's token or password must not cross a network in plain HTTP: on a
// listener that is not loopback Start refuses it, saying how to serve it instead,
// unless AllowPlainHTTP says a TLS-terminating proxy is the only way there.
func TestConsoleCredentialsRefusedOverPlainHTTPOffLoopback(t *testing.T) {
	s := setup(t)
	cfg := s.config()
	cfg.MetricsAddr = "0.0.0.0:0" // the console's listener, on every interface
	cfg.Console = refapp.ConsoleConfig{Enabled: true, Token: "t0ken"}
	_, err := refapp.Start(context.Background(), s.env.DB.Pool, s.env.NC, cfg)
	if err == nil || !strings.Contains(err.Error(), "plain HTTP") || !strings.Contains(err.Error(), "127.0.0.1") || !strings.Contains(err.Error(), "--console-allow-plain-http") {
		t.Fatalf("Start with a token on 0.0.0.0: %v; want a refusal saying how to serve the console", err)
	}
	cfg.Console.AllowPlainHTTP = true
	svc := s.start(t, cfg)
	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := noRedirect.Get("http://" + svc.MetricsAddr() + refapp.ConsolePath)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized && resp.StatusCode != http.StatusSeeOther {
		t.Errorf("the console without its token: %d, want it to ask for the token", resp.StatusCode)
	}
}
