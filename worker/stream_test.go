package worker_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/worker"
)

// The stream's real configuration is checked at start: a stream that would lose or
// misplace messages is refused with the reason; settings the reconciler repairs
// (at a cost) are refused only when no reconciler runs.
func TestStartChecksTheStream(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		stream      jetstream.StreamConfig
		noReconcile bool
		want        string // empty: starts
	}{
		{"work queue", jetstream.StreamConfig{Subjects: []string{"orders.>"}, Retention: jetstream.WorkQueuePolicy},
			false, "its retention is WorkQueue"},
		{"subjects too narrow", jetstream.StreamConfig{Subjects: []string{"orders.created"}},
			false, `does not cover the worker's subjects "orders.>"`},
		{"memory, no reconciler", jetstream.StreamConfig{Subjects: []string{"orders.>"}, Storage: jetstream.MemoryStorage},
			true, "it is kept in memory"},
		{"memory, reconciled", jetstream.StreamConfig{Subjects: []string{"orders.>"}, Storage: jetstream.MemoryStorage},
			false, ""},
		{"discards the oldest, no reconciler", jetstream.StreamConfig{Subjects: []string{"orders.>"}, MaxMsgs: 1000, Discard: jetstream.DiscardOld},
			true, "it discards its oldest messages when full"},
		{"discards the newest", jetstream.StreamConfig{Subjects: []string{"orders.>"}, MaxMsgs: 1000, Discard: jetstream.DiscardNew},
			true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := testenv.New(t)
			sc := tc.stream
			sc.Name, sc.MaxAge = "ORDERS", 24*time.Hour
			if _, err := env.JS.CreateStream(context.Background(), sc); err != nil {
				t.Fatal(err)
			}
			cfg := ordersConfig()
			cfg.DisableReconciler = tc.noReconcile
			w, err := worker.New(newInst(t, env.DB.Pool, env.NC, ordersInstall("")), cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = w.Start(context.Background())
			if err == nil {
				_ = w.Stop(context.Background())
			}
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != "" && err == nil:
				t.Fatalf("started; want a refusal mentioning %q", tc.want)
			case tc.want != "" && !strings.Contains(err.Error(), tc.want):
				t.Fatalf("error %q does not mention %q", err, tc.want)
			}
		})
	}
}

// A deleted durable consumer, then a deleted stream, are recreated while the worker
// runs, and intents keep shipping once each.
func TestDeletedStreamAndConsumerAreRecreated(t *testing.T) {
	t.Parallel()
	cfg := ordersConfig()
	cfg.Consumers[0].CheckInterval = 100 * time.Millisecond
	o := startOrders(t, ordersInstall(ordersSchema), cfg)
	ctx := context.Background()
	shipped := func(key string) func() bool {
		return func() bool {
			return o.env.DB.Count(t, `SELECT count(*) FROM public.shipments WHERE order_key = $1`, key) == 1
		}
	}
	if code, _ := o.post(t, "k-1", `{"item":"a"}`); code != http.StatusCreated {
		t.Fatalf("POST = %d", code)
	}
	testenv.Eventually(t, 10*time.Second, "k-1 shipped", shipped("k-1"))

	if err := o.env.JS.DeleteConsumer(ctx, "ORDERS", "shipping"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "durable consumer recreated", func() bool {
		_, err := o.env.JS.Consumer(ctx, "ORDERS", "shipping")
		return err == nil
	})
	if code, _ := o.post(t, "k-2", `{"item":"b"}`); code != http.StatusCreated {
		t.Fatalf("POST = %d", code)
	}
	testenv.Eventually(t, 10*time.Second, "k-2 shipped after the consumer was recreated", shipped("k-2"))

	if err := o.env.JS.DeleteStream(ctx, "ORDERS"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "stream and durable consumer recreated", func() bool {
		_, err := o.env.JS.Consumer(ctx, "ORDERS", "shipping")
		return err == nil
	})
	if code, _ := o.post(t, "k-3", `{"item":"c"}`); code != http.StatusCreated {
		t.Fatalf("POST = %d", code)
	}
	testenv.Eventually(t, 10*time.Second, "k-3 shipped after the stream was recreated", shipped("k-3"))
	for _, k := range []string{"k-1", "k-2", "k-3"} {
		if n := o.env.DB.Count(t, `SELECT count(*) FROM public.shipments WHERE order_key = $1`, k); n != 1 {
			t.Errorf("shipments of %s = %d, want 1", k, n)
		}
	}
}

