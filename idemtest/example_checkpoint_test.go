package idemtest_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/idemtest"
	"github.com/idemkit/idem/install"
)

// charge is the payload of a charge message.
type charge struct {
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
}

func decodeCharge(payload []byte) (charge, error) {
	var c charge
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return c, fmt.Errorf("charge: decode: %w", err)
	}
	if c.Account == "" || c.AmountCents <= 0 {
		return c, fmt.Errorf("charge: want an account and a positive amount_cents, got %+v", c)
	}
	return c, nil
}

// The steps of chargeHandler, in order; each is also the name of the recovery point
// recorded after it.
const (
	stepAuthorize = "authorize"
	stepCapture   = "capture"
	stepReceipt   = "receipt"
)

// chargeState is what the steps so far have learnt: the recovery point's state, and
// the handler's result once all three are done.
type chargeState struct {
	ChargeID  string `json:"charge_id,omitempty"`
	Captured  bool   `json:"captured,omitempty"`
	ReceiptID string `json:"receipt_id,omitempty"`
}

// chargeHandler charges through a payment provider in three steps — authorize,
// capture, send the receipt — as an external effect. Two mechanisms make a crash
// anywhere harmless:
//
//   - Recovery points: after each step the handler records the step and what it
//     learnt (e.Checkpoint). An attempt that takes over resumes after the last
//     recovery point: the steps before it are not sent again at all.
//   - Idempotency keys: each step presents its own key, derived from the intent's
//     (e.KeyFor) and the same on every attempt. The one step that can be sent
//     twice — the one under way when the worker died, whose recovery point never
//     landed — is replayed by the provider instead of executed twice.
type chargeHandler struct {
	baseURL string
	client  *http.Client
}

func (h *chargeHandler) Perform(ctx context.Context, e *consumer.Effect) ([]byte, error) {
	c, err := decodeCharge(e.Payload)
	if err != nil {
		return nil, consumer.Permanent(err) // no retry fixes the payload
	}
	var st chargeState
	if len(e.StepState) > 0 {
		if err := json.Unmarshal(e.StepState, &st); err != nil {
			return nil, consumer.Permanent(fmt.Errorf("corrupt recovery state after %q: %w", e.Step, err))
		}
	}
	checkpoint := func(step string) error {
		state, _ := json.Marshal(st)
		return e.Checkpoint(ctx, step, state) // also advances e.Step
	}

	// Each step runs only if the recovery point says the one before is the last done.
	if e.Step == "" {
		var ch providerCharge
		if err := h.post(ctx, "/charges", e.KeyFor(stepAuthorize), c, &ch); err != nil {
			return nil, fmt.Errorf("authorize: %w", err)
		}
		st.ChargeID = ch.ID
		if err := checkpoint(stepAuthorize); err != nil {
			return nil, err
		}
	}
	if e.Step == stepAuthorize {
		if err := h.post(ctx, "/charges/"+url.PathEscape(st.ChargeID)+"/capture", e.KeyFor(stepCapture), nil, nil); err != nil {
			return nil, fmt.Errorf("capture %s: %w", st.ChargeID, err)
		}
		st.Captured = true
		if err := checkpoint(stepCapture); err != nil {
			return nil, err
		}
	}
	if e.Step == stepCapture {
		var ch providerCharge
		if err := h.post(ctx, "/charges/"+url.PathEscape(st.ChargeID)+"/receipt", e.KeyFor(stepReceipt), nil, &ch); err != nil {
			return nil, fmt.Errorf("receipt %s: %w", st.ChargeID, err)
		}
		st.ReceiptID = ch.ReceiptID
		if err := checkpoint(stepReceipt); err != nil {
			return nil, err
		}
	}
	if e.Step != stepReceipt {
		return nil, consumer.Permanent(fmt.Errorf("unknown recovery point %q", e.Step))
	}
	return json.Marshal(st)
}

// post sends one provider request with its idempotency key and decodes the answer
// into out (if not nil). A 4xx other than 409 and 429 is permanent: the same
// request cannot succeed later. Anything else (5xx, 409, 429, the network) is
// retried, with the same key.
func (h *chargeHandler) post(ctx context.Context, path, key string, in, out any) error {
	var body io.Reader = http.NoBody
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.baseURL+path, body)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(idem.HeaderKey, key)
	resp, err := h.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return err
	}
	switch s := resp.StatusCode; {
	case s >= 200 && s < 300:
	case s >= 400 && s < 500 && s != http.StatusConflict && s != http.StatusTooManyRequests:
		return consumer.Permanent(fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(raw)))
	default:
		return fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(raw))
	}
	if out == nil {
		return nil
	}
	return json.Unmarshal(raw, out)
}

