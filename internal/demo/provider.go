package demo

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sync"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
)

// Provider is a fake payment provider that honours Idempotency-Key over HTTP the
// way real ones do: the first request with a key executes and its response is
// stored; a repeat with the same key and the same request gets that response again
// (with Idempotent-Replayed: true) and executes nothing; a repeat with the same key
// and a different request is refused with 422. It counts requests and real
// executions per operation, so a test can tell "sent twice" from "charged twice".
//
// Operations (each requires an Idempotency-Key header):
//
//	POST /charges               {"account", "amount_cents"} -> 201 {"id", "status": "authorized", ...}   "authorize"
//	POST /charges/{id}/capture                              -> 200 {"id", "status": "captured", ...}     "capture"
//	POST /charges/{id}/receipt                              -> 200 {"id", "receipt_id", ...}              "receipt"
//
// It is an http.Handler: serve it with httptest.NewServer.
type Provider struct {
	mux *http.ServeMux

	mu         sync.Mutex
	seq        int
	charges    map[string]*ProviderCharge
	keys       map[string]storedReply
	requests   map[string]int
	executions map[string]int
}

// ProviderCharge is a charge as the provider keeps it.
type ProviderCharge struct {
	ID          string `json:"id"`
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
	Status      string `json:"status"` // authorized, captured
	ReceiptID   string `json:"receipt_id,omitempty"`
}

// storedReply is the first response to an idempotency key, with the fingerprint
// of the request that produced it.
type storedReply struct {
	fingerprint [32]byte
	status      int
	body        []byte
}

// Provider operations, as counted by Requests and Executions.
const (
	OpAuthorize = "authorize"
	OpCapture   = "capture"
	OpReceipt   = "receipt"
)

// NewProvider returns an empty provider.
func NewProvider() *Provider {
	p := &Provider{
		charges:    map[string]*ProviderCharge{},
		keys:       map[string]storedReply{},
		requests:   map[string]int{},
		executions: map[string]int{},
	}
	p.mux = http.NewServeMux()
	p.mux.HandleFunc("POST /charges", p.idempotent(OpAuthorize, p.authorize))
	p.mux.HandleFunc("POST /charges/{id}/capture", p.idempotent(OpCapture, p.capture))
	p.mux.HandleFunc("POST /charges/{id}/receipt", p.idempotent(OpReceipt, p.receipt))
	return p
}

// ServeHTTP implements http.Handler.
func (p *Provider) ServeHTTP(w http.ResponseWriter, r *http.Request) { p.mux.ServeHTTP(w, r) }

// Requests is how many requests for op arrived, replays included.
func (p *Provider) Requests(op string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.requests[op]
}

// Executions is how many times op really executed: the number a customer would see
// on their statement.
func (p *Provider) Executions(op string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.executions[op]
}

// Charges returns a copy of every charge.
func (p *Provider) Charges() []ProviderCharge {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]ProviderCharge, 0, len(p.charges))
	for i := 1; i <= p.seq; i++ {
		if c, ok := p.charges[fmt.Sprintf("ch_%d", i)]; ok {
			out = append(out, *c)
		}
	}
	return out
}

// operation executes one request, under the provider's lock, and returns the
// status and the value to answer with.
type operation func(r *http.Request, body []byte) (int, any)

