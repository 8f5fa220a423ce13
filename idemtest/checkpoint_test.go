package idemtest_test

// Tests of the checkpoint example's provider and handler (example_checkpoint_test.go,
// which lives here, beside idemtest.Start, so that it imports public packages only):
// the fake provider keeps its promise, and the three-step charge survives a worker
// dying at every position that matters.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

const chargesName = "provider-charges"

func chargePayload(account string, cents int64) []byte {
	b, _ := json.Marshal(charge{Account: account, AmountCents: cents})
	return b
}

// chargesConfig is an External running h with short leases and quick retries.
func chargesConfig(h consumer.ExternalHandler) consumer.Config {
	return consumer.Config{
		Name: chargesName, Subject: testenv.Subject, External: h,
		LeaseFor: 800 * time.Millisecond, AckWait: 300 * time.Millisecond,
		Backoff: func(int) time.Duration { return 50 * time.Millisecond },
	}
}

// runCharges runs cfg on env's installation, its outcomes counted by out.
func runCharges(t *testing.T, ctx context.Context, env *testenv.Env, out *testenv.Outcomes, cfg consumer.Config) (stop func()) {
	t.Helper()
	c, err := consumer.New(env.Observed(t, out.Observe), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return testenv.GoCtx(t, ctx, "consumer "+cfg.Name, c.Run)
}

func providerPost(t *testing.T, srv *httptest.Server, path, key, body string) (int, string, bool) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set(idem.HeaderKey, key)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header.Get(idem.HeaderReplayed) == "true"
}

// The fake provider keeps its promise: one execution per key, the first answer
// replayed, a key reused for another request refused, no key refused.
func TestProviderHonoursIdempotencyKey(t *testing.T) {
	t.Parallel()
	p := newProvider()
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	body := string(chargePayload("acct_1", 1250))

	st1, body1, replayed1 := providerPost(t, srv, "/charges", "K1", body)
	st2, body2, replayed2 := providerPost(t, srv, "/charges", "K1", body)
	if st1 != http.StatusCreated || replayed1 || st2 != st1 || body2 != body1 || !replayed2 {
		t.Fatalf("first %d %s (replayed %v), repeat %d %s (replayed %v): want the first answer replayed", st1, body1, replayed1, st2, body2, replayed2)
	}
	if p.Executions(stepAuthorize) != 1 || p.Requests(stepAuthorize) != 2 {
		t.Fatalf("authorize: %d executions of %d requests, want 1 of 2", p.Executions(stepAuthorize), p.Requests(stepAuthorize))
	}
	if st, _, _ := providerPost(t, srv, "/charges", "K1", string(chargePayload("acct_1", 9999))); st != http.StatusUnprocessableEntity {
		t.Errorf("same key, other request: %d, want 422", st)
	}
	if st, _, _ := providerPost(t, srv, "/charges", "", body); st != http.StatusBadRequest {
		t.Errorf("no key: %d, want 400", st)
	}
	// Two keys are two intents: two charges.
	if st, _, _ := providerPost(t, srv, "/charges", "K2", body); st != http.StatusCreated {
		t.Errorf("second key: %d, want 201", st)
	}
	if n := len(p.Charges()); n != 2 {
		t.Errorf("charges = %d, want 2", n)
	}
	// Capture: once per key; a second capture under another key is refused.
	if st, _, _ := providerPost(t, srv, "/charges/ch_1/capture", "C1", ""); st != http.StatusOK {
		t.Errorf("capture: %d", st)
	}
	if st, _, replayed := providerPost(t, srv, "/charges/ch_1/capture", "C1", ""); st != http.StatusOK || !replayed {
		t.Errorf("capture repeat: %d replayed=%v, want a replayed 200", st, replayed)
	}
	if st, _, _ := providerPost(t, srv, "/charges/ch_1/capture", "C2", ""); st != http.StatusBadRequest {
		t.Errorf("capture again under a new key: %d, want 400", st)
	}
	if p.Executions(stepCapture) != 1 {
		t.Errorf("capture executions = %d, want 1", p.Executions(stepCapture))
	}
	// Receipt: only for a captured charge, once.
	if st, _, _ := providerPost(t, srv, "/charges/ch_2/receipt", "R2", ""); st != http.StatusBadRequest {
		t.Errorf("receipt of an uncaptured charge: %d, want 400", st)
	}
	if st, body, _ := providerPost(t, srv, "/charges/ch_1/receipt", "R1", ""); st != http.StatusOK || !strings.Contains(body, `"receipt_id":"rc_1"`) {
		t.Errorf("receipt: %d %s, want 200 with rc_1", st, body)
	}
	if st, _, _ := providerPost(t, srv, "/charges/ch_9/capture", "C9", ""); st != http.StatusNotFound {
		t.Errorf("capture of no charge: %d, want 404", st)
	}
}