// provider is a fake payment provider that honours Idempotency-Key as real ones do:
// the first request with a key executes and its answer is stored; a repeat with the
// same key and request gets that answer again (Idempotent-Replayed: true) and
// executes nothing; the same key with another request is refused with 422. It
// counts requests and executions per operation: "sent twice" is not "charged twice".
//
//	POST /charges              {"account","amount_cents"} -> 201 authorized   authorize
//	POST /charges/{id}/capture                            -> 200 captured     capture
//	POST /charges/{id}/receipt                            -> 200 receipt_id   receipt
type provider struct {
	mux *http.ServeMux

	mu                   sync.Mutex // one lock: two requests with one key are serialised
	charges              []*providerCharge
	replies              map[string]providerReply // by Idempotency-Key
	requests, executions map[string]int           // by operation
}

type providerCharge struct {
	ID          string `json:"id"`
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
	Status      string `json:"status"` // authorized, captured
	ReceiptID   string `json:"receipt_id,omitempty"`
}

type providerReply struct {
	fingerprint [32]byte // of the request that produced it
	status      int
	body        []byte
}

func newProvider() *provider {
	p := &provider{replies: map[string]providerReply{}, requests: map[string]int{}, executions: map[string]int{}}
	p.mux = http.NewServeMux()
	p.mux.HandleFunc("POST /charges", p.idempotent(stepAuthorize, p.authorize))
	p.mux.HandleFunc("POST /charges/{id}/capture", p.idempotent(stepCapture, p.capture))
	p.mux.HandleFunc("POST /charges/{id}/receipt", p.idempotent(stepReceipt, p.receipt))
	return p
}

func (p *provider) ServeHTTP(w http.ResponseWriter, r *http.Request) { p.mux.ServeHTTP(w, r) }

// Requests is how many requests for op arrived, replays included.
func (p *provider) Requests(op string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.requests[op]
}

// Executions is how many times op really executed: what the customer would see.
func (p *provider) Executions(op string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.executions[op]
}

// Charges returns a copy of every charge, in creation order.
func (p *provider) Charges() []providerCharge {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]providerCharge, len(p.charges))
	for i, c := range p.charges {
		out[i] = *c
	}
	return out
}

// idempotent wraps one operation, run under the provider's lock, with the
// Idempotency-Key handling.
func (p *provider) idempotent(op string, run func(r *http.Request, body []byte) (int, any)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		key := r.Header.Get(idem.HeaderKey)
		fp := sha256.Sum256(append([]byte(r.Method+" "+r.URL.Path+"\n"), body...))
		p.mu.Lock()
		defer p.mu.Unlock()
		p.requests[op]++
		prev, seen := p.replies[key]
		switch {
		case key == "":
			reply(w, http.StatusBadRequest, providerError("Idempotency-Key header is required"), false)
		case seen && prev.fingerprint != fp:
			reply(w, http.StatusUnprocessableEntity, providerError("this Idempotency-Key was used with a different request"), false)
		case seen:
			writeReply(w, prev.status, prev.body, true)
		default:
			status, v := run(r, body)
			out, _ := json.Marshal(v)
			if status < 500 { // a 5xx is no answer to remember: the retry must execute
				p.replies[key] = providerReply{fingerprint: fp, status: status, body: out}
			}
			if status < 300 {
				p.executions[op]++
			}
			writeReply(w, status, out, false)
		}
	}
}

func (p *provider) authorize(_ *http.Request, body []byte) (int, any) {
	c, err := decodeCharge(body)
	if err != nil {
		return http.StatusBadRequest, providerError(err.Error())
	}
	ch := &providerCharge{ID: fmt.Sprintf("ch_%d", len(p.charges)+1), Account: c.Account, AmountCents: c.AmountCents, Status: "authorized"}
	p.charges = append(p.charges, ch)
	return http.StatusCreated, *ch
}

func (p *provider) capture(r *http.Request, _ []byte) (int, any) {
	ch := p.charge(r.PathValue("id"))
	switch {
	case ch == nil:
		return http.StatusNotFound, providerError("no such charge")
	case ch.Status != "authorized":
		return http.StatusBadRequest, providerError("charge is " + ch.Status + ", not authorized")
	}
	ch.Status = "captured"
	return http.StatusOK, *ch
}