// While the stream cannot be recreated (another stream took its subjects), a
// worker without an ingress is not ready, and says which stream and which
// consumer; a worker with an ingress stays ready (its requests need Postgres
// alone) and says the same in /healthz.
func TestReadyzNamesAMissingStreamAndConsumer(t *testing.T) {
	t.Parallel()
	cfg := ordersConfig()
	cfg.Consumers[0].CheckInterval = 100 * time.Millisecond
	o := startOrders(t, ordersInstall(ordersSchema), cfg)
	consumers := startConsumersOnly(t, o, cfg)
	ctx := context.Background()
	for _, w := range []*worker.Worker{o.w, consumers} {
		if code, body := serve(w.ReadyHandler(), "/readyz"); code != http.StatusOK {
			t.Fatalf("/readyz = %d %q", code, body)
		}
	}
	if err := o.env.JS.DeleteStream(ctx, "ORDERS"); err != nil {
		t.Fatal(err)
	}
	if _, err := o.env.JS.CreateStream(ctx, jetstream.StreamConfig{Name: "SQUATTER", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}
	names := func(body string) bool {
		return strings.Contains(body, "stream ORDERS: missing, and recreating it failed") &&
			strings.Contains(body, "consumer shipping: its durable consumer on stream ORDERS is missing")
	}
	var body string
	testenv.Eventually(t, 10*time.Second, "/readyz of the consumer worker naming the stream and the consumer", func() bool {
		var code int
		code, body = serve(consumers.ReadyHandler(), "/readyz")
		return code == http.StatusServiceUnavailable && names(body)
	})
	if strings.Contains(body, "SQUATTER") || strings.Contains(body, "nats:") {
		t.Errorf("/readyz shows the broker's error: %q", body)
	}
	testenv.Eventually(t, 10*time.Second, "/healthz of the ingress worker naming the stream and the consumer", func() bool {
		_, body = serve(o.w.LiveHandler(), "/healthz")
		return names(body)
	})
	if strings.Contains(body, "SQUATTER") {
		t.Errorf("/healthz shows the broker's error: %q", body)
	}
	if code, body := serve(o.w.ReadyHandler(), "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz of the ingress worker without its stream = %d %q, want 200: its requests go to the outbox", code, body)
	}
	if err := o.env.JS.DeleteStream(ctx, "SQUATTER"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "ready again", func() bool {
		code, _ := serve(consumers.ReadyHandler(), "/readyz")
		return code == http.StatusOK
	})
}

// With the reconciler (the default), a published row has no expiry until every
// consumer that reads it has settled it; then its retention (Retention.Published)
// starts.
func TestPublishedRowsAreKeptUntilProven(t *testing.T) {
	t.Parallel()
	cfg := ordersConfig()
	cfg.Reconcile.After = 100 * time.Millisecond // and so a pass every 100ms
	cfg.Retention.Published = time.Hour
	o := startOrders(t, ordersInstall(ordersSchema), cfg)
	if code, _ := o.post(t, "k-1", `{"item":"a"}`); code != http.StatusCreated {
		t.Fatalf("POST = %d", code)
	}
	testenv.Eventually(t, 10*time.Second, "the row proven complete", func() bool {
		return o.env.DB.Count(t, `SELECT count(*) FROM orders_idem.idem_outbox WHERE completed_at IS NOT NULL
			AND expires_at BETWEEN completed_at + interval '59 minutes' AND completed_at + interval '61 minutes'`) == 1
	})
	if n := o.env.DB.Count(t, `SELECT count(*) FROM orders_idem.idem_consumers WHERE name = 'shipping' AND filter_subject = 'orders.created' AND stream = 'ORDERS'`); n != 1 {
		t.Fatalf("registered consumers = %d, want shipping", n)
	}
}
