package idemtest_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/idemtest"
	"github.com/idemkit/idem/internal/testkit/natstest"
)

// The kit's own proof: a well-behaved handler passes every scenario, and each kind
// of misbehaviour fails the scenario meant to catch it, with the counts.

const subject = "orders.created"

const sqlCreateEffects = `CREATE TABLE public.effects (
    id      bigserial PRIMARY KEY,
    key     text      NOT NULL,
    payload bytea     NOT NULL
)`

// setup starts the test's own Env, on a JetStream server of its own, with the
// table effects (no unique key, so a double effect shows as a second row) unless
// cfg migrates something else.
func setup(t *testing.T, cfg idemtest.Config) *idemtest.Env {
	t.Helper()
	if cfg.NATSURL == "" {
		cfg.NATSURL = natstest.Start(t).URL()
	}
	if cfg.Migrate == nil {
		cfg.Migrate = func(ctx context.Context, pool *pgxpool.Pool) error {
			_, err := pool.Exec(ctx, sqlCreateEffects)
			return err
		}
	}
	return idemtest.New(t, cfg)
}

// countRows is Case.Effects for handlers that write to effects.
func countRows(ctx context.Context, pool *pgxpool.Pool, key string) (n int, err error) {
	err = pool.QueryRow(ctx, `SELECT count(*) FROM public.effects WHERE key = $1`, key).Scan(&n)
	return n, err
}

// rowsBatch is the well-behaved handler: one row per delivery, one statement per
// batch, through the transaction it is given.
type rowsBatch struct{}

func (rowsBatch) HandleBatch(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
	keys := make([]string, len(ds))
	payloads := make([][]byte, len(ds))
	for i, d := range ds {
		keys[i], payloads[i] = d.Key, d.Payload
	}
	if _, err := tx.Exec(ctx, `INSERT INTO public.effects (key, payload) SELECT * FROM unnest($1::text[], $2::bytea[])`, keys, payloads); err != nil {
		return nil, fmt.Errorf("effects: %w", err)
	}
	return make([][]byte, len(ds)), nil
}

// rowHandler is the single-message form of rowsBatch.
var rowHandler = consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
	_, err := tx.Exec(ctx, `INSERT INTO public.effects (key, payload) VALUES ($1, $2)`, d.Key, d.Payload)
	return []byte("ok"), err
})

func message() idem.Message {
	return idem.Message{Subject: subject, Payload: []byte(`{"order":42}`)}
}

// inTxNames is the order an in-transaction check runs its scenarios in.
var inTxNames = []string{idemtest.FirstDelivery, idemtest.CrashBeforeCommit, idemtest.CrashAfterCommit,
	idemtest.Redelivery, idemtest.Resent, idemtest.ChangedPayload}

var externalNames = []string{idemtest.FirstDelivery, idemtest.LostResponse, idemtest.CrashAfterPerform,
	idemtest.Redelivery, idemtest.Resent, idemtest.ChangedPayload}

func names(r idemtest.Report) []string {
	out := make([]string, len(r.Scenarios))
	for i, s := range r.Scenarios {
		out[i] = s.Name
	}
	return out
}

func TestWellBehavedHandlerPasses(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		cfg  idemtest.Config
		c    func(c idemtest.Case) idemtest.Case
	}{
		{"batch handler", idemtest.Config{}, func(c idemtest.Case) idemtest.Case { return c }},
		{"single handler", idemtest.Config{}, func(c idemtest.Case) idemtest.Case {
			c.Consumer.BatchHandler, c.Consumer.Handler = nil, rowHandler
			return c
		}},
		{"idem tables in another schema, scoped key, wildcard filter", idemtest.Config{Schema: "idem"}, func(c idemtest.Case) idemtest.Case {
			c.Consumer.Subject = "orders.>"
			c.Message.Key = idem.ScopedKey("tenant-7", idem.NewKey())
			return c
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			logs := &syncBuffer{}
			tc.cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
			env := setup(t, tc.cfg)
			c := tc.c(idemtest.Case{
				Consumer: consumer.Config{Name: "shipping", Subject: subject, BatchHandler: rowsBatch{}},
				Message:  message(),
				Effects:  countRows,
			})
			r := env.AssertOnce(t, c)
			if !strings.Contains(logs.String(), "consumer started") || !strings.Contains(logs.String(), "consumer=shipping") {
				t.Errorf("Config.Logger did not receive the consumer's log:\n%s", logs.String())
			}
			if !slices.Equal(names(r), inTxNames) {
				t.Errorf("scenarios = %q, want %q", names(r), inTxNames)
			}
			for _, s := range r.Scenarios {
				if !s.OK || s.Effects != 1 || s.Want != 1 || s.Detail != "" {
					t.Errorf("%s", s)
				}
			}
			if !r.OK() {
				t.Errorf("report not OK:\n%s", r)
			}
			// The crash scenarios ran on keys of their own, the rest on the Case's.
			if c.Message.Key != "" && r.Key != c.Message.Key {
				t.Errorf("report key %q, want the Case's %q", r.Key, c.Message.Key)
			}
			for i, s := range r.Scenarios {
				fresh := i == 1 || i == 2
				if (s.Key != r.Key) != fresh {
					t.Errorf("%s ran on key %q (Case key %q)", s.Name, s.Key, r.Key)
				}
			}
		})
	}
}

