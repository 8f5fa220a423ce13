package main

import (
	"bytes"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/rawconn"

	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// Hostile input, as raw bytes on a socket, against the worker binary: a request
// hiding another in the rest of its declared body is answered 400 and its
// connection closed, and the hidden payment never runs; a field holding a NUL,
// or a body that is not UTF-8, is refused with 400 invalid_text instead of
// failing in the INSERT with a 500.
func TestHostileInputAgainstTheWorker(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the worker binary")
	}
	t.Parallel()
	db := pgtest.New(t)
	addr := freeAddr(t)
	cmd := exec.Command(workerBinary(t), "--database-url", db.URL, "--data-dir", t.TempDir(), "--http-addr", addr)
	var logs bytes.Buffer
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	testenv.Eventually(t, 60*time.Second, "the worker to be ready", func() bool {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})

	payment := func(key, body string, extra string) string {
		return "POST /v1/payments HTTP/1.1\r\nHost: idem\r\nIdempotency-Key: " + key + "\r\n" + extra +
			"Content-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
	}

	hidden := payment("k-hidden", `{"account":"acct_smuggled","amount_cents":100}`, "")
	body := "0\r\n\r\n" + hidden
	smuggling := "POST /v1/payments HTTP/1.1\r\nHost: idem\r\nIdempotency-Key: k-outer\r\nContent-Type: application/json\r\n" +
		"Content-Length: " + strconv.Itoa(len(body)) + "\r\nTransfer-Encoding: chunked\r\n\r\n" + body
	out, closed := rawconn.Exchange(t, addr, smuggling, 10*time.Second)
	if !strings.HasPrefix(out, "HTTP/1.1 400 Bad Request\r\n") || strings.Count(out, "HTTP/1.1 ") != 1 || !closed {
		t.Errorf("Content-Length with Transfer-Encoding: responses %q, closed %v; want one 400, then the connection closed", out, closed)
	}

	for key, body := range map[string]string{
		"k-nul":  `{"account":"a\u0000","amount_cents":1}`,
		"k-utf8": "{\"account\":\"a\xff\",\"amount_cents\":1}",
	} {
		out, _ := rawconn.Exchange(t, addr, payment(key, body, "Connection: close\r\n"), 10*time.Second)
		if !strings.HasPrefix(out, "HTTP/1.1 400 Bad Request\r\n") || !strings.Contains(out, `"code":"invalid_text"`) {
			t.Errorf("%s: %q, want 400 invalid_text", key, out)
		}
	}
	// The refused text is a final answer, stored for its key; nothing else is.
	if n := db.Count(t, `SELECT (SELECT count(*) FROM payments) + (SELECT count(*) FROM idem_requests WHERE key IN ('k-outer', 'k-hidden'))`); n != 0 {
		t.Errorf("%d payments, or claims of the smuggling request's keys, after hostile requests only", n)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("worker exit: %v\n%s", err, logs.String())
	}
	if !strings.Contains(logs.String(), "request smuggling") {
		t.Errorf("the refusal was not logged:\n%s", logs.String())
	}
}
