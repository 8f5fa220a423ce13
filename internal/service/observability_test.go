package service_test

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemkit/idem/internal/natstest"
	"github.com/idemkit/idem/internal/testenv"
)

const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"

func post(t *testing.T, url, key, body string, header map[string]string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
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

// The trace context of the HTTP request travels through the outbox headers to the
// consumer's span, and /metrics counts what happened.
func TestTraceContextAndMetrics(t *testing.T) {
	b := setup(t)
	rec := tracetest.NewSpanRecorder()
	cfg := b.config()
	cfg.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	svc := b.start(t, cfg)
	base := "http://" + svc.HTTPAddr()

	hdr := map[string]string{"traceparent": "00-" + traceID + "-00f067aa0ba902b7-01"}
	body := `{"account":"acct_trace","amount_cents":5}`
	if r := post(t, base+"/v1/payments", "k-trace", body, hdr); r.StatusCode != http.StatusAccepted {
		t.Fatalf("status %d", r.StatusCode)
	}
	if r := post(t, base+"/v1/payments", "k-trace", body, hdr); r.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("second request not replayed")
	}
	b.settled(t, "k-trace")

	var headers string
	if err := b.db.Pool.QueryRow(t.Context(), `SELECT headers::text FROM idem_outbox WHERE key = 'k-trace'`).Scan(&headers); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(headers, traceID) {
		t.Errorf("outbox headers %s do not carry the request's trace id", headers)
	}
	testenv.Eventually(t, 45*time.Second, "consumer span in the request's trace", func() bool {
		for _, s := range rec.Ended() {
			if strings.HasPrefix(s.Name(), "idem.consume") && s.SpanContext().TraceID().String() == traceID {
				return true
			}
		}
		return false
	})

	wants := []string{
		`idem_consumer_messages_total{consumer="charges",outcome="processed"} 1`,
		`idem_ingress_requests_total{outcome="new"} 1`,
		`idem_ingress_requests_total{outcome="replayed"} 1`,
		`idem_outbox_pending_rows 0`,
		`idem_relay_messages_total{result="published"} 1`,
		`idem_relay_batch_duration_seconds_count`,
	}
	// The relay counts its batch after its own commit, which may come after the
	// consumer has already processed the message: wait for the figures to settle.
	var missing []string
	deadline := time.Now().Add(10 * time.Second)
	for {
		missing = missing[:0]
		text := scrape(t, base+"/metrics")
		for _, want := range wants {
			if !strings.Contains(text, want) {
				missing = append(missing, want)
			}
		}
		if len(missing) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if len(missing) > 0 {
		t.Errorf("/metrics lacks %q", missing)
	}
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

// /readyz answers 200 while Postgres and NATS answer, and 503 naming NATS when the
// broker goes away.
func TestReadyz(t *testing.T) {
	b := setup(t)
	broker := natstest.Start(t)
	cfg := b.config()
	cfg.NATSURL = broker.URL()
	svc := b.start(t, cfg)
	readyz := func() (int, string) {
		resp, err := http.Get("http://" + svc.HTTPAddr() + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if code, body := readyz(); code != http.StatusOK {
		t.Fatalf("/readyz = %d %s", code, body)
	}
	broker.Stop()
	testenv.Eventually(t, 45*time.Second, "/readyz to report NATS down", func() bool {
		code, body := readyz()
		return code == http.StatusServiceUnavailable && strings.Contains(body, "nats")
	})
}
