package worker_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/tcpproxy"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/producer"
	"github.com/idemkit/idem/worker"
)

// orders is a user's service built on the public API alone: its own stream
// (ORDERS, orders.>), its own tables (orders, and shipments as the effect of the
// consumer), its own schema for idem's tables, one HTTP route.
type orders struct {
	env *testenv.Env
	w   *worker.Worker
	srv *httptest.Server
}

const ordersSchema = "orders_idem"

const sqlOrdersTables = `
CREATE TABLE orders (id bigserial PRIMARY KEY, idem_key text NOT NULL, item text NOT NULL);
-- No unique constraint on the key: a double effect must be visible as a second row.
CREATE TABLE shipments (id bigserial PRIMARY KEY, order_key text NOT NULL, item text NOT NULL)`

// ship is the user's consumer handler: one shipment row per order, in the inbox
// transaction.
func ship(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
	var o struct {
		Item string `json:"item"`
	}
	if err := json.Unmarshal(d.Payload, &o); err != nil || o.Item == "" {
		return nil, consumer.Permanent(fmt.Errorf("not an order: %q", d.Payload))
	}
	_, err := tx.Exec(ctx, `INSERT INTO public.shipments (order_key, item) VALUES ($1, $2)`, d.Key, o.Item)
	return nil, err
}