func (p *provider) receipt(r *http.Request, _ []byte) (int, any) {
	ch := p.charge(r.PathValue("id"))
	switch {
	case ch == nil:
		return http.StatusNotFound, providerError("no such charge")
	case ch.Status != "captured":
		return http.StatusBadRequest, providerError("charge is " + ch.Status + ", not captured")
	case ch.ReceiptID != "":
		return http.StatusBadRequest, providerError("receipt already sent")
	}
	ch.ReceiptID = "rc_" + strings.TrimPrefix(ch.ID, "ch_")
	return http.StatusOK, *ch
}

func (p *provider) charge(id string) *providerCharge {
	for _, c := range p.charges {
		if c.ID == id {
			return c
		}
	}
	return nil
}

func providerError(msg string) any { return map[string]string{"error": msg} }

func reply(w http.ResponseWriter, status int, v any, replayed bool) {
	out, _ := json.Marshal(v)
	writeReply(w, status, out, replayed)
}

func writeReply(w http.ResponseWriter, status int, body []byte, replayed bool) {
	w.Header().Set("Content-Type", "application/json")
	if replayed {
		w.Header().Set(idem.HeaderReplayed, "true")
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// A charge in three steps through a payment provider, as a consumer.External
// handler with recovery points (consumer.Effect.Checkpoint). The provider is
// overloaded at the first capture: that attempt fails, its lease is released with
// the recovery point "authorize", and the retry resumes at the capture. The
// authorization is not sent a second time, and every operation executes once.
func Example_checkpointedExternal() {
	ctx := context.Background()
	// A throwaway Postgres database with idem's tables and an embedded JetStream.
	env, err := idemtest.Start(ctx, idemtest.Config{NATSURL: newServer()})
	if err != nil {
		log.Fatal(err)
	}
	defer env.Close()
	// The installation, its observer waiting for the charge to complete.
	charged := make(chan struct{})
	var once sync.Once
	inst, err := install.New(env.Pool, env.NC, install.Config{
		Stream: install.Stream{Name: "PAYMENTS", Subjects: []string{"payments.>"}},
		Observer: func(e idem.Event) {
			if e.Component == idem.ComponentConsumer && e.Outcome == idem.OutcomeProcessed {
				once.Do(func() { close(charged) })
			}
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := inst.EnsureStream(ctx); err != nil {
		log.Fatal(err)
	}

	// The provider, answering 503 to the first capture, and printing what it gets.
	p := newProvider()
	var overloaded atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/capture") && overloaded.CompareAndSwap(false, true) {
			fmt.Println("provider:", r.Method, r.URL.Path, "-> 503")
			http.Error(w, "overloaded, try again", http.StatusServiceUnavailable)
			return
		}
		fmt.Println("provider:", r.Method, r.URL.Path)
		p.ServeHTTP(w, r)
	}))
	defer srv.Close()

	c, err := consumer.New(inst, consumer.Config{
		Name:     "provider-charges",
		Subject:  "payments.charge",
		External: &chargeHandler{baseURL: srv.URL, client: srv.Client()},
		Backoff:  func(int) time.Duration { return 100 * time.Millisecond }, // retry soon, for the example
	})
	if err != nil {
		log.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- c.Run(runCtx) }()

	// One intent. In a service the outbox's relay publishes it; its key came from
	// the client.
	msg := nats.NewMsg("payments.charge")
	msg.Header.Set(idem.HeaderKey, idem.NewKey().String())
	msg.Data = []byte(`{"account":"acct_1","amount_cents":1250}`)
	if _, err := env.JS.PublishMsg(ctx, msg); err != nil {
		log.Fatal(err)
	}
	select {
	case <-charged:
	case <-time.After(30 * time.Second):
		log.Fatal("the charge was not completed")
	}
	stop()
	if err := <-stopped; err != nil {
		log.Fatal(err)
	}

	for _, op := range []string{stepAuthorize, stepCapture, stepReceipt} {
		fmt.Printf("%s: %d execution(s)\n", op, p.Executions(op))
	}
	ch := p.Charges()[0]
	fmt.Println(ch.ID, ch.Status, ch.ReceiptID)
	// Output:
	// provider: POST /charges
	// provider: POST /charges/ch_1/capture -> 503
	// provider: POST /charges/ch_1/capture
	// provider: POST /charges/ch_1/receipt
	// authorize: 1 execution(s)
	// capture: 1 execution(s)
	// receipt: 1 execution(s)
	// ch_1 captured rc_1
}