// The handlers that break exactly once in a way only a crash shows: their effect
// escapes the transaction, so a rollback does not undo it.
func TestEffectOutsideTheTransactionFailsCrashBeforeCommit(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		handler func(env *idemtest.Env, calls *callLog) consumer.Handler
		effects func(calls *callLog) func(context.Context, *pgxpool.Pool, string) (int, error)
	}{
		{
			name: "writes through the pool",
			handler: func(env *idemtest.Env, _ *callLog) consumer.Handler {
				return consumer.HandlerFunc(func(ctx context.Context, _ pgx.Tx, d *consumer.Delivery) ([]byte, error) {
					_, err := env.Pool.Exec(ctx, `INSERT INTO public.effects (key, payload) VALUES ($1, $2)`, d.Key, d.Payload)
					return nil, err
				})
			},
			effects: func(*callLog) func(context.Context, *pgxpool.Pool, string) (int, error) { return countRows },
		},
		{
			name: "calls another system from the transaction",
			handler: func(_ *idemtest.Env, calls *callLog) consumer.Handler {
				return consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
					calls.add(d.Key) // the notification service, say
					_, err := tx.Exec(ctx, `INSERT INTO public.effects (key, payload) VALUES ($1, $2)`, d.Key, d.Payload)
					return nil, err
				})
			},
			effects: func(calls *callLog) func(context.Context, *pgxpool.Pool, string) (int, error) { return calls.effects },
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := setup(t, idemtest.Config{})
			calls := &callLog{}
			r, err := idemtest.Check(t.Context(), env, idemtest.Case{
				Consumer: consumer.Config{Name: "leaky", Subject: subject, Handler: tc.handler(env, calls)},
				Message:  message(),
				Effects:  tc.effects(calls),
			})
			if err != nil {
				t.Fatal(err)
			}
			failed := r.Failed()
			if len(failed) != 1 || len(r.NotRun) != 0 {
				t.Fatalf("want exactly scenario %q to fail, got:\n%s", idemtest.CrashBeforeCommit, r)
			}
			s := failed[0]
			if s.Name != idemtest.CrashBeforeCommit || s.Effects != 2 || s.Want != 1 {
				t.Errorf("failed scenario = %s, want %q with 2 effects", s, idemtest.CrashBeforeCommit)
			}
			if !strings.Contains(s.Detail, "writes through something other than the pgx.Tx") {
				t.Errorf("detail does not say why: %q", s.Detail)
			}
			if r.OK() {
				t.Error("report OK despite a failed scenario")
			}
		})
	}
}

// syncBuffer collects log lines from any goroutine.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// callLog counts calls per key: a stand-in for a system outside the transaction.
type callLog struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *callLog) add(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[key]++
}

func (c *callLog) effects(_ context.Context, _ *pgxpool.Pool, key string) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[key], nil
}

// downstream is a fake provider over HTTP. It executes a request (counting it
// under its Idempotency-Key) unless it honours the key and has executed that key
// before, in which case it replays the first answer.
type downstream struct {
	honours bool
	mu      sync.Mutex
	seen    map[string]bool
	calls   callLog
}

func (f *downstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		http.Error(w, "Idempotency-Key required", http.StatusBadRequest)
		return
	}
	f.mu.Lock()
	replay := f.honours && f.seen[key]
	if f.seen == nil {
		f.seen = map[string]bool{}
	}
	f.seen[key] = true
	f.mu.Unlock()
	if !replay {
		f.calls.add(key)
	}
	_, _ = fmt.Fprint(w, "sent")
}

