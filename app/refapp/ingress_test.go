package refapp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/producer"
)

// newDB is a fresh database with idem's schema and the application's tables.
func newDB(t *testing.T) *pgtest.DB {
	t.Helper()
	db := pgtest.New(t)
	if err := refapp.Migrate(context.Background(), db.Pool); err != nil {
		t.Fatal(err)
	}
	return db
}

// answer is one HTTP response, read in full.
type answer struct {
	status   int
	replayed bool
	body     []byte
}

// newServer serves the ingress on a real listener, so requests cross net/http
// exactly as in production.
func newServer(t *testing.T, db *pgtest.DB, cfg producer.Config) (*httptest.Server, *http.Client) {
	t.Helper()
	cfg.ScopeFromHeader = true // as the application runs it (refapp.Config.WorkerConfig)
	// No broker: the ingress only writes the outbox.
	inst, err := install.New(db.Pool, nil, refapp.Config{}.InstallConfig())
	if err != nil {
		t.Fatal(err)
	}
	mw, err := producer.NewMiddleware(inst, cfg)
	if err != nil {
		t.Fatalf("NewMiddleware: %v", err)
	}
	srv := httptest.NewServer(refapp.Routes(mw, nil))
	t.Cleanup(srv.Close)
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	return srv, &http.Client{Transport: tr, Timeout: time.Minute}
}

func post(t *testing.T, c *http.Client, url, key, scope, body string) answer {
	t.Helper()
	r, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Error(err)
		return answer{}
	}
	r.Header.Set("Content-Type", "application/json")
	if key != "" {
		r.Header.Set(idem.HeaderKey, key)
	}
	if scope != "" {
		r.Header.Set(idem.HeaderScope, scope)
	}
	resp, err := c.Do(r)
	if err != nil {
		t.Error(err) // Error, not Fatal: post runs in goroutines
		return answer{}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Error(err)
	}
	return answer{status: resp.StatusCode, replayed: resp.Header.Get(idem.HeaderReplayed) == "true", body: b}
}

// outboxRow is one idem_outbox row.
type outboxRow struct {
	key, subject string
	payload      []byte
}

func outboxRows(t *testing.T, db *pgtest.DB) []outboxRow {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT key, subject, payload FROM idem_outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []outboxRow
	for rows.Next() {
		var r outboxRow
		if err := rows.Scan(&r.key, &r.subject, &r.payload); err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestIngressFiftyConcurrentDuplicates fires the same intent 50 times at once, as a
// client retrying in a tight loop or a double-clicking user with one journaled key
// would. Exactly one payment and one outbox message may come out of it, and all 50
// callers must see the same answer.
func TestIngressFiftyConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	// A generous Wait: this test is about folding duplicates, not about the timeout,
	// and a slow -race run must not turn waits into 409s.
	srv, client := newServer(t, db, producer.Config{Wait: 30 * time.Second})

	const n = 50
	body := `{"account":"acct_1","amount_cents":1250}`
	key := string(idem.NewKey())
	answers := make([]answer, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start // release all at once, to maximise the overlap
			answers[i] = post(t, client, srv.URL+"/v1/payments", key, "", body)
		})
	}
	close(start)
	wg.Wait()

	replayed := 0
	for i, a := range answers {
		if a.status != http.StatusAccepted {
			t.Fatalf("answer %d: status %d, body %s", i, a.status, a.body)
		}
		if !bytes.Equal(a.body, answers[0].body) {
			t.Errorf("answer %d: body %s differs from %s", i, a.body, answers[0].body)
		}
		if a.replayed {
			replayed++
		}
	}
	if replayed != n-1 {
		t.Errorf("%d answers replayed, want %d", replayed, n-1)
	}
	var resp refapp.PaymentResponse
	if err := json.Unmarshal(answers[0].body, &resp); err != nil || resp.Key != key || resp.PaymentID == 0 || resp.Status != "accepted" {
		t.Errorf("response %s (%v), want key %q, a payment id and status accepted", answers[0].body, err, key)
	}
	if got := db.Count(t, `SELECT count(*) FROM payments`); got != 1 {
		t.Errorf("payments: %d rows, want 1", got)
	}
	rows := outboxRows(t, db)
	if len(rows) != 1 {
		t.Fatalf("idem_outbox: %d rows, want 1", len(rows))
	}
	if rows[0].key != key || rows[0].subject != refapp.SubjectCharge || string(rows[0].payload) != body {
		t.Errorf("outbox row %+v, want key %q, subject %s, the request body as payload", rows[0], key, refapp.SubjectCharge)
	}
}