// createOrder is the user's HTTP handler, behind the worker's ingress middleware.
func createOrder(w http.ResponseWriter, r *http.Request) {
	in, ok := producer.IntentFrom(r.Context())
	if !ok {
		producer.WriteError(w, http.StatusInternalServerError, "no_intent", "mounted without the middleware")
		return
	}
	body, _ := io.ReadAll(r.Body)
	var o struct {
		Item string `json:"item"`
	}
	if err := json.Unmarshal(body, &o); err != nil || o.Item == "" {
		producer.WriteError(w, http.StatusBadRequest, "invalid_order", "want {\"item\": ...}")
		return
	}
	var id int64
	if err := in.Tx.QueryRow(r.Context(), `INSERT INTO public.orders (idem_key, item) VALUES ($1, $2) RETURNING id`, in.ScopedKey(), o.Item).Scan(&id); err != nil {
		producer.WriteError(w, http.StatusInternalServerError, "db", err.Error())
		return
	}
	if err := in.Enqueue(r.Context(), "orders.created", body, nil); err != nil {
		producer.WriteError(w, http.StatusInternalServerError, "enqueue", err.Error())
		return
	}
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"order_id":%d}`, id)
}

// ordersInstall is the user's installation: its stream, and idem's tables in
// schema (ordersSchema, or "" where testenv migrated them in public).
func ordersInstall(schema string) install.Config {
	return install.Config{Schema: schema, Stream: install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}}}
}

// ordersConfig is what the user's worker runs: the shipping consumer and the ingress.
func ordersConfig() worker.Config {
	return worker.Config{
		Consumers: []consumer.Config{{
			Name: "shipping", Subject: "orders.created", Handler: consumer.HandlerFunc(ship),
			AckWait: 2 * time.Second, Backoff: func(int) time.Duration { return 50 * time.Millisecond },
		}},
		Ingress: &producer.Config{},
	}
}

// newInst is the installation of pool's database and nc's broker described by cfg.
func newInst(t *testing.T, pool *pgxpool.Pool, nc *nats.Conn, cfg install.Config) *install.Installation {
	t.Helper()
	inst, err := install.New(pool, nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return inst
}

// startOrders starts the user's service on a fresh environment: an installation
// described by icfg (ordersInstall(ordersSchema), with its observer or logger),
// running cfg.
func startOrders(t *testing.T, icfg install.Config, cfg worker.Config) *orders {
	t.Helper()
	env := testenv.NewWith(t, pgtest.Options{NoMigrate: true}) // the worker migrates
	if _, err := env.DB.Pool.Exec(context.Background(), sqlOrdersTables); err != nil {
		t.Fatal(err)
	}
	w, err := worker.New(newInst(t, env.DB.Pool, env.NC, icfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := w.Stop(ctx); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", w.Ingress().Wrap(http.HandlerFunc(createOrder)))
	mux.Handle("GET /readyz", w.ReadyHandler())
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return &orders{env: env, w: w, srv: srv}
}

func (o *orders) post(t *testing.T, key, body string) (int, bool) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, o.srv.URL+"/orders", strings.NewReader(body))
	req.Header.Set(idem.HeaderKey, key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, resp.Header.Get(idem.HeaderReplayed) == "true"
}

// The whole path for a user's topology through the public composition root alone:
// stream ORDERS on orders.>, idem's tables in the user's schema, the user's own
// effect table. A retried request and a re-published message each fold: one order,
// one shipment per intent; two intents with the same body are two shipments.
func TestUserTopologyThroughTheCompositionRoot(t *testing.T) {
	t.Parallel()
	out := &testenv.Outcomes{}
	icfg := ordersInstall(ordersSchema)
	icfg.Observer = out.Observe
	o := startOrders(t, icfg, ordersConfig())

	k1, k2 := string(idem.NewKey()), string(idem.NewKey())
	if code, replayed := o.post(t, k1, `{"item":"teapot"}`); code != http.StatusCreated || replayed {
		t.Fatalf("first order: %d replayed=%v", code, replayed)
	}
	if code, replayed := o.post(t, k1, `{"item":"teapot"}`); code != http.StatusCreated || !replayed {
		t.Fatalf("retried order: %d replayed=%v, want the first answer replayed", code, replayed)
	}
	if code, _ := o.post(t, k1, `{"item":"kettle"}`); code != http.StatusUnprocessableEntity {
		t.Fatalf("same key, other body: %d, want 422", code)
	}
	if code, _ := o.post(t, k2, `{"item":"teapot"}`); code != http.StatusCreated {
		t.Fatalf("second intent with the same body: %d", code)
	}
	drained := o.env.DrainedOn(t, "ORDERS", "shipping")
	testenv.Eventually(t, 45*time.Second, "both orders shipped", func() bool {
		return o.env.DB.Count(t, `SELECT count(*) FROM public.shipments`) == 2 && drained()
	})

	// A relay re-publish outside the broker's duplicate window: a new Msg-Id, the
	// same key. The inbox folds it.
	err := pgx.BeginFunc(context.Background(), o.env.DB.Pool, func(tx pgx.Tx) error {
		return o.w.Outbox().Republish(context.Background(), tx, "test-1", "",
			idem.Message{Key: k1, Subject: "orders.created", Payload: []byte(`{"item":"teapot"}`)})
	})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 45*time.Second, "the re-publish folded", func() bool {
		return out.Get(idem.OutcomeDuplicate) >= 1 && drained()
	})
	for key, want := range map[string]int{k1: 1, k2: 1} {
		if n := o.env.DB.Count(t, `SELECT count(*) FROM public.shipments WHERE order_key = $1`, key); n != want {
			t.Errorf("shipments for %s = %d, want %d", key, n, want)
		}
		if n := o.env.DB.Count(t, `SELECT count(*) FROM public.orders WHERE idem_key = $1`, key); n != want {
			t.Errorf("orders for %s = %d, want %d", key, n, want)
		}
	}
	// idem's tables are in the user's schema, not in public.
	if n := o.env.DB.Count(t, `SELECT count(*) FROM orders_idem.idem_inbox WHERE consumer = 'shipping'`); n != 2 {
		t.Errorf("inbox rows in %s = %d, want 2", ordersSchema, n)
	}
	if n := o.env.DB.Count(t, `SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public' AND table_name LIKE 'idem\_%'`); n != 0 {
		t.Errorf("%d idem tables in public, want none", n)
	}
	// The outbox is bound to the stream's subjects.
	err = pgx.BeginFunc(context.Background(), o.env.DB.Pool, func(tx pgx.Tx) error {
		return o.w.Outbox().Enqueue(context.Background(), tx, idem.Message{Key: "k", Subject: "invoices.created", Payload: []byte(`{}`)})
	})
	if !errors.Is(err, idem.ErrBadSubject) {
		t.Errorf("enqueue outside the stream's subjects: %v, want ErrBadSubject", err)
	}
}