// idempotent wraps an operation with the provider's Idempotency-Key handling. The
// whole provider is one lock, so concurrent requests with one key are simply
// serialised: the second is a replay.
func (p *Provider) idempotent(op string, run operation) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		if err != nil {
			providerReply(w, http.StatusBadRequest, providerError("reading body: "+err.Error()), false)
			return
		}
		key := r.Header.Get(idem.HeaderKey)
		p.mu.Lock()
		defer p.mu.Unlock()
		p.requests[op]++
		if key == "" {
			providerReply(w, http.StatusBadRequest, providerError("Idempotency-Key header is required"), false)
			return
		}
		fp := sha256.Sum256(append([]byte(r.Method+" "+r.URL.Path+"\n"), body...))
		if prev, ok := p.keys[key]; ok {
			if prev.fingerprint != fp {
				providerReply(w, http.StatusUnprocessableEntity,
					providerError("this Idempotency-Key was used with a different request"), false)
				return
			}
			writeRaw(w, prev.status, prev.body, true)
			return
		}
		status, v := run(r, body)
		out, _ := json.Marshal(v)
		if status < 500 {
			// A 5xx is not an answer to remember: the retry must execute.
			p.keys[key] = storedReply{fingerprint: fp, status: status, body: out}
		}
		if status >= 200 && status < 300 {
			p.executions[op]++
		}
		writeRaw(w, status, out, false)
	}
}

func (p *Provider) authorize(_ *http.Request, body []byte) (int, any) {
	c, err := DecodeCharge(body)
	if err != nil {
		return http.StatusBadRequest, providerError(err.Error())
	}
	p.seq++
	ch := &ProviderCharge{ID: fmt.Sprintf("ch_%d", p.seq), Account: c.Account, AmountCents: c.AmountCents, Status: "authorized"}
	p.charges[ch.ID] = ch
	return http.StatusCreated, *ch
}

func (p *Provider) capture(r *http.Request, _ []byte) (int, any) {
	ch, ok := p.charges[r.PathValue("id")]
	switch {
	case !ok:
		return http.StatusNotFound, providerError("no such charge")
	case ch.Status != "authorized":
		return http.StatusBadRequest, providerError("charge is " + ch.Status + ", not authorized")
	}
	ch.Status = "captured"
	return http.StatusOK, *ch
}

func (p *Provider) receipt(r *http.Request, _ []byte) (int, any) {
	ch, ok := p.charges[r.PathValue("id")]
	switch {
	case !ok:
		return http.StatusNotFound, providerError("no such charge")
	case ch.Status != "captured":
		return http.StatusBadRequest, providerError("charge is " + ch.Status + ", not captured")
	case ch.ReceiptID != "":
		return http.StatusBadRequest, providerError("receipt already sent")
	}
	ch.ReceiptID = "rc_" + ch.ID[len("ch_"):]
	return http.StatusOK, *ch
}

type providerErrorBody struct {
	Error string `json:"error"`
}

func providerError(msg string) providerErrorBody { return providerErrorBody{Error: msg} }

func providerReply(w http.ResponseWriter, status int, v any, replayed bool) {
	out, _ := json.Marshal(v)
	writeRaw(w, status, out, replayed)
}

