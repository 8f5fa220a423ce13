package worker_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/registry"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/worker"
)

// logs is a slog destination tests can read while the worker writes to it.
type logs struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logs) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func (l *logs) count(s string) int { return strings.Count(l.String(), s) }

func (l *logs) logger() *slog.Logger { return slog.New(slog.NewTextHandler(l, nil)) }

// tryStart builds and starts a worker of the installation icfg describes on env,
// stopping it when the test ends.
func tryStart(t *testing.T, env *testenv.Env, icfg install.Config, cfg worker.Config) (*worker.Worker, error) {
	t.Helper()
	w, err := worker.New(newInst(t, env.DB.Pool, env.NC, icfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(context.Background()); err != nil {
		return nil, err
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = w.Stop(ctx)
	})
	return w, nil
}

func wantMentions(t *testing.T, err error, wants ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("no error; want one mentioning %q", wants)
	}
	for _, want := range wants {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

func readyz(w *worker.Worker) (int, string) {
	rec := httptest.NewRecorder()
	w.ReadyHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	return rec.Code, rec.Body.String()
}

func streamMaxAge(t *testing.T, env *testenv.Env, name string) time.Duration {
	t.Helper()
	s, err := env.JS.Stream(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return s.CachedInfo().Config.MaxAge
}

func setMaxAge(t *testing.T, env *testenv.Env, name string, maxAge time.Duration) {
	t.Helper()
	ctx := context.Background()
	s, err := env.JS.Stream(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	sc := s.CachedInfo().Config
	sc.MaxAge = maxAge
	if _, err := env.JS.UpdateStream(ctx, sc); err != nil {
		t.Fatal(err)
	}
}

func register(t *testing.T, env *testenv.Env, schema string, c registry.Consumer) {
	t.Helper()
	if _, err := registry.Register(context.Background(), env.DB.Pool, schema, c, false); err != nil {
		t.Fatal(err)
	}
}

// A MaxAge that breaks the invariant is refused before the stream is created, so
// the corrected configuration then starts and creates the stream with its MaxAge,
// instead of failing against a stream that kept the wrong one.
func TestStartJudgesTheMaxAgeBeforeCreatingTheStream(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	icfg, cfg := ordersInstall(""), ordersConfig()
	icfg.Stream.MaxAge = 96 * time.Hour
	_, err := tryStart(t, env, icfg, cfg)
	wantMentions(t, err, "refusing to start", "stream ORDERS does not exist, and was not created",
		"consumer shipping", "inbox key lifetime 72h0m0s must be longer than the stream's MaxAge 96h0m0s")
	if _, err := env.JS.Stream(context.Background(), "ORDERS"); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("after the refusal, stream ORDERS: %v, want it never created", err)
	}
	icfg.Stream.MaxAge = 0
	w, err := tryStart(t, env, icfg, cfg)
	if err != nil {
		t.Fatalf("corrected configuration refused: %v", err)
	}
	if got := streamMaxAge(t, env, "ORDERS"); got != 24*time.Hour {
		t.Errorf("stream created with MaxAge %s, want the default 24h", got)
	}
	if l := w.Lifetimes(); len(l) != 1 || l[0].StreamMaxAge != 24*time.Hour {
		t.Errorf("Lifetimes() = %+v", l)
	}
}

// An existing stream whose MaxAge breaks the invariant is refused with an error
// that says the stream itself must be edited, and how, naming both numbers; once
// edited, the worker starts.
func TestStartSaysAStreamMustBeEdited(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := context.Background()
	if _, err := env.JS.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}, MaxAge: 96 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	icfg, cfg := ordersInstall(""), ordersConfig()
	_, err := tryStart(t, env, icfg, cfg)
	wantMentions(t, err, "refusing to start", "stream ORDERS",
		"inbox key lifetime 72h0m0s must be longer than the stream's MaxAge 96h0m0s",
		"the stream itself must be edited", "from its MaxAge 96h0m0s to one shorter than 72h0m0s",
		"nats stream edit ORDERS --max-age 24h", "JetStream API")

	// A cause other than the stream's MaxAge does not send the operator to edit it.
	cfg.ClientResendHorizon = 80 * time.Hour
	setMaxAge(t, env, "ORDERS", 24*time.Hour)
	_, err = tryStart(t, env, icfg, cfg)
	wantMentions(t, err, "the client's re-send horizon 80h0m0s")
	if strings.Contains(err.Error(), "nats stream edit") {
		t.Errorf("error sends the operator to edit a stream that is not the cause: %v", err)
	}

	cfg.ClientResendHorizon = 0
	if _, err := tryStart(t, env, icfg, cfg); err != nil {
		t.Fatalf("refused after the stream was edited: %v", err)
	}
}

// A configured MaxAge that differs from the existing stream's is never silent: it
// is refused when it breaks the invariant (the keeper would recreate a lost stream
// with it), and warned about, by name and numbers, when it does not.
func TestConfiguredMaxAgeThatDiffersFromTheStream(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	if _, err := env.JS.CreateStream(context.Background(), jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}, MaxAge: 24 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	icfg, cfg := ordersInstall(""), ordersConfig()
	icfg.Stream.MaxAge = 96 * time.Hour
	_, err := tryStart(t, env, icfg, cfg)
	wantMentions(t, err, "refusing to start", "the configured MaxAge 96h0m0s differs from stream ORDERS's MaxAge 24h0m0s",
		"inbox key lifetime 72h0m0s must be longer than the stream's MaxAge 96h0m0s")

	var out logs
	icfg.Logger = out.logger()
	icfg.Stream.MaxAge = time.Hour
	if _, err := tryStart(t, env, icfg, cfg); err != nil {
		t.Fatalf("refused: %v", err)
	}
	for _, want := range []string{"level=WARN", "configured MaxAge 1h0m0s differs from the stream's MaxAge 24h0m0s", "nats stream edit ORDERS --max-age 1h"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the log does not mention %q:\n%s", want, out.String())
		}
	}
	if got := streamMaxAge(t, env, "ORDERS"); got != 24*time.Hour {
		t.Errorf("stream MaxAge = %s: the worker changed an existing stream", got)
	}
}

// Every consumer of the stream registered in the installation is judged, by what it
// registered, not only this worker's: a worker that runs a consumer and one that
// runs only the relay refuse to start over another process's consumer, naming it.
// This worker's own consumers are judged by their configuration, not by an older
// registry entry; consumers of another stream are not judged against this one.
func TestStartJudgesEveryRegisteredConsumer(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		consumer registry.Consumer
		relay    bool // a worker that runs only the relay and the reconciler
		want     []string
	}{
		{"another process's inbox shorter than the stream's MaxAge",
			registry.Consumer{Name: "audit", Stream: "ORDERS", FilterSubject: "orders.>", KeyLifetime: 12 * time.Hour}, false,
			[]string{"consumer audit (registered, not run here)", "inbox key lifetime 12h0m0s must be longer than the stream's MaxAge 24h0m0s",
				"install.Config.Stream.MaxAge must be shorter than 12h0m0s", "audit registered by another process", "consumer.Forget"}},
		{"the same, at a worker that runs only the relay",
			registry.Consumer{Name: "audit", Stream: "ORDERS", FilterSubject: "orders.>", KeyLifetime: 12 * time.Hour}, true,
			[]string{"consumer audit (registered, not run here)", "inbox key lifetime 12h0m0s"}},
		{"another process's redelivery horizon",
			registry.Consumer{Name: "audit", Stream: "ORDERS", FilterSubject: "orders.>", KeyLifetime: 72 * time.Hour, Redelivery: 100 * time.Hour}, true,
			[]string{"consumer audit (registered, not run here)", "the consumer's redelivery horizon 100h0m0s"}},
		{"another process's inbox shorter than the clients' re-send horizon",
			registry.Consumer{Name: "audit", Stream: "ORDERS", FilterSubject: "orders.>", KeyLifetime: 20 * time.Hour}, true,
			[]string{"consumer audit (registered, not run here)", "the client's re-send horizon 24h0m0s"}},
		{"this worker's consumer, registered before with a shorter lifetime",
			registry.Consumer{Name: "shipping", Stream: "ORDERS", FilterSubject: "orders.created", KeyLifetime: time.Hour}, false, nil},
		{"a consumer of another stream",
			registry.Consumer{Name: "audit", Stream: "INVOICES", FilterSubject: "invoices.>", KeyLifetime: time.Hour}, true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := testenv.New(t)
			register(t, env, "", tc.consumer)
			cfg := ordersConfig()
			if tc.relay {
				cfg.Consumers, cfg.Ingress = nil, nil
			}
			w, err := tryStart(t, env, ordersInstall(""), cfg)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				for _, l := range w.Lifetimes() {
					if l.InboxKey < 72*time.Hour {
						t.Errorf("Lifetimes() judged %s with inbox %s", l.For, l.InboxKey)
					}
				}
				return
			}
			wantMentions(t, err, append([]string{"refusing to start"}, tc.want...)...)
			if _, err := env.JS.Stream(context.Background(), "ORDERS"); !errors.Is(err, jetstream.ErrStreamNotFound) {
				t.Errorf("stream ORDERS created although the worker refused: %v", err)
			}
		})
	}
}