// effects is Case.Effects for sender: the downstream's executions under the key
// the handler derived from the scoped key, which idemtest.KeyFor derives alike.
func (f *downstream) effects(ctx context.Context, pool *pgxpool.Pool, key string) (int, error) {
	return f.calls.effects(ctx, pool, idemtest.KeyFor(key, "send"))
}

// sender is the External handler under test: it posts the payload downstream with
// the key derived for its purpose, the same on every attempt.
func sender(url string) consumer.ExternalHandler {
	client := &http.Client{Timeout: 10 * time.Second}
	return consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(e.Payload))
		if err != nil {
			return nil, consumer.Permanent(err)
		}
		req.Header.Set("Idempotency-Key", e.KeyFor("send"))
		resp, err := client.Do(req)
		if err != nil {
			return nil, fmt.Errorf("downstream: %w", err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("downstream: %s", resp.Status)
		}
		return []byte(resp.Status), nil
	})
}

func TestExternalHandler(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		honours bool
		fail    []string // the scenarios that must fail, with 2 effects each
	}{
		{"downstream honours the key", true, nil},
		{"downstream ignores the key", false, []string{idemtest.LostResponse, idemtest.CrashAfterPerform}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := setup(t, idemtest.Config{})
			fake := &downstream{honours: tc.honours}
			srv := httptest.NewServer(fake)
			t.Cleanup(srv.Close)
			r, err := idemtest.Check(t.Context(), env, idemtest.Case{
				Consumer: consumer.Config{Name: "mailer", Subject: subject, External: sender(srv.URL)},
				Message:  message(),
				Effects:  fake.effects,
			})
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(names(r), externalNames) {
				t.Fatalf("scenarios = %q, want %q", names(r), externalNames)
			}
			for _, s := range r.Scenarios {
				mustFail := slices.Contains(tc.fail, s.Name)
				switch {
				case mustFail && (s.OK || s.Effects != 2):
					t.Errorf("want a failure with 2 effects, got %s", s)
				case mustFail && !strings.Contains(s.Detail, "honours the key"):
					t.Errorf("%s: detail does not say the downstream must honour the key: %q", s.Name, s.Detail)
				case !mustFail && (!s.OK || s.Effects != 1):
					t.Errorf("want ok with 1 effect, got %s", s)
				}
			}
			if r.OK() != (len(tc.fail) == 0) {
				t.Errorf("report OK = %v:\n%s", r.OK(), r)
			}
		})
	}
}

// The negative control: with the inbox claim switched off, every scenario whose
// pass rests on the inbox's fold must fail. Without this, a kit whose later
// scenarios passed for any handler would look the same as one that works.
func TestWithoutTheInboxTheFoldScenariosFail(t *testing.T) {
	t.Parallel()
	env := setup(t, idemtest.Config{})
	idemtest.SkipInboxClaim(env)
	r, err := idemtest.Check(t.Context(), env, idemtest.Case{
		Consumer: consumer.Config{Name: "unclaimed", Subject: subject, BatchHandler: rowsBatch{}},
		Message:  message(),
		Effects:  countRows,
	})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(names(r), inTxNames) {
		t.Fatalf("scenarios = %q, want %q", names(r), inTxNames)
	}
	// The first delivery and the rolled-back attempt need no fold.
	for _, name := range inTxNames[:2] {
		if s, _ := r.Scenario(name); !s.OK {
			t.Errorf("want ok: %s", s)
		}
	}
	for _, name := range inTxNames[2:] {
		if s, _ := r.Scenario(name); s.OK || s.Effects < 2 {
			t.Errorf("want a failure with more than one effect: %s", s)
		}
	}
	if s, _ := r.Scenario(idemtest.ChangedPayload); !strings.Contains(s.Detail, "not dead-lettered") {
		t.Errorf("changed payload: detail does not say it was not dead-lettered: %q", s.Detail)
	}
}