var errWorkerDied = errors.New("fault: the worker died here")

// dyingTransport makes the worker "die" at its first capture request: before the
// request leaves (sendFirst false), or after the provider executed it and before
// its answer is read (sendFirst true).
type dyingTransport struct {
	next      http.RoundTripper
	sendFirst bool
	fired     atomic.Bool
}

func (d *dyingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if strings.HasSuffix(r.URL.Path, "/capture") && d.fired.CompareAndSwap(false, true) {
		if d.sendFirst {
			resp, err := d.next.RoundTrip(r)
			if err == nil {
				resp.Body.Close()
			}
		}
		return nil, errWorkerDied
	}
	return d.next.RoundTrip(r)
}

// A three-step charge (authorize -> capture -> receipt) whose worker dies part-way
// is finished by the next worker: one authorization, one capture, one receipt at
// the provider. Recovery points keep the steps before the crash from being sent
// again; the per-step keys make the step that was under way harmless to re-send.
//
// A death is the fault point ExternalAfterPerform abandoning the attempt: its lease
// is neither completed nor released and its message neither acked nor handed back,
// as if the process had died. For a death inside a step, the first worker's handler
// stops at the dying request and reaches that point at once.
func TestProviderChargeResumesAfterWorkerDies(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		// sendFirst: the dying capture reached the provider; afterAll: the worker
		// died after all three steps, before completing; forget: the recovery
		// point is wiped before the takeover (only the keys are left to protect).
		sendFirst, afterAll, forget bool
		// requests the provider receives per operation
		authorize, capture, receipt int
	}{
		{name: "dies after authorize, before capture is sent", authorize: 1, capture: 1, receipt: 1},
		{name: "dies after the provider captured, before the checkpoint", sendFirst: true, authorize: 1, capture: 2, receipt: 1},
		{name: "dies after the last step, before completing", afterAll: true, authorize: 1, capture: 1, receipt: 1},
		{name: "recovery point lost: keys alone fold the re-sent steps", forget: true, authorize: 2, capture: 1, receipt: 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := testenv.New(t)
			out := &testenv.Outcomes{}
			p := newProvider()
			srv := httptest.NewServer(p)
			t.Cleanup(srv.Close)
			tr := &dyingTransport{next: srv.Client().Transport, sendFirst: tc.sendFirst}
			if tc.afterAll {
				tr.fired.Store(true) // no dying request; the worker dies after the last step
			}
			h := &chargeHandler{baseURL: srv.URL, client: &http.Client{Transport: tr, Timeout: 5 * time.Second}}

			// The first worker: its handler ends the attempt where the transport
			// died, and the fault point then abandons it.
			var dying, died atomic.Bool
			first := consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
				res, err := h.Perform(ctx, e)
				if errors.Is(err, errWorkerDied) {
					dying.Store(true)
					return nil, nil
				}
				return res, err
			})
			fs := faults.New().Func(faults.ExternalAfterPerform, func(context.Context, []string) error {
				if dying.CompareAndSwap(true, false) || (tc.afterAll && !died.Load()) {
					died.Store(true)
					return errWorkerDied
				}
				return nil
			})
			key := "k-provider"
			env.Publish(t, testenv.Subject, key, key, chargePayload("acct_1", 1250))
			stop := runCharges(t, faults.With(context.Background(), fs), env, out, chargesConfig(first))
			testenv.Eventually(t, 45*time.Second, "the first worker to die", died.Load)
			stop()
			var status, step string
			if err := env.DB.Pool.QueryRow(context.Background(),
				`SELECT status, coalesce(step, '') FROM idem_inbox WHERE consumer = $1 AND key = $2`, chargesName, key).Scan(&status, &step); err != nil {
				t.Fatal(err)
			}
			if status != "leased" {
				t.Fatalf("after the death the key is %q (step %q), want leased", status, step)
			}
			if tc.forget {
				if _, err := env.DB.Pool.Exec(context.Background(), `UPDATE idem_inbox SET step = NULL, step_state = NULL WHERE key = $1`, key); err != nil {
					t.Fatal(err)
				}
			}

			runCharges(t, context.Background(), env, out, chargesConfig(h)) // the next worker
			testenv.Eventually(t, 45*time.Second, "the takeover to complete the charge", func() bool {
				return out.Get(idem.OutcomeProcessed) == 1
			})

			for _, op := range []string{stepAuthorize, stepCapture, stepReceipt} {
				if n := p.Executions(op); n != 1 {
					t.Errorf("%s executed %d times at the provider, want 1", op, n)
				}
			}
			if a, c, r := p.Requests(stepAuthorize), p.Requests(stepCapture), p.Requests(stepReceipt); a != tc.authorize || c != tc.capture || r != tc.receipt {
				t.Errorf("requests authorize/capture/receipt = %d/%d/%d, want %d/%d/%d", a, c, r, tc.authorize, tc.capture, tc.receipt)
			}
			charges := p.Charges()
			if len(charges) != 1 || charges[0].Status != "captured" || charges[0].ReceiptID == "" {
				t.Fatalf("provider charges = %+v, want one captured charge with a receipt", charges)
			}
			var result []byte
			var attempts int
			if err := env.DB.Pool.QueryRow(context.Background(),
				`SELECT step, result, lease_attempts FROM idem_inbox WHERE key = $1 AND status = 'done'`, key).Scan(&step, &result, &attempts); err != nil {
				t.Fatal(err)
			}
			var st chargeState
			if err := json.Unmarshal(result, &st); err != nil || st.ChargeID != charges[0].ID || !st.Captured || st.ReceiptID != charges[0].ReceiptID {
				t.Errorf("stored result %s (%v), want the charge and its receipt", result, err)
			}
			if step != stepReceipt || attempts != 2 {
				t.Errorf("inbox step %q after %d attempts, want %q after 2", step, attempts, stepReceipt)
			}
		})
	}
}

