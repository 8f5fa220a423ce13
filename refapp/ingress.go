package refapp

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"

	"github.com/idemkit/idem/producer"
)

// The application's business SQL. The middleware owns idem_requests and the outbox
// owns idem_outbox; the handlers only write their own tables.
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

// Routes returns the application's API: POST /v1/payments and POST /v1/emails, each
// guarded by mw (the worker's Ingress).
//
// Each route is wrapped on its own rather than wrapping the whole mux, so that a
// request to an unknown path or with the wrong method is answered 404/405 by the
// mux without claiming its key: the client's mistake should not use up the key.
func Routes(mw *producer.Middleware, log *slog.Logger) http.Handler {
	if log == nil {
		log = slog.Default()
	}
	in := &ingress{log: log}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/payments", mw.Wrap(http.HandlerFunc(in.payment)))
	mux.Handle("POST /v1/emails", mw.Wrap(http.HandlerFunc(in.email)))
	return mux
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
		writeError(w, http.StatusBadRequest, "invalid_request", err.Error())
		return
	}
	intent, ok := in.intent(w, r)
	if !ok {
		return
	}
	ctx := r.Context()
	var id int64
	if err := intent.Tx.QueryRow(ctx, sqlInsertPayment, intent.Scope, string(intent.Key), req.Account, req.AmountCents).Scan(&id); err != nil {
		in.fail(w, fmt.Errorf("refapp: insert payment: %w", err))
		return
	}
	// The message joins the same transaction: it exists if and only if the payment
	// row does. Intent.Enqueue stamps the scoped key, so tenants never fold into
	// each other.
	if err := intent.Enqueue(ctx, SubjectCharge, body, nil); err != nil {
		in.fail(w, fmt.Errorf("refapp: enqueue charge: %w", err))
		return
	}
	writeJSON(w, http.StatusAccepted, PaymentResponse{Key: string(intent.Key), PaymentID: id, Status: "accepted"})
}

func (in *ingress) email(w http.ResponseWriter, r *http.Request) {
	var req EmailRequest
	body, ok := in.decode(w, r, &req)
	if !ok {
		return
	}
	if err := req.validate(); err != nil {
		writeError(w, http.StatusBadRequest, "invalid_request", err.Error())
		return
	}
	intent, ok := in.intent(w, r)
	if !ok {
		return
	}
	ctx := r.Context()
	var id int64
	if err := intent.Tx.QueryRow(ctx, sqlInsertEmail, intent.Scope, string(intent.Key), req.To, req.Subject).Scan(&id); err != nil {
		in.fail(w, fmt.Errorf("refapp: insert email: %w", err))
		return
	}
	if err := intent.Enqueue(ctx, SubjectEmail, body, nil); err != nil {
		in.fail(w, fmt.Errorf("refapp: enqueue email: %w", err))
		return
	}
	writeJSON(w, http.StatusAccepted, EmailResponse{Key: string(intent.Key), EmailID: id, Status: "accepted"})
}

// decode reads the body (already buffered and size-limited by the middleware) into
// v, strictly: unknown fields and trailing data are client bugs, and a 400 now is
// better than a silently ignored "amount" typo. It returns the raw bytes, which
// become the message payload as received.
func (in *ingress) decode(w http.ResponseWriter, r *http.Request, v any) ([]byte, bool) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid_request", "reading body: "+err.Error())
		return nil, false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		writeError(w, http.StatusBadRequest, "invalid_request", "body is not a valid JSON request: "+err.Error())
		return nil, false
	}
	if dec.More() {
		writeError(w, http.StatusBadRequest, "invalid_request", "body has data after the JSON object")
		return nil, false
	}
	return body, true
}

// intent fetches the middleware's Intent. Without it the handler was mounted
// without the middleware, and writing outside a claimed transaction would break the
// once-per-intent guarantee, so it refuses.
func (in *ingress) intent(w http.ResponseWriter, r *http.Request) (*producer.Intent, bool) {
	intent, ok := producer.IntentFrom(r.Context())
	if !ok {
		in.fail(w, errors.New("refapp: handler mounted without producer.Middleware: no transaction in context"))
		return nil, false
	}
	return intent, true
}

// fail answers 500. The middleware rolls the transaction back on any 5xx, so the
// client's retry with the same key executes again.
func (in *ingress) fail(w http.ResponseWriter, err error) {
	in.log.Error("refapp: request failed", "err", err)
	writeError(w, http.StatusInternalServerError, "internal_error", "the request failed; retry with the same Idempotency-Key")
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		// Only our own response types get here; they always marshal.
		panic(fmt.Sprintf("refapp: encode response: %v", err))
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// writeError answers in the middleware's error shape, so clients parse one format.
func writeError(w http.ResponseWriter, status int, code, msg string) {
	producer.WriteError(w, status, code, msg)
}