// A handler that cannot work at all fails the first scenario, and the scenarios
// that rest on it are reported as not run: quickly when the message is
// dead-lettered, after Timeout when it never settles, never hanging.
func TestBrokenHandlerHaltsAfterTheFirstDelivery(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name       string
		err        error
		maxDeliver int
		detail     []string
	}{
		{"permanent error", consumer.Permanent(errors.New("cannot decode the order")), 0,
			[]string{"dead-lettered: permanent handler error", "cannot decode the order"}},
		{"fails every attempt", errors.New("downstream table locked"), 1_000_000,
			[]string{"timed out after 1s waiting for the first delivery to settle", "1 unacknowledged", "outcomes failed="}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := setup(t, idemtest.Config{})
			broken := consumer.HandlerFunc(func(context.Context, pgx.Tx, *consumer.Delivery) ([]byte, error) { return nil, tc.err })
			start := time.Now()
			r, err := idemtest.Check(t.Context(), env, idemtest.Case{
				Consumer: consumer.Config{Name: "broken", Subject: subject, Handler: broken, MaxDeliver: tc.maxDeliver},
				Message:  message(),
				Effects:  countRows,
				Timeout:  time.Second,
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(r.Scenarios) != 1 || r.Scenarios[0].OK || r.Scenarios[0].Effects != 0 {
				t.Fatalf("want only the first scenario, failed with 0 effects:\n%s", r)
			}
			for _, want := range tc.detail {
				if d := r.Scenarios[0].Detail; !strings.Contains(d, want) {
					t.Errorf("detail %q does not contain %q", d, want)
				}
			}
			if !slices.Equal(r.NotRun, inTxNames[1:]) {
				t.Errorf("NotRun = %q, want %q", r.NotRun, inTxNames[1:])
			}
			if took := time.Since(start); took > 10*time.Second {
				t.Errorf("the check took %s with a 1s Timeout", took)
			}
		})
	}
}

func TestCaseValidation(t *testing.T) {
	t.Parallel()
	env := setup(t, idemtest.Config{})
	valid := func() idemtest.Case {
		return idemtest.Case{
			Consumer: consumer.Config{Name: "shipping", Subject: subject, BatchHandler: rowsBatch{}},
			Message:  message(),
			Effects:  countRows,
		}
	}
	cases := []struct {
		name   string
		change func(c *idemtest.Case)
		want   string
	}{
		{"no Effects", func(c *idemtest.Case) { c.Effects = nil }, "Case.Effects is required"},
		{"no subject", func(c *idemtest.Case) { c.Message.Subject = "" }, "Case.Message.Subject is required"},
		{"wildcard subject", func(c *idemtest.Case) { c.Message.Subject = "orders.*" }, "Case.Message.Subject: idem: bad subject"},
		{"no payload", func(c *idemtest.Case) { c.Message.Payload = nil }, "Case.Message.Payload is required"},
		{"malformed key", func(c *idemtest.Case) { c.Message.Key = "tab\tkey" }, "Case.Message.Key: idem: malformed idempotency key"},
		{"Msg-Id header", func(c *idemtest.Case) { c.Message.Headers = map[string]string{idem.HeaderMsgID: "x"} }, "Nats-Msg-Id is set by the kit"},
		{"Changed equals Payload", func(c *idemtest.Case) { c.Changed = c.Message.Payload }, "Case.Changed equals Case.Message.Payload"},
		{"negative timeout", func(c *idemtest.Case) { c.Timeout = -time.Second }, "Case.Timeout must not be negative"},
		{"empty PayloadFor", func(c *idemtest.Case) { c.PayloadFor = func(string) []byte { return nil } }, "Case.PayloadFor returned an empty payload"},
		{"no consumer name", func(c *idemtest.Case) { c.Consumer.Name = "" }, "Case.Consumer: consumer: Name is required"},
		{"no consumer subject", func(c *idemtest.Case) { c.Consumer.Subject = "" }, "Case.Consumer: consumer shipping: Subject is required"},
		{"no handler", func(c *idemtest.Case) { c.Consumer.BatchHandler = nil }, "set exactly one of Handler, BatchHandler and External"},
		{"two handlers", func(c *idemtest.Case) { c.Consumer.Handler = rowHandler }, "set exactly one of Handler, BatchHandler and External"},
		{"subject outside the filter", func(c *idemtest.Case) { c.Consumer.Subject = "payments.>" }, `is not matched by Case.Consumer.Subject "payments.>"`},
		{"subject outside the stream", func(c *idemtest.Case) { c.Stream.Subjects = []string{"payments.>"} }, "is outside Case.Stream.Subjects"},
		{"negative stream MaxAge", func(c *idemtest.Case) { c.Stream.MaxAge = -time.Hour }, "Case.Stream: install: stream IDEMTEST: MaxAge"},
	}
	for _, tc := range cases {
		c := valid()
		tc.change(&c)
		_, err := idemtest.Check(t.Context(), env, c)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to contain %q", tc.name, err, tc.want)
		}
	}
	if _, err := idemtest.Check(t.Context(), nil, valid()); err == nil || !strings.Contains(err.Error(), "nil Env") {
		t.Errorf("nil Env: err = %v", err)
	}

	// A consumer that cannot start (JetStream refuses the durable's name) fails the
	// check with the broker's reason at once, instead of a wait running out.
	bad := valid()
	bad.Consumer.Name = "no spaces allowed"
	r, err := idemtest.Check(t.Context(), env, bad)
	if err == nil || !strings.Contains(err.Error(), "invalid consumer name") {
		t.Errorf("bad durable name: err = %v", err)
	}
	if len(r.Scenarios) != 1 || r.Scenarios[0].OK || !strings.Contains(r.Scenarios[0].Detail, "the consumer stopped") {
		t.Errorf("bad durable name: want the first scenario failed because the consumer stopped:\n%s", r)
	}

	// A stream the check did not create is not the check's to delete. The check
	// just deleted its own stream of that name, and the server may still be
	// removing its store: "error creating store for stream" until it has.
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := env.JS.CreateStream(t.Context(), jetstream.StreamConfig{Name: "IDEMTEST", Subjects: []string{"orders.>"}})
		if err == nil {
			break
		}
		if !strings.Contains(err.Error(), "error creating store") || time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond) // polling the server's state; no event says the store is gone
	}
	if _, err := idemtest.Check(t.Context(), env, valid()); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("existing stream: err = %v", err)
	}
	if _, err := env.JS.Stream(t.Context(), "IDEMTEST"); err != nil {
		t.Errorf("the existing stream is gone: %v", err)
	}
}