// Start refuses, naming the numbers, when a key could be forgotten while its intent
// can still arrive; for each consumer and for the ingress.
func TestStartRefusesBadLifetimes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		mutate func(*install.Config, *worker.Config)
		want   []string
	}{
		{"inbox shorter than the stream's MaxAge", func(i *install.Config, _ *worker.Config) {
			i.Stream.MaxAge = 7 * 24 * time.Hour
		}, []string{"refusing to start", "consumer shipping", "inbox key lifetime 72h0m0s", "MaxAge 168h0m0s"}},
		{"inbox shorter than the redelivery horizon", func(_ *install.Config, c *worker.Config) {
			c.Consumers[0].AckWait = 10 * time.Hour
		}, []string{"consumer shipping", "redelivery horizon"}},
		{"requests shorter than the client's re-send horizon", func(_ *install.Config, c *worker.Config) {
			c.ClientResendHorizon = 60 * time.Hour
		}, []string{"request key lifetime 48h0m0s", "re-send horizon 60h0m0s"}},
		{"ingress alone", func(_ *install.Config, c *worker.Config) {
			c.Consumers = nil
			c.Ingress = &producer.Config{KeyLifetime: time.Hour}
		}, []string{"ingress", "request key lifetime 1h0m0s"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := testenv.New(t)
			icfg, cfg := ordersInstall(""), ordersConfig()
			tc.mutate(&icfg, &cfg)
			w, err := worker.New(newInst(t, env.DB.Pool, env.NC, icfg), cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = w.Start(context.Background())
			if err == nil {
				_ = w.Stop(context.Background())
				t.Fatal("started")
			}
			for _, want := range tc.want {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not mention %q", err, want)
				}
			}
		})
	}
}

// The worker's setup refuses what cannot work, naming it: the installation's
// stream and schema (install.New), the worker's own knobs (worker.New). Neither
// touches a store: the pool and the connection lead nowhere.
func TestNewValidates(t *testing.T) {
	t.Parallel()
	pool, nc := pgtest.Unreachable(t), natstest.Unreachable(t)
	good := ordersConfig()
	for _, tc := range []struct {
		name   string
		mutate func(*install.Config, *worker.Config)
		want   string
	}{
		{"no stream", func(i *install.Config, _ *worker.Config) { i.Stream = install.Stream{} }, "Name is required"},
		{"bad schema", func(i *install.Config, _ *worker.Config) { i.Schema = "Orders" }, "lower-case identifier"},
		{"two consumers, one name", func(_ *install.Config, c *worker.Config) { c.Consumers = append(c.Consumers, c.Consumers[0]) }, `two consumers are named "shipping"`},
		{"consumer without a handler", func(_ *install.Config, c *worker.Config) { c.Consumers[0].Handler = nil }, "exactly one of Handler"},
		{"negative partition slack", func(_ *install.Config, c *worker.Config) { c.Retention.PartitionsAhead = -time.Hour }, "Retention values must not be negative"},
	} {
		icfg, cfg := ordersInstall(ordersSchema), good
		cfg.Consumers = append([]consumer.Config(nil), good.Consumers...)
		tc.mutate(&icfg, &cfg)
		inst, err := install.New(pool, nc, icfg)
		if err == nil {
			_, err = worker.New(inst, cfg)
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to mention %q", tc.name, err, tc.want)
		}
	}
	// The connection has not reached a server yet (RetryOnFailedConnect), so it
	// knows no max_payload: the worker starts with the ingress's default limit.
	if _, err := worker.New(newInst(t, pool, nc, ordersInstall(ordersSchema)), good); err != nil {
		t.Errorf("a good configuration on a connection not yet connected: %v", err)
	}
	if _, err := install.New(nil, nc, ordersInstall(ordersSchema)); err == nil {
		t.Error("a nil pool was accepted")
	}
	if _, err := worker.New(newInst(t, pool, nil, ordersInstall(ordersSchema)), good); err == nil ||
		!strings.Contains(err.Error(), "no NATS connection") {
		t.Errorf("an installation without a NATS connection: err = %v", err)
	}
}

// A component that fails stops the worker: Done closes and Err says which and why,
// so the process can exit non-zero and its supervisor restart it; /readyz says so.
func TestComponentFailureStopsTheWorker(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := context.Background()
	inst := newInst(t, env.DB.Pool, env.NC, ordersInstall(""))
	// Someone else's durable consumer under the same name, with an ack policy that
	// cannot be changed: the worker's consumer cannot take it over and fails.
	if _, err := inst.EnsureStream(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := env.JS.CreateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{Durable: "shipping", AckPolicy: jetstream.AckNonePolicy}); err != nil {
		t.Fatal(err)
	}
	w, err := worker.New(inst, ordersConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-w.Done():
	case <-time.After(45 * time.Second):
		t.Fatal("the worker kept running without its consumer")
	}
	if err := w.Err(); err == nil || !strings.Contains(err.Error(), "consumer shipping") {
		t.Fatalf("Err = %v, want the failed consumer named", err)
	}
	rec := httptest.NewRecorder()
	w.ReadyHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(rec.Body.String(), "component failed") {
		t.Errorf("/readyz = %d %q, want 503 naming the failure", rec.Code, rec.Body.String())
	}
	if err := w.Stop(ctx); err == nil {
		t.Error("Stop after a failure returned nil")
	}
}