// TestIngressScopeIsolation is a security property: two tenants that happen to pick
// the same key are two intents. Each gets its own payment and its own outbox message
// under its own scoped key, and neither is ever answered with the other's response.
func TestIngressScopeIsolation(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	srv, client := newServer(t, db, producer.Config{})
	url := srv.URL + "/v1/payments"
	const key = "order-1" // a guessable key, as a careless client might choose

	bodyA := `{"account":"acct_a","amount_cents":100}`
	bodyB := `{"account":"acct_b","amount_cents":100}`
	a1 := post(t, client, url, key, "tenant-a", bodyA)
	b1 := post(t, client, url, key, "tenant-b", bodyB)
	if a1.status != http.StatusAccepted || b1.status != http.StatusAccepted {
		t.Fatalf("statuses %d, %d; want 202, 202", a1.status, b1.status)
	}
	if b1.replayed || bytes.Equal(a1.body, b1.body) {
		t.Fatalf("tenant-b received tenant-a's response: %s", b1.body)
	}
	// Identical bodies too: the fingerprint namespace is per scope as well, so
	// tenant-b's equal request is neither a 422 nor a replay of tenant-a's.
	b2 := post(t, client, url, "order-2", "tenant-b", bodyA)
	a2 := post(t, client, url, "order-2", "tenant-a", bodyA)
	if b2.status != http.StatusAccepted || a2.status != http.StatusAccepted || a2.replayed || bytes.Equal(a2.body, b2.body) {
		t.Fatalf("same key and body in two scopes: %d %s / %d %s replayed=%v", b2.status, b2.body, a2.status, a2.body, a2.replayed)
	}

	// Retries replay within their own scope only.
	for _, tc := range []struct {
		scope, body string
		want        answer
	}{{"tenant-a", bodyA, a1}, {"tenant-b", bodyB, b1}} {
		got := post(t, client, url, key, tc.scope, tc.body)
		if !got.replayed || !bytes.Equal(got.body, tc.want.body) {
			t.Errorf("%s retry: %s replayed=%v, want its own first answer %s", tc.scope, got.body, got.replayed, tc.want.body)
		}
	}
	// Scoping does not weaken the payload check within a scope.
	if got := post(t, client, url, key, "tenant-b", bodyA); got.status != http.StatusUnprocessableEntity {
		t.Errorf("tenant-b reusing its own key with another body: %d, want 422", got.status)
	}

	if got := db.Count(t, `SELECT count(*) FROM payments WHERE idempotency_key = $1`, key); got != 2 {
		t.Errorf("payments for %q: %d, want 2", key, got)
	}
	if got := db.Count(t, `SELECT count(DISTINCT scope) FROM payments WHERE idempotency_key = $1`, key); got != 2 {
		t.Errorf("payments for %q span %d scopes, want 2", key, got)
	}
	want := map[string]string{
		idem.ScopedKey("tenant-a", key): bodyA,
		idem.ScopedKey("tenant-b", key): bodyB,
	}
	got := map[string]string{}
	for _, r := range outboxRows(t, db) {
		scope, k, err := idem.ParseScopedKey(r.key)
		if err != nil {
			t.Errorf("outbox key %q: %v", r.key, err)
		}
		if string(k) == key {
			got[r.key] = string(r.payload)
			if scope == "" {
				t.Errorf("outbox message with the bare key %q: tenants would fold on the broker", r.key)
			}
		}
	}
	if len(got) != 2 || got[idem.ScopedKey("tenant-a", key)] != want[idem.ScopedKey("tenant-a", key)] ||
		got[idem.ScopedKey("tenant-b", key)] != want[idem.ScopedKey("tenant-b", key)] {
		t.Errorf("outbox messages for %q: %q, want %q", key, got, want)
	}
}

// TestIngressEmail: the email route writes its row and a message on the email
// subject whose payload is the request body byte for byte.
func TestIngressEmail(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	srv, client := newServer(t, db, producer.Config{})
	// Odd spacing on purpose: the payload is the body as received, not re-encoded.
	body := `{ "to": "a@example.com",  "subject": "hi", "body": "hello" }`
	a := post(t, client, srv.URL+"/v1/emails", "mail-1", "", body)
	if a.status != http.StatusAccepted {
		t.Fatalf("status %d: %s", a.status, a.body)
	}
	var resp refapp.EmailResponse
	if err := json.Unmarshal(a.body, &resp); err != nil || resp.Key != "mail-1" || resp.EmailID == 0 || resp.Status != "accepted" {
		t.Errorf("response %s (%v)", a.body, err)
	}
	if got := db.Count(t, `SELECT count(*) FROM emails WHERE recipient = 'a@example.com' AND subject = 'hi' AND idempotency_key = 'mail-1'`); got != 1 {
		t.Errorf("emails: %d matching rows, want 1", got)
	}
	rows := outboxRows(t, db)
	if len(rows) != 1 || rows[0].subject != refapp.SubjectEmail || rows[0].key != "mail-1" || string(rows[0].payload) != body {
		t.Errorf("outbox %+v, want one %s message with the body as payload", rows, refapp.SubjectEmail)
	}
}

