package demo_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/demo"
	"github.com/idemkit/idem/internal/testenv"
)

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
	p := demo.NewProvider()
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	charge := `{"account":"acct_1","amount_cents":1250}`

	st1, body1, replayed1 := providerPost(t, srv, "/charges", "K1", charge)
	st2, body2, replayed2 := providerPost(t, srv, "/charges", "K1", charge)
	if st1 != http.StatusCreated || replayed1 || st2 != st1 || body2 != body1 || !replayed2 {
		t.Fatalf("first %d %s (replayed %v), repeat %d %s (replayed %v): want the first answer replayed", st1, body1, replayed1, st2, body2, replayed2)
	}
	if p.Executions(demo.OpAuthorize) != 1 || p.Requests(demo.OpAuthorize) != 2 {
		t.Fatalf("authorize: %d executions of %d requests, want 1 of 2", p.Executions(demo.OpAuthorize), p.Requests(demo.OpAuthorize))
	}
	if st, _, _ := providerPost(t, srv, "/charges", "K1", `{"account":"acct_1","amount_cents":9999}`); st != http.StatusUnprocessableEntity {
		t.Errorf("same key, other request: %d, want 422", st)
	}
	if st, _, _ := providerPost(t, srv, "/charges", "", charge); st != http.StatusBadRequest {
		t.Errorf("no key: %d, want 400", st)
	}
	// Two keys are two intents: two charges.
	if st, _, _ := providerPost(t, srv, "/charges", "K2", charge); st != http.StatusCreated {
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
	if p.Executions(demo.OpCapture) != 1 {
		t.Errorf("capture executions = %d, want 1", p.Executions(demo.OpCapture))
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
func TestProviderChargeResumesAfterWorkerDies(t *testing.T) {
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
			out := &extCounts{}
			p := demo.NewProvider()
			srv := httptest.NewServer(p)
			t.Cleanup(srv.Close)
			tr := &dyingTransport{next: srv.Client().Transport, sendFirst: tc.sendFirst}
			if tc.afterAll {
				tr.fired.Store(true) // no dying request; the fault is AfterPerform's
			}
			h, err := demo.NewProviderChargeHandler(srv.URL, &http.Client{Transport: tr, Timeout: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			var died atomic.Bool
			cfg := consumer.ExternalConfig{
				Name: "provider-charges", Subject: idem.SubjectCharge, Handler: h,
				LeaseFor: 800 * time.Millisecond, AckWait: 300 * time.Millisecond,
				Backoff:   func(int) time.Duration { return 50 * time.Millisecond },
				OnOutcome: out.add,
				AfterPerform: func(_ context.Context, _ *consumer.Delivery, err error) error {
					if errors.Is(err, errWorkerDied) || (tc.afterAll && err == nil && !died.Load()) {
						died.Store(true)
						return errWorkerDied
					}
					return nil
				},
			}
			key := "k-provider"
			env.Publish(t, idem.SubjectCharge, key, key, testenv.ChargePayload("acct_1", 1250))
			stop := runExternal(t, env, cfg)
			testenv.Eventually(t, 45*time.Second, "the first worker to die", died.Load)
			stop()
			if tc.forget {
				if _, err := env.DB.Pool.Exec(context.Background(), `UPDATE idem_inbox SET step = NULL, step_state = NULL WHERE key = $1`, key); err != nil {
					t.Fatal(err)
				}
			}

			runExternal(t, env, cfg) // the next worker
			testenv.Eventually(t, 45*time.Second, "the takeover to complete the charge", func() bool {
				return out.get(consumer.OutcomeProcessed) == 1
			})

			for _, op := range []string{demo.OpAuthorize, demo.OpCapture, demo.OpReceipt} {
				if n := p.Executions(op); n != 1 {
					t.Errorf("%s executed %d times at the provider, want 1", op, n)
				}
			}
			if a, c, r := p.Requests(demo.OpAuthorize), p.Requests(demo.OpCapture), p.Requests(demo.OpReceipt); a != tc.authorize || c != tc.capture || r != tc.receipt {
				t.Errorf("requests authorize/capture/receipt = %d/%d/%d, want %d/%d/%d", a, c, r, tc.authorize, tc.capture, tc.receipt)
			}
			charges := p.Charges()
			if len(charges) != 1 || charges[0].Status != "captured" || charges[0].ReceiptID == "" {
				t.Fatalf("provider charges = %+v, want one captured charge with a receipt", charges)
			}
			var step string
			var result []byte
			var attempts int
			if err := env.DB.Pool.QueryRow(context.Background(),
				`SELECT step, result, lease_attempts FROM idem_inbox WHERE key = $1 AND status = 'done'`, key).Scan(&step, &result, &attempts); err != nil {
				t.Fatal(err)
			}
			var st demo.ProviderChargeState
			if err := json.Unmarshal(result, &st); err != nil || st.ChargeID != charges[0].ID || !st.Captured || st.ReceiptID != charges[0].ReceiptID {
				t.Errorf("stored result %s (%v), want the charge and its receipt", result, err)
			}
			if step != demo.StepReceipt || attempts != 2 {
				t.Errorf("inbox step %q after %d attempts, want %q after 2", step, attempts, demo.StepReceipt)
			}
		})
	}
}

// A payload that is not a charge is permanent: dead-lettered, not retried, and
// never sent to the provider.
func TestProviderChargeBadPayloadIsDeadLettered(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	out := &extCounts{}
	p := demo.NewProvider()
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	h, err := demo.NewProviderChargeHandler(srv.URL, srv.Client())
	if err != nil {
		t.Fatal(err)
	}
	env.Publish(t, idem.SubjectCharge, "k-bad", "k-bad", []byte(`{"account":"a","amount_cents":-1}`))
	env.Publish(t, idem.SubjectCharge, "k-ok", "k-ok", testenv.ChargePayload("a", 1))
	runExternal(t, env, consumer.ExternalConfig{Name: "provider-charges", Subject: idem.SubjectCharge, Handler: h, OnOutcome: out.add})
	drained := env.Drained(t, "provider-charges")
	testenv.Eventually(t, 45*time.Second, "1 processed and both messages settled", func() bool {
		return out.get(consumer.OutcomeProcessed) == 1 && drained()
	})
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'k-bad'`); n != 1 {
		t.Errorf("dead letters for k-bad = %d, want 1", n)
	}
	if n := p.Requests(demo.OpAuthorize); n != 1 {
		t.Errorf("authorize requests = %d, want 1 (the bad payload never reaches the provider)", n)
	}
}

// A request the provider refuses with a 4xx (here: a wrong base URL, 404) is
// permanent: dead-lettered after one attempt with the provider's answer as reason.
func TestProviderChargeRefusalIsDeadLettered(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	out := &extCounts{}
	srv := httptest.NewServer(demo.NewProvider())
	t.Cleanup(srv.Close)
	h, err := demo.NewProviderChargeHandler(srv.URL+"/v0", srv.Client())
	if err != nil {
		t.Fatal(err)
	}
	env.Publish(t, idem.SubjectCharge, "k-refused", "k-refused", testenv.ChargePayload("a", 1))
	runExternal(t, env, consumer.ExternalConfig{Name: "provider-charges", Subject: idem.SubjectCharge, Handler: h, OnOutcome: out.add})
	testenv.Eventually(t, 45*time.Second, "the refusal dead-lettered", func() bool {
		return out.get(consumer.OutcomeDeadLettered) == 1
	})
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE key = 'k-refused' AND deliveries = 1 AND reason LIKE '%404 Not Found%'`); n != 1 {
		t.Errorf("dead letters with the 404 as reason after 1 delivery = %d, want 1", n)
	}
}
