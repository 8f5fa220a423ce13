package refapp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/refapptest"
	"github.com/idemkit/idem/client"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/internal/testkit/smtptest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// service is one test's running reference application.
type service struct {
	env *testenv.Env
	svc *refapp.Service
}

func setup(t *testing.T) *service {
	t.Helper()
	t.Parallel()
	return &service{env: testenv.New(t)}
}

// config is the application with test timings.
func (s *service) config() refapp.Config {
	return refapp.Config{HTTPAddr: "127.0.0.1:0", Charges: consumer.Config{AckWait: 2 * time.Second}}
}

func (s *service) start(t *testing.T, cfg refapp.Config) *refapp.Service {
	t.Helper()
	svc := refapptest.Start(t, s.env.DB.Pool, s.env.NC, cfg)
	s.svc = svc
	return svc
}

func (s *service) url(path string) string { return "http://" + s.svc.Addr() + path }

// client returns a client of the service whose requests go through transport, and
// its journal.
func (s *service) client(t *testing.T, transport http.RoundTripper) (*client.Client, *client.Journal) {
	t.Helper()
	j, err := client.OpenJournal(filepath.Join(t.TempDir(), "journal"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.Close() })
	c, err := client.New(client.Config{
		Store: j, BaseURL: s.url(""), HTTPClient: &http.Client{Transport: transport},
		BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	return c, j
}

// dropFirstResponse loses the first response on the way back: it is received in
// full, then discarded as if the network had lost it. onDrop, if set, runs with the
// request's key once it has been dropped.
type dropFirstResponse struct {
	dropped bool // the client sends one request at a time
	onDrop  func(idem.Key) error
}

func (d *dropFirstResponse) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err != nil || d.dropped {
		return resp, err
	}
	d.dropped = true
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if d.onDrop != nil {
		if err := d.onDrop(idem.Key(r.Header.Get(idem.HeaderKey))); err != nil {
			return nil, err
		}
	}
	return nil, fmt.Errorf("response %d dropped by the test", resp.StatusCode)
}

// settled waits until every key has been consumed (its inbox row committed with the
// ledger row it guards), so that counting ledger rows afterwards is final.
func (s *service) settled(t *testing.T, keys ...idem.Key) {
	t.Helper()
	for _, k := range keys {
		testenv.Eventually(t, 45*time.Second, "key "+string(k)+" consumed", func() bool {
			return s.env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'charges' AND key = $1`, string(k)) == 1
		})
	}
}

func postJSON(t *testing.T, url, key, body string, header map[string]string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set(idem.HeaderKey, key)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body) //nolint:errcheck
	resp.Body.Close()
	return resp
}

// docs/OPERATIONS.md's "See it hold" check, automated: the first response is
// dropped, the client retries with the same key, the server replays, and exactly
// one ledger row lands.
func TestDroppedResponseLandsOneLedgerRow(t *testing.T) {
	s := setup(t)
	s.start(t, s.config())
	c, _ := s.client(t, &dropFirstResponse{})
	res, err := c.Submit(context.Background(), client.Request{
		Path: "/v1/payments", Body: []byte(`{"account":"acct_drop","amount_cents":1250}`),
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != client.IntentDone || res.Attempts != 2 || !res.Replayed {
		t.Fatalf("result = %+v, want done after 2 attempts with a replayed answer", res)
	}
	s.settled(t, res.Key)
	if n := s.env.DB.Count(t, `SELECT count(*) FROM ledger_entries WHERE account = 'acct_drop'`); n != 1 {
		t.Fatalf("ledger rows = %d, want 1", n)
	}
	if n := s.env.DB.Count(t, `SELECT count(*) FROM payments WHERE account = 'acct_drop'`); n != 1 {
		t.Fatalf("payments rows = %d, want 1", n)
	}
}

// The negative control: the journaled key is wiped before the retry, so a new key
// is minted and the one intent becomes two charges. If this ever lands one row, the
// test above proves nothing.
func TestForgottenKeyLandsTwoLedgerRows(t *testing.T) {
	s := setup(t)
	s.start(t, s.config())
	drop := &dropFirstResponse{}
	c, j := s.client(t, drop)
	drop.onDrop = j.Forget
	req := client.Request{Path: "/v1/payments", Body: []byte(`{"account":"acct_forget","amount_cents":1250}`)}
	first, err := c.Submit(context.Background(), req)
	if !errors.Is(err, client.ErrUnknownIntent) {
		t.Fatalf("first submit: %+v, %v; want the client to find its key gone", first, err)
	}
	// The app has lost the key, so the user's retry is a new intent.
	res, err := c.Submit(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != client.IntentDone || res.Key == first.Key {
		t.Fatalf("result = %+v, want done with a second, freshly minted key", res)
	}
	s.settled(t, res.Key, first.Key)
	if n := s.env.DB.Count(t, `SELECT count(*) FROM ledger_entries WHERE account = 'acct_forget'`); n != 2 {
		t.Fatalf("ledger rows = %d, want 2 (the forgotten key is a second intent)", n)
	}
}

// Graceful shutdown under load loses nothing: a worker shut down mid-stream
// finishes its batches; a new worker on the same database and JetStream store
// processes the rest; every key lands exactly once.
func TestGracefulShutdownUnderLoadLosesNothing(t *testing.T) {
	s := setup(t)
	const n = 5000
	ctx := context.Background()
	ob := outbox.New(appInstall(t, s.env, nil))
	err := pgx.BeginFunc(ctx, s.env.DB.Pool, func(tx pgx.Tx) error {
		msgs := make([]idem.Message, n)
		for i := range msgs {
			msgs[i] = idem.Message{Key: fmt.Sprintf("shut-%05d", i), Subject: refapp.SubjectCharge,
				Payload: fmt.Appendf(nil, `{"account":"acct_shut","amount_cents":%d}`, i+1)}
		}
		return ob.Enqueue(ctx, tx, msgs...)
	})
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.config()
	cfg.Charges.BatchSize = 10
	first, err := refapp.Start(ctx, s.env.DB.Pool, s.env.NC, cfg)
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "some charges processed", func() bool {
		return s.env.DB.Count(t, `SELECT count(*) FROM ledger_entries`) > 0
	})
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := first.Shutdown(sctx); err != nil {
		t.Fatalf("graceful shutdown: %v", err)
	}
	midway := s.env.DB.Count(t, `SELECT count(*) FROM ledger_entries`)
	if midway == 0 || midway >= n {
		t.Fatalf("ledger rows when the first worker stopped: %d of %d; the shutdown did not happen mid-stream, so this run proves nothing", midway, n)
	}
	t.Logf("ledger rows when the first worker stopped: %d of %d", midway, n)

	s.start(t, s.config()) // same database, same JetStream store
	testenv.Eventually(t, 90*time.Second, "all charges processed", func() bool {
		return s.env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'charges'`) == n
	})
	if got := s.env.DB.Count(t, `SELECT count(*) FROM ledger_entries`); got != n {
		t.Fatalf("ledger rows = %d, want %d", got, n)
	}
	if got := s.env.DB.Count(t, `SELECT count(DISTINCT idempotency_key) FROM ledger_entries`); got != n {
		t.Fatalf("distinct keys = %d, want %d", got, n)
	}
}

// The worker refuses to start when the inbox would forget keys the stream can still
// redeliver, and says which numbers are wrong.
func TestRefusesToStartWithBadLifetimes(t *testing.T) {
	s := setup(t)
	cfg := s.config()
	cfg.Stream.MaxAge = 7 * 24 * time.Hour
	cfg.Charges.KeyLifetime = 48 * time.Hour
	_, err := refapp.Start(context.Background(), s.env.DB.Pool, s.env.NC, cfg)
	if err == nil {
		t.Fatal("started with an inbox lifetime shorter than the stream's MaxAge")
	}
	for _, want := range []string{"refusing to start", "consumer charges", "inbox key lifetime 48h0m0s", "MaxAge 168h0m0s"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

// POST /v1/emails through the whole worker: the same key sent three times is one
// email on a real SMTP socket, with the Message-ID derived from the scoped key.
func TestEmailThroughTheWorkerSendsOnce(t *testing.T) {
	s := setup(t)
	sink := smtptest.Start(t)
	cfg := s.config()
	cfg.Email.Addr = sink.Addr()
	s.start(t, cfg)

	body := `{"to":"a@example.com","subject":"Receipt","body":"Thanks"}`
	hdr := map[string]string{idem.HeaderScope: "tenant-a"}
	for range 3 {
		if r := postJSON(t, s.url("/v1/emails"), "k-mail", body, hdr); r.StatusCode != http.StatusAccepted {
			t.Fatalf("status %d", r.StatusCode)
		}
	}
	scoped := idem.ScopedKey("tenant-a", "k-mail")
	testenv.Eventually(t, 45*time.Second, "the email consumer to complete the key", func() bool {
		return s.env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'emails' AND key = $1 AND status = 'done'`, scoped) == 1
	})
	if n := sink.Deliveries(); n != 1 {
		t.Fatalf("SMTP deliveries = %d, want 1", n)
	}
	if n := sink.DeliveriesOf(refapp.MessageID(scoped)); n != 1 {
		t.Fatalf("deliveries with Message-ID %s = %d, want 1", refapp.MessageID(scoped), n)
	}
}

const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"

// The trace context of the HTTP request travels through the outbox headers to the
// consumer's span, and /metrics counts what happened.
func TestTraceContextAndMetrics(t *testing.T) {
	s := setup(t)
	rec := tracetest.NewSpanRecorder()
	cfg := s.config()
	cfg.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	s.start(t, cfg)

	hdr := map[string]string{"traceparent": "00-" + traceID + "-00f067aa0ba902b7-01"}
	body := `{"account":"acct_trace","amount_cents":5}`
	if r := postJSON(t, s.url("/v1/payments"), "k-trace", body, hdr); r.StatusCode != http.StatusAccepted {
		t.Fatalf("status %d", r.StatusCode)
	}
	if r := postJSON(t, s.url("/v1/payments"), "k-trace", body, hdr); r.Header.Get(idem.HeaderReplayed) != "true" {
		t.Fatalf("second request not replayed")
	}
	s.settled(t, "k-trace")

	var headers string
	if err := s.env.DB.Pool.QueryRow(t.Context(), `SELECT headers::text FROM idem_outbox WHERE key = 'k-trace'`).Scan(&headers); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(headers, traceID) {
		t.Errorf("outbox headers %s do not carry the request's trace id", headers)
	}
	// The relay ends its publish span once the stream has acknowledged the batch,
	// which may be after the consumer has already processed the message: wait for both.
	testenv.Eventually(t, 45*time.Second, "the consumer span in the request's trace and the relay's publish span", func() bool {
		var processed, published bool
		for _, sp := range rec.Ended() {
			processed = processed || strings.HasPrefix(sp.Name(), "process ") && sp.SpanContext().TraceID().String() == traceID
			published = published || sp.Name() == "publish "+refapp.SubjectCharge
		}
		return processed && published
	})
	// The whole chain, by the messaging conventions: the HTTP server span named by
	// its route, the enqueue span in the request's trace, the relay's publish span
	// linked to it, and the process span its child.
	byName := map[string]sdktrace.ReadOnlySpan{}
	servers := map[trace.SpanID]bool{} // the first request's and the replay's
	for _, sp := range rec.Ended() {
		if sp.SpanContext().TraceID().String() == traceID || sp.Name() == "publish "+refapp.SubjectCharge {
			byName[sp.Name()] = sp
		}
		if sp.Name() == "POST /v1/payments" {
			servers[sp.SpanContext().SpanID()] = true
		}
	}
	server, enqueue, publish, process := byName["POST /v1/payments"], byName["enqueue "+refapp.SubjectCharge],
		byName["publish "+refapp.SubjectCharge], byName["process "+refapp.SubjectCharge]
	if server == nil || enqueue == nil || publish == nil || process == nil {
		var names []string
		for _, sp := range rec.Ended() {
			names = append(names, sp.Name())
		}
		t.Fatalf("spans %q: want the server, enqueue, publish and process spans", names)
	}
	if server.SpanKind() != trace.SpanKindServer || enqueue.SpanKind() != trace.SpanKindProducer ||
		publish.SpanKind() != trace.SpanKindProducer || process.SpanKind() != trace.SpanKindConsumer {
		t.Errorf("span kinds: server %v, enqueue %v, publish %v, process %v", server.SpanKind(), enqueue.SpanKind(), publish.SpanKind(), process.SpanKind())
	}
	if !servers[enqueue.Parent().SpanID()] || process.Parent().SpanID() != enqueue.SpanContext().SpanID() {
		t.Errorf("parents: enqueue's %s (want a POST /v1/payments server span), process's %s (want the enqueue span %s)",
			enqueue.Parent().SpanID(), process.Parent().SpanID(), enqueue.SpanContext().SpanID())
	}
	linked := false
	for _, l := range publish.Links() {
		linked = linked || l.SpanContext.SpanID() == enqueue.SpanContext().SpanID()
	}
	if !linked {
		t.Errorf("the publish span has no link to the message's enqueue span")
	}
	for _, sp := range []sdktrace.ReadOnlySpan{enqueue, publish, process} {
		attrs := map[string]string{}
		for _, a := range sp.Attributes() {
			attrs[string(a.Key)] = a.Value.Emit()
		}
		if attrs["messaging.system"] != "nats" || attrs["messaging.destination.name"] != refapp.SubjectCharge || attrs["messaging.operation.type"] == "" {
			t.Errorf("span %q attributes %v: want messaging.system nats, the subject and an operation type", sp.Name(), attrs)
		}
	}

	wants := []string{
		`idem_consumer_messages_total{consumer="charges",outcome="processed"} 1`,
		`idem_ingress_requests_total{outcome="new"} 1`,
		`idem_ingress_requests_total{outcome="replayed"} 1`,
		`idem_outbox_pending_rows 0`,
		`idem_relay_messages_total{outcome="published"} 1`,
		`idem_relay_batch_duration_seconds_count`,
	}
	// The relay counts its batch after its own commit, which may come after the
	// consumer has already processed the message: wait for the figures to settle.
	var missing []string
	testenv.Eventually(t, 20*time.Second, "the metrics to show the request's path", func() bool {
		missing = missing[:0]
		text := scrape(t, s.url("/metrics"))
		for _, want := range wants {
			if !strings.Contains(text, want) {
				missing = append(missing, want)
			}
		}
		return len(missing) == 0
	})
}

func scrape(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return string(raw)
}

// /readyz follows the roles: while the broker is away a service with the ingress
// stays ready (its intents wait in the outbox) and /healthz names the broker's
// state; one without the ingress answers 503 naming NATS. Neither echoes a
// driver's error.
func TestReadyz(t *testing.T) {
	s := setup(t)
	broker := natstest.Start(t)
	nc, err := nats.Connect(broker.URL(), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	ingress := refapptest.Start(t, s.env.DB.Pool, nc, s.config())
	cfg := s.config()
	cfg.DisableIngress, cfg.DisableRetention = true, true
	consumers := refapptest.Start(t, s.env.DB.Pool, nc, cfg)
	get := func(svc *refapp.Service, path string) (int, string) {
		resp, err := http.Get("http://" + svc.Addr() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	for _, svc := range []*refapp.Service{ingress, consumers} {
		if code, body := get(svc, "/readyz"); code != http.StatusOK {
			t.Fatalf("/readyz = %d %s", code, body)
		}
	}
	broker.Stop()
	testenv.Eventually(t, 45*time.Second, "/readyz of the service without the ingress to report NATS down", func() bool {
		code, body := get(consumers, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "nats: ")
	})
	if code, body := get(ingress, "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz of the ingress with the broker away = %d %s, want 200", code, body)
	}
	if code, body := get(ingress, "/healthz"); code != http.StatusOK || !strings.Contains(body, "nats: reconnecting") {
		t.Errorf("/healthz of the ingress with the broker away = %d %s, want 200 naming the broker's state", code, body)
	}
}

// C1 as users met it: a body just under 1 MiB of valid JSON was answered 202, and
// its message could never be published (NATS max_payload counts the headers too).
// Now the ingress refuses it with 413 before anything is claimed or written; a
// body that fits is accepted and reaches the ledger.
func TestBodyTheBrokerCannotCarryIs413(t *testing.T) {
	s := setup(t)
	s.start(t, s.config())
	padded := func(total int) string {
		head, tail := `{"account":"`, `","amount_cents":1}`
		return head + strings.Repeat("a", total-len(head)-len(tail)) + tail
	}
	for _, size := range []int{1_048_470, 1_048_500, 1_048_576} {
		req, _ := http.NewRequest(http.MethodPost, s.url("/v1/payments"), strings.NewReader(padded(size)))
		req.Header.Set(idem.HeaderKey, fmt.Sprintf("k-big-%d", size))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Errorf("%d-byte body: %d %s, want 413", size, resp.StatusCode, body)
		}
	}
	if n := s.env.DB.Count(t, `SELECT (SELECT count(*) FROM idem_requests) + (SELECT count(*) FROM idem_outbox) + (SELECT count(*) FROM payments)`); n != 0 {
		t.Errorf("%d rows written for refused bodies, want none", n)
	}
	// Well under the limit: accepted and charged.
	if r := postJSON(t, s.url("/v1/payments"), "k-fits", padded(900_000), nil); r.StatusCode != http.StatusAccepted {
		t.Fatalf("900 kB body: %d", r.StatusCode)
	}
	s.settled(t, "k-fits")
	if n := ledgerRows(t, s.env, "k-fits"); n != 1 {
		t.Errorf("ledger rows for the body that fits = %d, want 1", n)
	}
}

// The HTTP server bounds what one client can hold. A client that trickles its
// body is cut off at ReadTimeout; a header block over MaxHeaderBytes is refused.
func TestHTTPServerBoundsSlowAndLargeClients(t *testing.T) {
	s := setup(t)
	cfg := s.config()
	cfg.HTTP = refapp.HTTPConfig{ReadTimeout: 500 * time.Millisecond, MaxHeaderBytes: 4 << 10}
	s.start(t, cfg)

	conn, err := net.Dial("tcp", s.svc.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-slow\r\nContent-Length: 100\r\n\r\n{")
	start := time.Now()
	_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	buf := make([]byte, 1024)
	for {
		if _, err := conn.Read(buf); err != nil {
			break // closed by the server (or an error answer then closed)
		}
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("a trickling client held its connection for %s; ReadTimeout is 500ms", took)
	}

	req, _ := http.NewRequest(http.MethodPost, s.url("/v1/payments"), strings.NewReader(`{"account":"a","amount_cents":1}`))
	req.Header.Set(idem.HeaderKey, "k-headers")
	req.Header.Set("X-Padding", strings.Repeat("p", 8<<10))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("8 KiB of headers: %d, want 431", resp.StatusCode)
	}
}

// With MetricsAddr, /metrics moves to a listener of its own (with idem_build_info
// among its series) and leaves the API's address.
func TestMetricsOnTheirOwnListener(t *testing.T) {
	s := setup(t)
	cfg := s.config()
	cfg.MetricsAddr = "127.0.0.1:0"
	svc := s.start(t, cfg)
	if svc.MetricsAddr() == "" || svc.MetricsAddr() == svc.Addr() {
		t.Fatalf("MetricsAddr = %q (API on %q), want a listener of its own", svc.MetricsAddr(), svc.Addr())
	}
	get := func(url string) (int, string) {
		t.Helper()
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := get("http://" + svc.MetricsAddr() + "/metrics")
	if code != http.StatusOK || !strings.Contains(body, "idem_build_info{") || !strings.Contains(body, "idem_ingress_request_duration_seconds") {
		t.Fatalf("metrics listener: %d, idem_build_info and the ingress histogram present: %v %v", code,
			strings.Contains(body, "idem_build_info{"), strings.Contains(body, "idem_ingress_request_duration_seconds"))
	}
	if code, _ := get(s.url("/metrics")); code != http.StatusNotFound {
		t.Errorf("/metrics on the API address: %d, want 404", code)
	}
	if code, _ := get(s.url("/healthz")); code != http.StatusOK {
		t.Errorf("/healthz on the API address: %d, want 200", code)
	}
}