func writeRaw(w http.ResponseWriter, status int, body []byte, replayed bool) {
	w.Header().Set("Content-Type", "application/json")
	if replayed {
		w.Header().Set(idem.HeaderReplayed, "true")
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// The steps of ProviderChargeHandler, in order; each is also the name of the
// recovery point recorded after it.
const (
	StepAuthorize = "authorize"
	StepCapture   = "capture"
	StepReceipt   = "receipt"
)

// ProviderChargeState is the recovery state of a provider charge: what the steps
// so far have learnt, and the handler's final result.
type ProviderChargeState struct {
	ChargeID  string `json:"charge_id,omitempty"`
	Captured  bool   `json:"captured,omitempty"`
	ReceiptID string `json:"receipt_id,omitempty"`
}

// ProviderChargeHandler charges through a Provider in three steps — authorize,
// capture, send the receipt — as an external effect with recovery points.
//
// Two mechanisms make a crash anywhere harmless, and they are different:
//
//   - Recovery points: after each step the handler checkpoints (Effect.Checkpoint)
//     the step and what it learnt (the charge id). An attempt that takes over
//     resumes after the last checkpoint: the steps before it are not sent again at
//     all.
//   - Idempotency keys: each step presents its own key derived from the intent's
//     (Effect.KeyFor), the same on every attempt. The one step that can be re-sent
//     — the one under way when the worker died, whose checkpoint never landed — is
//     replayed by the provider instead of executed twice.
type ProviderChargeHandler struct {
	base   string
	client *http.Client
}

var _ consumer.ExternalHandler = (*ProviderChargeHandler)(nil)

// NewProviderChargeHandler returns a handler calling the provider at baseURL with
// client (nil: http.DefaultClient).
func NewProviderChargeHandler(baseURL string, client *http.Client) (*ProviderChargeHandler, error) {
	if _, err := url.ParseRequestURI(baseURL); err != nil {
		return nil, fmt.Errorf("provider: base URL %q: %w", baseURL, err)
	}
	if client == nil {
		client = http.DefaultClient
	}
	return &ProviderChargeHandler{base: baseURL, client: client}, nil
}

// Perform implements consumer.ExternalHandler. The steps read as a resumable
// sequence: each runs only if the recovery point says the previous one is the last
// completed, and records its own.
func (h *ProviderChargeHandler) Perform(ctx context.Context, e *consumer.Effect) ([]byte, error) {
	charge, err := DecodeCharge(e.Payload)
	if err != nil {
		return nil, consumer.Permanent(err)
	}
	var st ProviderChargeState
	if len(e.StepState) > 0 {
		if err := json.Unmarshal(e.StepState, &st); err != nil {
			return nil, consumer.Permanent(fmt.Errorf("provider: corrupt recovery state at step %q: %w", e.Step, err))
		}
	}
	checkpoint := func(step string) error {
		state, _ := json.Marshal(st)
		return e.Checkpoint(ctx, step, state)
	}

	if e.Step == "" {
		var ch ProviderCharge
		if err := h.post(ctx, "/charges", e.KeyFor(StepAuthorize), charge, &ch); err != nil {
			return nil, fmt.Errorf("provider: authorize: %w", err)
		}
		st.ChargeID = ch.ID
		if err := checkpoint(StepAuthorize); err != nil {
			return nil, err
		}
	}
	if e.Step == StepAuthorize {
		if err := h.post(ctx, "/charges/"+url.PathEscape(st.ChargeID)+"/capture", e.KeyFor(StepCapture), nil, nil); err != nil {
			return nil, fmt.Errorf("provider: capture %s: %w", st.ChargeID, err)
		}
		st.Captured = true
		if err := checkpoint(StepCapture); err != nil {
			return nil, err
		}
	}
	if e.Step == StepCapture {
		var ch ProviderCharge
		if err := h.post(ctx, "/charges/"+url.PathEscape(st.ChargeID)+"/receipt", e.KeyFor(StepReceipt), nil, &ch); err != nil {
			return nil, fmt.Errorf("provider: receipt %s: %w", st.ChargeID, err)
		}
		st.ReceiptID = ch.ReceiptID
		if err := checkpoint(StepReceipt); err != nil {
			return nil, err
		}
	}
	if e.Step != StepReceipt {
		return nil, consumer.Permanent(fmt.Errorf("provider: unknown recovery point %q", e.Step))
	}
	return json.Marshal(st)
}

// post sends one provider request with its idempotency key and decodes the answer
// into out (if not nil). A 4xx other than 409 and 429 is permanent: the same
// request cannot succeed later. Anything else (5xx, 409 in flight, 429, network)
// is retried, with the same key.
func (h *ProviderChargeHandler) post(ctx context.Context, path, key string, in, out any) error {
	var body io.Reader = http.NoBody
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.base+path, body)
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
	switch {
	case resp.StatusCode >= 200 && resp.StatusCode < 300:
	case resp.StatusCode >= 400 && resp.StatusCode < 500 &&
		resp.StatusCode != http.StatusConflict && resp.StatusCode != http.StatusTooManyRequests:
		return consumer.Permanent(fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(raw)))
	default:
		return fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(raw))
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(raw, out); err != nil {
		return errors.Join(errors.New("undecodable provider answer"), err)
	}
	return nil
}