// While the worker runs, its stream keeper judges the invariant again: an operator
// who edits the stream's MaxAge past a key lifetime, or another process that
// registers a consumer that breaks it, makes the worker unready, naming the numbers,
// with one error in the log per change; repaired, it is ready again. Lifetimes
// follows what was last judged.
func TestKeeperJudgesTheInvariantAtRuntime(t *testing.T) {
	t.Parallel()
	var out logs
	cfg := ordersConfig()
	cfg.Consumers[0].CheckInterval = 100 * time.Millisecond // the keeper's pace too
	icfg := ordersInstall(ordersSchema)
	icfg.Logger = out.logger()
	o := startOrders(t, icfg, cfg)
	if code, body := readyz(o.w); code != http.StatusOK {
		t.Fatalf("/readyz = %d %q", code, body)
	}
	const broken = "the lifetime invariant is broken"

	setMaxAge(t, o.env, "ORDERS", 96*time.Hour)
	var body string
	testenv.Eventually(t, 10*time.Second, "/readyz failing over the edited MaxAge", func() bool {
		var code int
		code, body = readyz(o.w)
		return code == http.StatusServiceUnavailable
	})
	for _, want := range []string{"inbox key lifetime 72h0m0s must be longer than the stream's MaxAge 96h0m0s", "nats stream edit ORDERS --max-age 24h"} {
		if !strings.Contains(body, want) {
			t.Errorf("/readyz %q does not mention %q", body, want)
		}
	}
	if l := o.w.Lifetimes(); len(l) != 1 || l[0].StreamMaxAge != 96*time.Hour {
		t.Errorf("Lifetimes() = %+v, want the stream's MaxAge 96h", l)
	}
	// Ten ticks and more: still one error in the log for this change.
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if code, _ := readyz(o.w); code != http.StatusServiceUnavailable {
			t.Fatalf("/readyz = %d while the stream's MaxAge is 96h", code)
		}
	}
	if n := out.count(broken); n != 1 {
		t.Errorf("%d errors logged for one change, want 1:\n%s", n, out.String())
	}

	setMaxAge(t, o.env, "ORDERS", 24*time.Hour)
	testenv.Eventually(t, 10*time.Second, "ready again once the stream was edited", func() bool {
		code, _ := readyz(o.w)
		return code == http.StatusOK
	})
	if l := o.w.Lifetimes(); len(l) != 1 || l[0].StreamMaxAge != 24*time.Hour {
		t.Errorf("Lifetimes() = %+v, want the stream's MaxAge 24h", l)
	}

	// Another process registers a consumer whose inbox forgets keys too soon.
	register(t, o.env, ordersSchema, registry.Consumer{Name: "audit", Stream: "ORDERS", FilterSubject: "orders.>", KeyLifetime: 12 * time.Hour})
	testenv.Eventually(t, 10*time.Second, "/readyz failing over the registered consumer", func() bool {
		var code int
		code, body = readyz(o.w)
		return code == http.StatusServiceUnavailable
	})
	for _, want := range []string{"consumer audit (registered, not run here)", "inbox key lifetime 12h0m0s"} {
		if !strings.Contains(body, want) {
			t.Errorf("/readyz %q does not mention %q", body, want)
		}
	}
	if l := o.w.Lifetimes(); len(l) != 2 || l[1].For != "consumer audit (registered, not run here)" || l[1].InboxKey != 12*time.Hour {
		t.Errorf("Lifetimes() = %+v, want shipping's and audit's", l)
	}
	if n := out.count(broken); n != 2 {
		t.Errorf("%d errors logged for two changes, want 2:\n%s", n, out.String())
	}
	if _, err := consumer.Forget(context.Background(), o.w.Installation(), "audit"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "ready again once the consumer was forgotten", func() bool {
		code, _ := readyz(o.w)
		return code == http.StatusOK
	})
	if !strings.Contains(out.String(), "the lifetime invariant holds again") {
		t.Errorf("the repair was not logged:\n%s", out.String())
	}
}