// TestIngressValidation: bad requests get 400 with a reason and write no business
// row and no message. The 400 is the request's final answer and is replayed.
func TestIngressValidation(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	srv, client := newServer(t, db, producer.Config{})
	cases := []struct {
		name, path, body, reason string
		code                     string // default invalid_request
	}{
		{"unknown field", "/v1/payments", `{"account":"a","amount_cents":1,"amount":5}`, `unknown field "amount"`, ""},
		{"zero amount", "/v1/payments", `{"account":"a","amount_cents":0}`, "amount_cents", ""},
		{"negative amount", "/v1/payments", `{"account":"a","amount_cents":-5}`, "amount_cents", ""},
		{"fractional amount", "/v1/payments", `{"account":"a","amount_cents":1.5}`, "amount_cents", ""},
		{"missing account", "/v1/payments", `{"amount_cents":100}`, "account", ""},
		{"blank account", "/v1/payments", `{"account":"  ","amount_cents":100}`, "account", ""},
		{"not JSON", "/v1/payments", `account=a`, "not a valid JSON", ""},
		{"empty body", "/v1/payments", ``, "not a valid JSON", ""},
		{"trailing data", "/v1/payments", `{"account":"a","amount_cents":1}{}`, "after the JSON object", ""},
		{"email without @", "/v1/emails", `{"to":"nobody","subject":"s","body":"b"}`, `"to"`, ""},
		// The consumer would dead-letter these (one address, RFC 5322): the ingress
		// applies the same rule, so a 202 is always an email that can be sent.
		{"email to two recipients", "/v1/emails", `{"to":"a@example.com, b@example.com","subject":"s","body":"b"}`, `"to" must be one email address`, ""},
		{"email to a broken address", "/v1/emails", `{"to":"a@b@c","subject":"s","body":"b"}`, `"to" must be one email address`, ""},
		{"email unknown field", "/v1/emails", `{"to":"a@b","cc":"c@d"}`, `unknown field "cc"`, ""},
		// Text a Postgres text column cannot hold is refused here, not by the INSERT
		// with a 500 (or by the consumer, after retries).
		{"NUL in the account", "/v1/payments", `{"account":"a\u0000","amount_cents":1}`, `"account" holds a NUL`, "invalid_text"},
		{"invalid UTF-8", "/v1/payments", "{\"account\":\"a\xff\",\"amount_cents\":1}", "not valid UTF-8", "invalid_text"},
		{"NUL in the subject", "/v1/emails", `{"to":"a@example.com","subject":"s\u0000","body":"b"}`, `"subject" holds a NUL`, "invalid_text"},
		{"NUL in the email's body", "/v1/emails", `{"to":"a@example.com","subject":"s","body":"\u0000"}`, `"body" holds a NUL`, "invalid_text"},
		{"NUL in the recipient", "/v1/emails", `{"to":"a@example.com\u0000","subject":"s","body":"b"}`, `"to" holds a NUL`, "invalid_text"},
	}
	for i, tc := range cases {
		key := "bad-" + string(rune('a'+i))
		a := post(t, client, srv.URL+tc.path, key, "", tc.body)
		var e struct{ Error, Code string }
		if tc.code == "" {
			tc.code = "invalid_request"
		}
		if a.status != http.StatusBadRequest || json.Unmarshal(a.body, &e) != nil || e.Code != tc.code || !strings.Contains(e.Error, tc.reason) {
			t.Errorf("%s: %d %s, want 400 %s mentioning %q", tc.name, a.status, a.body, tc.code, tc.reason)
		}
		if again := post(t, client, srv.URL+tc.path, key, "", tc.body); !again.replayed || !bytes.Equal(again.body, a.body) {
			t.Errorf("%s: retry %d %s replayed=%v, want the 400 replayed", tc.name, again.status, again.body, again.replayed)
		}
	}
	if got := db.Count(t, `SELECT (SELECT count(*) FROM payments) + (SELECT count(*) FROM emails) + (SELECT count(*) FROM idem_outbox)`); got != 0 {
		t.Errorf("%d business rows or messages written for bad requests", got)
	}
}

// TestIngressRoutes: requests the mux cannot route are answered without claiming a
// key, so a client's wrong URL does not use its key up; a missing key is 400.
func TestIngressRoutes(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	srv, client := newServer(t, db, producer.Config{})

	if a := post(t, client, srv.URL+"/v1/nowhere", "k1", "", `{}`); a.status != http.StatusNotFound {
		t.Errorf("unknown path: %d, want 404", a.status)
	}
	resp, err := client.Get(srv.URL + "/v1/payments")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("GET /v1/payments: %d, want 405", resp.StatusCode)
	}
	if a := post(t, client, srv.URL+"/v1/payments", "", "", `{"account":"a","amount_cents":1}`); a.status != http.StatusBadRequest {
		t.Errorf("no key: %d, want 400", a.status)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_requests`); got != 0 {
		t.Errorf("idem_requests: %d rows, want 0", got)
	}
	// The key k1 is still free for the real request.
	if a := post(t, client, srv.URL+"/v1/payments", "k1", "", `{"account":"a","amount_cents":1}`); a.status != http.StatusAccepted || a.replayed {
		t.Errorf("first real use of k1: %d replayed=%v", a.status, a.replayed)
	}
}
