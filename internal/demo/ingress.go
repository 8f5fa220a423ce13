package demo

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/producer"
)

// The demo's business SQL. The middleware owns idem_requests and outbox.Enqueue owns
// idem_outbox; the handlers only write their own tables.
const (
	sqlInsertPayment = `
INSERT INTO payments (scope, idempotency_key, account, amount_cents)
VALUES ($1, $2, $3, $4)
RETURNING id`

	sqlInsertEmail = `
INSERT INTO emails (scope, idempotency_key, recipient, subject)
VALUES ($1, $2, $3, $4)
RETURNING id`
)

// NewIngress returns the demo API: POST /v1/payments and POST /v1/emails, each
// guarded by a producer.Middleware configured by cfg.
//
// Each route is wrapped on its own rather than wrapping the whole mux, so that a
// request to an unknown path or with the wrong method is answered 404/405 by the
// mux without claiming its key: the client's mistake should not use up the key.
func NewIngress(pool *pgxpool.Pool, cfg producer.MiddlewareConfig) (http.Handler, error) {
	mw, err := producer.NewMiddleware(pool, cfg)
	if err != nil {
		return nil, fmt.Errorf("demo: ingress: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	in := &ingress{log: log}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/payments", mw.Wrap(http.HandlerFunc(in.payment)))
	mux.Handle("POST /v1/emails", mw.Wrap(http.HandlerFunc(in.email)))
	return mux, nil
}

type ingress struct {
	log *slog.Logger
}

// PaymentRequest is the body of POST /v1/payments.
type PaymentRequest struct {
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
}

func (p PaymentRequest) validate() error {
	if strings.TrimSpace(p.Account) == "" {
		return errors.New(`"account" is required`)
	}
	if p.AmountCents <= 0 {
		return fmt.Errorf(`"amount_cents" must be a positive integer, got %d`, p.AmountCents)
	}
	return nil
}

// PaymentResponse is the 202 body of POST /v1/payments.
type PaymentResponse struct {
	Key       string `json:"key"`
	PaymentID int64  `json:"payment_id"`
	Status    string `json:"status"`
}

// EmailRequest is the body of POST /v1/emails.
type EmailRequest struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

func (e EmailRequest) validate() error {
	if !strings.Contains(e.To, "@") {
		return fmt.Errorf(`"to" must be an email address, got %q`, e.To)
	}
	return nil
}

// EmailResponse is the 202 body of POST /v1/emails.
type EmailResponse struct {
	Key     string `json:"key"`
	EmailID int64  `json:"email_id"`
	Status  string `json:"status"`
}

func (in *ingress) payment(w http.ResponseWriter, r *http.Request) {
	var req PaymentRequest
	body, ok := in.decode(w, r, &req)
	if !ok {
		return
	}
	if err := req.validate(); err != nil {
		ingressWriteError(w, http.StatusBadRequest, "invalid_request", err.Error())
		return
	}
	call, ok := in.call(w, r)
	if !ok {
		return
	}
	ctx := r.Context()
	var id int64
	if err := call.tx.QueryRow(ctx, sqlInsertPayment, call.scope, string(call.key), req.Account, req.AmountCents).Scan(&id); err != nil {
		in.fail(w, fmt.Errorf("demo: insert payment: %w", err))
		return
	}
	// The message joins the same transaction: it exists if and only if the payment
	// row does. Its key is the scoped key, so tenants never fold into each other.
	msg := idem.Message{Key: call.scoped, Subject: idem.SubjectCharge, Payload: body}
	if err := outbox.Enqueue(ctx, call.tx, msg); err != nil {
		in.fail(w, fmt.Errorf("demo: enqueue charge: %w", err))
		return
	}
	ingressWriteJSON(w, http.StatusAccepted, PaymentResponse{Key: string(call.key), PaymentID: id, Status: "accepted"})
}

func (in *ingress) email(w http.ResponseWriter, r *http.Request) {
	var req EmailRequest
	body, ok := in.decode(w, r, &req)
	if !ok {
		return
	}
	if err := req.validate(); err != nil {
		ingressWriteError(w, http.StatusBadRequest, "invalid_request", err.Error())
		return
	}
	call, ok := in.call(w, r)
	if !ok {
		return
	}
	ctx := r.Context()
	var id int64
	if err := call.tx.QueryRow(ctx, sqlInsertEmail, call.scope, string(call.key), req.To, req.Subject).Scan(&id); err != nil {
		in.fail(w, fmt.Errorf("demo: insert email: %w", err))
		return
	}
	msg := idem.Message{Key: call.scoped, Subject: idem.SubjectEmail, Payload: body}
	if err := outbox.Enqueue(ctx, call.tx, msg); err != nil {
		in.fail(w, fmt.Errorf("demo: enqueue email: %w", err))
		return
	}
	ingressWriteJSON(w, http.StatusAccepted, EmailResponse{Key: string(call.key), EmailID: id, Status: "accepted"})
}

// decode reads the body (already buffered and size-limited by the middleware) into
// v, strictly: unknown fields and trailing data are client bugs, and a 400 now is
// better than a silently ignored "amount" typo. It returns the raw bytes, which
// become the message payload as received.
func (in *ingress) decode(w http.ResponseWriter, r *http.Request, v any) ([]byte, bool) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		ingressWriteError(w, http.StatusBadRequest, "invalid_request", "reading body: "+err.Error())
		return nil, false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		ingressWriteError(w, http.StatusBadRequest, "invalid_request", "body is not a valid JSON request: "+err.Error())
		return nil, false
	}
	if dec.More() {
		ingressWriteError(w, http.StatusBadRequest, "invalid_request", "body has data after the JSON object")
		return nil, false
	}
	return body, true
}

// ingressCall is what a handler takes from the middleware's request context.
type ingressCall struct {
	tx     pgx.Tx
	scope  string
	key    idem.Key
	scoped string
}

// call fetches the middleware's transaction and key. Without them the handler was
// mounted without the middleware, and writing outside a claimed transaction would
// break the once-per-intent guarantee, so it refuses.
func (in *ingress) call(w http.ResponseWriter, r *http.Request) (ingressCall, bool) {
	ctx := r.Context()
	tx, ok := producer.TxFromContext(ctx)
	key, _ := producer.KeyFromContext(ctx)
	scoped, _ := producer.ScopedKeyFromContext(ctx)
	if !ok {
		in.fail(w, errors.New("demo: handler mounted without producer.Middleware: no transaction in context"))
		return ingressCall{}, false
	}
	return ingressCall{tx: tx, scope: producer.ScopeFromContext(ctx), key: key, scoped: scoped}, true
}

// fail answers 500. The middleware rolls the transaction back on any 5xx, so the
// client's retry with the same key executes again.
func (in *ingress) fail(w http.ResponseWriter, err error) {
	in.log.Error("demo: request failed", "err", err)
	ingressWriteError(w, http.StatusInternalServerError, "internal_error", "the request failed; retry with the same Idempotency-Key")
}

func ingressWriteJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		// Only our own response types get here; they always marshal.
		panic(fmt.Sprintf("demo: encode response: %v", err))
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// ingressErrorBody matches the middleware's error shape, so clients parse one format.
type ingressErrorBody struct {
	Error string `json:"error"`
	Code  string `json:"code"`
}

func ingressWriteError(w http.ResponseWriter, status int, code, msg string) {
	ingressWriteJSON(w, status, ingressErrorBody{Error: msg, Code: code})
}
