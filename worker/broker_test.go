package worker_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/worker"
)

func has(logs *logBuffer, sub string) bool { return strings.Contains(logs.String(), sub) }

// serve is what h answers to GET path.
func serve(h http.Handler, path string) (int, string) {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return rec.Code, rec.Body.String()
}

// metric is the value of the unlabelled gauge or counter name in reg, or -1.
func metric(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			m := f.GetMetric()[0]
			return m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
	}
	return -1
}

// A NATS connection that closes for good (nats.go gave up reconnecting) ends the
// worker: Done closes and Err says what happened and what to do, so the process
// exits and its supervisor starts one that connects anew. A worker left running on
// a closed connection would be unready forever while its ingress took intents that
// no relay publishes.
func TestWorkerEndsWhenItsNATSConnectionCloses(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	// A connection with a small reconnect budget, as nats.Connect's default (60
	// attempts 2s apart) is, only shorter.
	nc, err := nats.Connect(env.NATS.URL(), nats.MaxReconnects(2), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	logs := &logBuffer{}
	icfg := ordersInstall("")
	icfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	// The ingress and the relay: a consumer may happen to fail on the closed
	// connection too, but an ingress has nothing that would.
	cfg := ordersConfig()
	cfg.Consumers = nil
	w, err := worker.New(newInst(t, env.DB.Pool, nc, icfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Stop(context.Background()) })

	env.NATS.Stop() // and it stays away for longer than the connection's budget
	select {
	case <-w.Done():
	case <-time.After(30 * time.Second):
		t.Fatalf("the worker still runs on a closed NATS connection (status %s)\n%s", nc.Status(), logs)
	}
	err = w.Err()
	if err == nil || !strings.Contains(err.Error(), "worker: nats: the connection to the broker closed for good") ||
		!strings.Contains(err.Error(), "nats.MaxReconnects(-1)") {
		t.Fatalf("Err = %v, want the closed connection named, and what to do", err)
	}
	for _, line := range []string{"nats: disconnected from the broker", "nats: the connection to the broker closed for good"} {
		if !has(logs, line) {
			t.Errorf("no log line %q:\n%s", line, logs)
		}
	}
	if code, body := serve(w.ReadyHandler(), "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "component failed") {
		t.Errorf("/readyz = %d %q, want 503 naming the failure", code, body)
	}
}

// Readiness follows the roles. While the broker is away an ingress still takes
// intents into the outbox, so a worker with an ingress stays ready (a readiness
// probe would otherwise take every ingress out of service for the whole outage the
// outbox exists to absorb); /healthz, the metrics and the log show the broker's
// state. A worker without an ingress, whose work is the broker's, is unready. Once
// the broker is back the intents taken meanwhile are published and shipped.
func TestReadinessFollowsTheRolesWhileTheBrokerIsAway(t *testing.T) {
	t.Parallel()
	logs := &logBuffer{}
	icfg := ordersInstall(ordersSchema)
	icfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	o := startOrders(t, icfg, ordersConfig()) // the ingress, the relay and the shipping consumer
	reg := prometheus.NewRegistry()
	if err := o.w.RegisterMetrics(reg); err != nil {
		t.Fatal(err)
	}
	consumers := startConsumersOnly(t, o, ordersConfig())
	for _, w := range []*worker.Worker{o.w, consumers} {
		if code, body := serve(w.ReadyHandler(), "/readyz"); code != http.StatusOK {
			t.Fatalf("/readyz with the broker up = %d %q", code, body)
		}
	}
	if got := metric(t, reg, "idem_nats_connected"); got != 1 {
		t.Errorf("idem_nats_connected = %v with the broker up, want 1", got)
	}

	o.env.NATS.Stop()
	testenv.Eventually(t, 20*time.Second, "the worker to log the disconnect", func() bool {
		return has(logs, "nats: disconnected from the broker")
	})
	if code, body := serve(o.w.ReadyHandler(), "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz of the ingress worker with the broker away = %d %q, want 200: the ingress takes intents into the outbox", code, body)
	}
	if code, body := serve(consumers.ReadyHandler(), "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "nats: reconnecting") {
		t.Errorf("/readyz of the consumer worker with the broker away = %d %q, want 503 naming nats", code, body)
	}
	if code, body := serve(o.w.LiveHandler(), "/healthz"); code != http.StatusOK || !strings.HasPrefix(body, "ok\n") || !strings.Contains(body, "nats: reconnecting") {
		t.Errorf("/healthz with the broker away = %d %q, want 200 with the broker's state", code, body)
	}
	if got := metric(t, reg, "idem_nats_connected"); got != 0 {
		t.Errorf("idem_nats_connected = %v with the broker away, want 0", got)
	}
	key := string(idem.NewKey())
	if code, _ := o.post(t, key, `{"item":"teapot"}`); code != http.StatusCreated {
		t.Fatalf("an order while the broker is away: %d, want 201 (into the outbox)", code)
	}
	if n := o.env.DB.Count(t, `SELECT count(*) FROM orders_idem.idem_outbox WHERE published_at IS NULL`); n != 1 {
		t.Fatalf("%d unpublished outbox rows, want the order's", n)
	}

	o.env.NATS.Restart(t)
	testenv.Eventually(t, 45*time.Second, "the order taken during the outage to be shipped", func() bool {
		return o.env.DB.Count(t, `SELECT count(*) FROM public.shipments WHERE order_key = $1`, key) == 1
	})
	testenv.Eventually(t, 10*time.Second, "the worker to log the reconnect", func() bool {
		return has(logs, "nats: reconnected to the broker")
	})
	if got := metric(t, reg, "idem_nats_connected"); got != 1 {
		t.Errorf("idem_nats_connected = %v after the broker came back, want 1", got)
	}
	if got := metric(t, reg, "idem_nats_reconnects_total"); got < 1 {
		t.Errorf("idem_nats_reconnects_total = %v after a reconnect", got)
	}
	if code, body := serve(consumers.ReadyHandler(), "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz of the consumer worker after the broker came back = %d %q", code, body)
	}
}

// startConsumersOnly starts a second worker of o's installation that runs cfg's
// consumers alone: no ingress, no relay, no collector.
func startConsumersOnly(t *testing.T, o *orders, cfg worker.Config) *worker.Worker {
	t.Helper()
	cfg.Ingress, cfg.DisableRelay, cfg.DisableRetention = nil, true, true
	w, err := worker.New(newInst(t, o.env.DB.Pool, o.env.NC, ordersInstall(ordersSchema)), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Stop(context.Background()) })
	return w
}