// A payload that is not a charge is permanent: dead-lettered, not retried, and
// never sent to the provider.
func TestProviderChargeBadPayloadIsDeadLettered(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	out := &testenv.Outcomes{}
	p := newProvider()
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	h := &chargeHandler{baseURL: srv.URL, client: srv.Client()}
	env.Publish(t, testenv.Subject, "k-bad", "k-bad", []byte(`{"account":"a","amount_cents":-1}`))
	env.Publish(t, testenv.Subject, "k-unknown", "k-unknown", []byte(`{"account":"a","amount_cents":1,"currency":"EUR"}`))
	env.Publish(t, testenv.Subject, "k-ok", "k-ok", chargePayload("a", 1))
	runCharges(t, context.Background(), env, out, chargesConfig(h))
	drained := env.Drained(t, chargesName)
	testenv.Eventually(t, 45*time.Second, "1 processed and every message settled", func() bool {
		return out.Get(idem.OutcomeProcessed) == 1 && drained()
	})
	for _, key := range []string{"k-bad", "k-unknown"} {
		if n := env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = $1 AND deliveries = 1 AND reason LIKE 'permanent handler error%'`, key); n != 1 {
			t.Errorf("dead letters for %s = %d, want 1 after one delivery", key, n)
		}
	}
	if n := p.Requests(stepAuthorize); n != 1 {
		t.Errorf("authorize requests = %d, want 1 (the bad payloads never reach the provider)", n)
	}
}

// A request the provider refuses with a 4xx (here: a wrong base URL, 404) is
// permanent: dead-lettered after one attempt with the provider's answer as reason.
func TestProviderChargeRefusalIsDeadLettered(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	out := &testenv.Outcomes{}
	srv := httptest.NewServer(newProvider())
	t.Cleanup(srv.Close)
	h := &chargeHandler{baseURL: srv.URL + "/v0", client: srv.Client()}
	env.Publish(t, testenv.Subject, "k-refused", "k-refused", chargePayload("a", 1))
	runCharges(t, context.Background(), env, out, chargesConfig(h))
	testenv.Eventually(t, 45*time.Second, "the refusal dead-lettered", func() bool {
		return out.Get(idem.OutcomeDeadLettered) == 1
	})
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'k-refused' AND deliveries = 1 AND reason LIKE '%404 Not Found%'`); n != 1 {
		t.Errorf("dead letters with the 404 as reason after 1 delivery = %d, want 1", n)
	}
}

// A provider that is down (5xx) is retried with the same keys, not dead-lettered,
// and the retry resumes after the last recovery point.
func TestProviderChargeRetriesProviderFailure(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	out := &testenv.Outcomes{}
	p := newProvider()
	var failures atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/receipt") && failures.Add(1) <= 2 {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		p.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	h := &chargeHandler{baseURL: srv.URL, client: srv.Client()}
	env.Publish(t, testenv.Subject, "k-retry", "k-retry", chargePayload("a", 7))
	runCharges(t, context.Background(), env, out, chargesConfig(h))
	testenv.Eventually(t, 45*time.Second, "the charge completed", func() bool {
		return out.Get(idem.OutcomeProcessed) == 1
	})
	if n := out.Get(idem.OutcomeFailed); n != 2 {
		t.Errorf("failed attempts = %d, want 2 (the two 503s)", n)
	}
	got := fmt.Sprintf("%d/%d/%d", p.Requests(stepAuthorize), p.Requests(stepCapture), p.Requests(stepReceipt))
	if got != "1/1/1" {
		t.Errorf("requests reaching the provider authorize/capture/receipt = %s, want 1/1/1: the retries resume at the receipt", got)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE key = 'k-retry' AND status = 'done' AND lease_attempts = 3`); n != 1 {
		t.Errorf("inbox row not done after 3 attempts")
	}
}