func TestStart(t *testing.T) {
	t.Parallel()
	t.Run("bad schema", func(t *testing.T) {
		t.Parallel()
		_, err := idemtest.Start(t.Context(), idemtest.Config{Schema: "Not-A-Schema"})
		if err == nil || !strings.Contains(err.Error(), "Config.Schema") {
			t.Errorf("err = %v, want a Config.Schema error", err)
		}
	})
	t.Run("Migrate fails", func(t *testing.T) {
		t.Parallel()
		_, err := idemtest.Start(t.Context(), idemtest.Config{Migrate: func(context.Context, *pgxpool.Pool) error {
			return errors.New("syntax error at CREATE TABEL")
		}})
		if err == nil || !strings.Contains(err.Error(), "Config.Migrate: syntax error at CREATE TABEL") {
			t.Errorf("err = %v, want the Migrate error", err)
		}
	})
	t.Run("no broker", func(t *testing.T) {
		t.Parallel()
		env := idemtest.New(t, idemtest.Config{})
		if env.NC != nil || env.JS != nil {
			t.Fatal("an Env without Config.NATSURL has a broker connection")
		}
		var n int
		if err := env.Pool.QueryRow(t.Context(), `SELECT count(*) FROM idem_inbox`).Scan(&n); err != nil {
			t.Fatalf("the database of an Env without a broker: %v", err)
		}
		_, err := idemtest.Check(t.Context(), env, idemtest.Case{
			Consumer: consumer.Config{Name: "shipping", Subject: subject, BatchHandler: rowsBatch{}},
			Message:  message(),
			Effects:  countRows,
		})
		if err == nil || !strings.Contains(err.Error(), "Config.NATSURL") || !strings.Contains(err.Error(), "embeddednats") {
			t.Errorf("Check without a broker: err = %v, want one naming Config.NATSURL and embeddednats", err)
		}
	})
	t.Run("Close drops the database", func(t *testing.T) {
		t.Parallel()
		env, err := idemtest.Start(t.Context(), idemtest.Config{})
		if err != nil {
			t.Fatal(err)
		}
		url := env.DatabaseURL
		if err := env.Close(); err != nil {
			t.Fatal(err)
		}
		if err := env.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
		c, err := pgx.Connect(t.Context(), url)
		if err == nil {
			c.Close(t.Context())
			t.Fatalf("database %s still exists after Close", url)
		}
		if !strings.Contains(err.Error(), "does not exist") {
			t.Errorf("connect after Close: %v, want \"does not exist\"", err)
		}
	})
}