// The keeper judges before it recreates a lost stream: a stream recreated with a
// MaxAge the invariant forbids would keep it. It stays missing, and the worker
// unready saying why, until the invariant holds; then it is recreated.
func TestKeeperDoesNotRecreateAStreamThatBreaksTheInvariant(t *testing.T) {
	t.Parallel()
	cfg := ordersConfig()
	cfg.Consumers[0].CheckInterval = 100 * time.Millisecond
	o := startOrders(t, ordersInstall(ordersSchema), cfg)
	ctx := context.Background()
	register(t, o.env, ordersSchema, registry.Consumer{Name: "audit", Stream: "ORDERS", FilterSubject: "orders.>", KeyLifetime: 12 * time.Hour})
	if err := o.env.JS.DeleteStream(ctx, "ORDERS"); err != nil {
		t.Fatal(err)
	}
	var body string
	testenv.Eventually(t, 10*time.Second, "/readyz naming the stream not recreated", func() bool {
		_, body = readyz(o.w)
		return strings.Contains(body, "stream ORDERS: missing, and not recreated: its configured MaxAge 24h0m0s breaks the lifetime invariant")
	})
	if !strings.Contains(body, "consumer audit (registered, not run here)") {
		t.Errorf("/readyz %q does not name the consumer", body)
	}
	if _, err := o.env.JS.Stream(ctx, "ORDERS"); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("stream ORDERS: %v, want it not recreated", err)
	}
	if _, err := consumer.Forget(ctx, o.w.Installation(), "audit"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "stream recreated and the worker ready", func() bool {
		code, _ := readyz(o.w)
		return code == http.StatusOK
	})
	if got := streamMaxAge(t, o.env, "ORDERS"); got != 24*time.Hour {
		t.Errorf("recreated with MaxAge %s", got)
	}
}