// The collector deletes expired rows only: live keys, unpublished outbox rows and
// unexpired requests stay.
func TestCollectOnceDeletesOnlyExpiredRows(t *testing.T) {
	t.Parallel()
	if os.Getenv("IDEM_TEST_PARTITIONED") == "1" {
		// On partitioned tables expired rows in a ranged partition wait for the
		// partition's drop; TestCollectorOnPartitionedTables covers that layout.
		t.Skip("counts row deletes of the plain layout")
	}
	env := testenv.New(t)
	db := env.DB
	ctx := context.Background()
	exec := func(sql string) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	// 2500 expired and 10 live inbox rows.
	exec(`INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
	      SELECT 'c', 'old-' || g, 'test.x', '\x00', 'done', now() - interval '1 second' FROM generate_series(1, 2500) g`)
	exec(`INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
	      SELECT 'c', 'live-' || g, 'test.x', '\x00', 'done', now() + interval '1 hour' FROM generate_series(1, 10) g`)
	exec(`INSERT INTO idem_requests (scope, key, fingerprint, method, path, expires_at) VALUES
	      ('', 'old', '\x00', 'POST', '/', now() - interval '1 second'),
	      ('', 'live', '\x00', 'POST', '/', now() + interval '1 hour')`)
	// Outbox: published+expired (goes), published+live (stays), unpublished with an
	// old expires_at (stays: it has not been delivered yet).
	exec(`INSERT INTO idem_outbox (key, subject, msg_id, payload, published_at, expires_at) VALUES
	      ('a', 'test.x', 'a', '\x00', now(), now() - interval '1 second'),
	      ('b', 'test.x', 'b', '\x00', now(), now() + interval '1 hour'),
	      ('c', 'test.x', 'c', '\x00', NULL, now() - interval '1 second')`)
	// A row the relay dead-lettered goes with its retention (its dead letter holds
	// the message); expired attempt counts go too, live ones stay.
	exec(`INSERT INTO idem_outbox (key, subject, msg_id, payload, dead_lettered_at, expires_at) VALUES
	      ('d', 'test.x', 'd', '\x00', now(), now() - interval '1 second')`)
	exec(`INSERT INTO idem_attempts (consumer, key, message, attempts, expires_at) VALUES
	      ('c', 'old', 'test.x', 3, now() - interval '1 second'), ('c', 'live', 'test.x', 2, now() + interval '1 hour')`)

	w, err := worker.New(env.Inst, worker.Config{Retention: worker.RetentionConfig{BatchSize: 1000}})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	n, err := w.CollectOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("deleted %d rows in %s", n, time.Since(start))
	if n != 2500+1+2+1 {
		t.Errorf("deleted %d rows, want 2504", n)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_attempts`); got != 1 {
		t.Errorf("attempt rows left = %d, want the live one", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox`); got != 10 {
		t.Errorf("inbox rows left = %d, want the 10 live ones", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key LIKE 'live-%'`); got != 10 {
		t.Errorf("live inbox rows left = %d, want 10", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_requests WHERE key = 'live'`); got != 1 {
		t.Errorf("live request gone")
	}
	var kept string
	if err := db.Pool.QueryRow(ctx, `SELECT string_agg(key, ',' ORDER BY key) FROM idem_outbox`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	if kept != "b,c" {
		t.Errorf("outbox keeps %q, want b (live) and c (unpublished)", kept)
	}
}

// RegisterMetrics exports every component's outcomes (zero from the start) and
// the outbox backlog read at scrape time; a failed scrape query is counted, not a
// silently missing series.
func TestMetrics(t *testing.T) {
	t.Parallel()
	o := startOrders(t, ordersInstall(ordersSchema), ordersConfig())
	reg := prometheus.NewRegistry()
	if err := o.w.RegisterMetrics(reg); err != nil {
		t.Fatal(err)
	}
	if code, _ := o.post(t, string(idem.NewKey()), `{"item":"cup"}`); code != http.StatusCreated {
		t.Fatalf("order: %d", code)
	}
	testenv.Eventually(t, 45*time.Second, "the order shipped", func() bool {
		return o.env.DB.Count(t, `SELECT count(*) FROM public.shipments`) == 1
	})
	// gather sums the series of name whose outcome is one of outcomes (any, if
	// none is given).
	gather := func(name string, outcomes ...string) float64 {
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		total := 0.0
		for _, f := range families {
			if f.GetName() != name {
				continue
			}
			for _, m := range f.GetMetric() {
				outcome := ""
				for _, l := range m.GetLabel() {
					if l.GetName() == "outcome" {
						outcome = l.GetValue()
					}
				}
				if len(outcomes) > 0 && !slices.Contains(outcomes, outcome) {
					continue
				}
				total += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
		return total
	}
	testenv.Eventually(t, 20*time.Second, "the counters to show one request, one publish, one processed message", func() bool {
		return gather("idem_ingress_requests_total", "new") == 1 && gather("idem_relay_messages_total", "published") == 1 &&
			gather("idem_consumer_messages_total", "processed") == 1
	})
	if got := gather("idem_outbox_pending_rows"); got != 0 {
		t.Errorf("idem_outbox_pending_rows = %v, want 0", got)
	}
	// The histograms: one request, one message from its outbox row to its commit.
	histogram := func(name string) (count uint64, sum float64) {
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range families {
			if f.GetName() == name {
				for _, m := range f.GetMetric() {
					count += m.GetHistogram().GetSampleCount()
					sum += m.GetHistogram().GetSampleSum()
				}
			}
		}
		return count, sum
	}
	if n, _ := histogram("idem_ingress_request_duration_seconds"); n != 1 {
		t.Errorf("idem_ingress_request_duration_seconds counts %d requests, want 1", n)
	}
	if n, sum := histogram("idem_end_to_end_latency_seconds"); n != 1 || sum <= 0 || sum > 45 {
		t.Errorf("idem_end_to_end_latency_seconds: %d samples, sum %vs; want one, between 0 and the test's wait", n, sum)
	}
	for _, name := range []string{"idem_consumer_batch_duration_seconds", "idem_consumer_handler_duration_seconds"} {
		if n, _ := histogram(name); n < 1 {
			t.Errorf("%s has no sample after a processed batch", name)
		}
	}
	if got := gather("idem_build_info"); got != 1 {
		t.Errorf("idem_build_info = %v, want 1", got)
	}
	// JetStream's view of the consumer, and its open dead letters: a series each,
	// drained and none.
	for _, name := range []string{"idem_consumer_pending_messages", "idem_consumer_ack_pending_messages", "idem_dead_letters"} {
		if n, err := testutil.GatherAndCount(reg, name); err != nil || n < 1 {
			t.Errorf("%s: %d series (%v), want one per consumer", name, n, err)
		}
		if got := gather(name); got != 0 {
			t.Errorf("%s = %v after the message was processed, want 0", name, got)
		}
	}
	// Published and consumed; proven or not depending on whether the reconciler's
	// pass at start saw the settlement (the next is 30s away): the gauge says which.
	unproven := o.env.DB.Count(t, `SELECT count(*) FROM orders_idem.idem_outbox WHERE published_at IS NOT NULL AND completed_at IS NULL`)
	if got := gather("idem_outbox_unproven_rows"); got != float64(unproven) {
		t.Errorf("idem_outbox_unproven_rows = %v, want %d", got, unproven)
	}
	if got := gather("idem_outbox_redriven_rows") + gather("idem_outbox_alerted_rows"); got != 0 {
		t.Errorf("re-driven + alerted rows = %v, want 0", got)
	}
	if n, err := testutil.GatherAndCount(reg, "idem_reconciler_rows_total"); err != nil || n != 5 {
		t.Errorf("reconciler series = %d (%v), want the five verdicts pre-registered", n, err)
	}
	if n, err := testutil.GatherAndCount(reg, "idem_consumer_messages_total"); err != nil || n < 4 {
		t.Errorf("consumer series = %d (%v), want the known outcomes pre-registered", n, err)
	}
	// A scrape whose backlog query fails (the schema is gone) is counted.
	if _, err := o.env.DB.Pool.Exec(context.Background(), `ALTER TABLE orders_idem.idem_outbox RENAME TO gone`); err != nil {
		t.Fatal(err)
	}
	_, _ = reg.Gather()
	if got := gather("idem_scrape_errors_total"); got < 1 {
		t.Errorf("idem_scrape_errors_total = %v after a failed backlog query, want >= 1", got)
	}
	// Only the failed query's series are missing: the others are still read.
	if n, err := testutil.GatherAndCount(reg, "idem_dead_letters"); err != nil || n < 1 {
		t.Errorf("idem_dead_letters: %d series (%v) while the backlog query fails, want them still there", n, err)
	}
	if _, err := o.env.DB.Pool.Exec(context.Background(), `ALTER TABLE orders_idem.gone RENAME TO idem_outbox`); err != nil {
		t.Fatal(err)
	}
}

// The pool is split so that no part starves the others: the ingress gets what
// the consumers, relay, collector and health checks leave (at least one request at
// a time), and is refused beyond it with 503. A pool smaller than the parts can use
// (pgxpool's default is max(4, CPUs)) still works; the worker says so.
func TestConnectionBudget(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	pool := func(t *testing.T, maxConns int32) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(env.DB.URL)
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = maxConns
		p, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	cfg := ordersConfig() // shipping: Concurrency 2; relay 2; collector 1; health 1 = 6
	icfg := ordersInstall("")
	var logs strings.Builder
	icfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	for _, tc := range []struct {
		maxConns   int32
		inFlight   int
		warnsSmall bool
	}{{10, 4, false}, {7, 1, false}, {4, 1, true}} {
		logs.Reset()
		w, err := worker.New(newInst(t, pool(t, tc.maxConns), env.NC, icfg), cfg)
		if err != nil {
			t.Fatal(err)
		}
		if got := w.Ingress().Config().MaxInFlight; got != tc.inFlight {
			t.Errorf("MaxConns %d: ingress MaxInFlight = %d, want %d", tc.maxConns, got, tc.inFlight)
		}
		if warned := strings.Contains(logs.String(), "smaller than the 7 connections"); warned != tc.warnsSmall {
			t.Errorf("MaxConns %d: warned about the pool = %v, want %v (%s)", tc.maxConns, warned, tc.warnsSmall, logs.String())
		}
	}
}

// C1 for a service that takes bigger bodies than the broker carries: a message the
// broker could never take is refused by Intent.Enqueue with outbox.ErrTooLarge
// before anything is written, so the handler can answer 413.
func TestEnqueueOfAMessageTooLargeForTheBroker(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	cfg := ordersConfig()
	cfg.Ingress = &producer.Config{MaxBodyBytes: 4 << 20}
	w, err := worker.New(newInst(t, env.DB.Pool, env.NC, ordersInstall("")), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer w.Stop(context.Background()) //nolint:errcheck
	var enqueueErr error
	h := w.Ingress().Wrap(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		in, _ := producer.IntentFrom(r.Context())
		body, _ := io.ReadAll(r.Body)
		if enqueueErr = in.Enqueue(r.Context(), "orders.created", body, nil); errors.Is(enqueueErr, outbox.ErrTooLarge) {
			producer.WriteError(rw, http.StatusRequestEntityTooLarge, "too_large", enqueueErr.Error())
			return
		}
		rw.WriteHeader(http.StatusAccepted)
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(strings.Repeat("x", int(env.NC.MaxPayload())+1)))
	req.Header.Set(idem.HeaderKey, "k-huge")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge || !errors.Is(enqueueErr, outbox.ErrTooLarge) {
		t.Fatalf("status %d, Enqueue error %v; want 413 and ErrTooLarge", resp.StatusCode, enqueueErr)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox`); n != 0 {
		t.Errorf("%d outbox rows for a message the broker cannot take", n)
	}
}

// /readyz names the dependency that is down and nothing else: a driver's error
// would show the user, the host and the database to whoever can reach the port.
func TestReadyzNamesTheDependencyNotItsError(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	u, err := url.Parse(env.DB.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := tcpproxy.New(u.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	u.Host = proxy.Addr()
	pool, err := pgxpool.New(context.Background(), u.String()+"&connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	w, err := worker.New(newInst(t, pool, env.NC, ordersInstall("")), ordersConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer w.Stop(context.Background()) //nolint:errcheck
	readyz := func() (int, string) {
		rec := httptest.NewRecorder()
		w.ReadyHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		return rec.Code, rec.Body.String()
	}
	if code, body := readyz(); code != http.StatusOK {
		t.Fatalf("/readyz = %d %q", code, body)
	}
	proxy.Refuse()
	code, body := readyz()
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "postgres: not answering") {
		t.Fatalf("/readyz with Postgres gone = %d %q", code, body)
	}
	for _, secret := range []string{env.DB.Name, proxy.Addr(), "SQLSTATE", "dial", "connect"} {
		if strings.Contains(body, secret) {
			t.Errorf("/readyz shows %q: %q", secret, body)
		}
	}
}
