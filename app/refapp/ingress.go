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
	"unicode/utf8"

	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/outbox"
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
	mux.Handle("POST /v1/payments", route(mw.Wrap(http.HandlerFunc(in.payment))))
	mux.Handle("POST /v1/emails", route(mw.Wrap(http.HandlerFunc(in.email))))
	return mux
}

// route sets http.route on the request's server span (if any) from the route that
// matched; otelhttp names the span after it (see traced).
func route(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if span := trace.SpanFromContext(r.Context()); span.IsRecording() {
			if _, path, ok := strings.Cut(r.Pattern, " "); ok {
				span.SetAttributes(semconv.HTTPRoute(path))
			}
		}
		next.ServeHTTP(w, r)
	})
}

type ingress struct {
	log *slog.Logger
}

// PaymentResponse is the 202 body of POST /v1/payments.
type PaymentResponse struct {
	Key       string `json:"key"`
	PaymentID int64  `json:"payment_id"`
	Status    string `json:"status"`
}

// EmailResponse is the 202 body of POST /v1/emails.
type EmailResponse struct {
	Key     string `json:"key"`
	EmailID int64  `json:"email_id"`
	Status  string `json:"status"`
}

func (in *ingress) payment(w http.ResponseWriter, r *http.Request) {
	var req Charge // the body of POST /v1/payments is the charge's payload
	body, ok := in.decode(w, r, &req)
	if !ok {
		return
	}
	if err := req.Validate(); err != nil {
		invalid(w, err)
		return
	}
	intent, ok := in.intent(w, r)
	if !ok {
		return
	}
	ctx := r.Context()
	// The message first: one the broker could never carry is refused before any
	// row is written, and the 413 is then a final answer with nothing behind it.
	// Both join the same transaction: the message exists if and only if the
	// payment row does. Intent.Enqueue stamps the scoped key, so tenants never fold
	// into each other.
	if err := intent.Enqueue(ctx, SubjectCharge, body, nil); err != nil {
		in.enqueueFailed(w, fmt.Errorf("refapp: enqueue charge: %w", err))
		return
	}
	var id int64
	if err := intent.Tx.QueryRow(ctx, sqlInsertPayment, intent.Scope, string(intent.Key), req.Account, req.AmountCents).Scan(&id); err != nil {
		in.fail(w, fmt.Errorf("refapp: insert payment: %w", err))
		return
	}
	writeJSON(w, http.StatusAccepted, PaymentResponse{Key: string(intent.Key), PaymentID: id, Status: "accepted"})
}

func (in *ingress) email(w http.ResponseWriter, r *http.Request) {
	var req Email // the body of POST /v1/emails is the email's payload
	body, ok := in.decode(w, r, &req)
	if !ok {
		return
	}
	if err := req.Validate(); err != nil {
		invalid(w, err)
		return
	}
	intent, ok := in.intent(w, r)
	if !ok {
		return
	}
	ctx := r.Context()
	// The message first, as for payments.
	if err := intent.Enqueue(ctx, SubjectEmail, body, nil); err != nil {
		in.enqueueFailed(w, fmt.Errorf("refapp: enqueue email: %w", err))
		return
	}
	var id int64
	if err := intent.Tx.QueryRow(ctx, sqlInsertEmail, intent.Scope, string(intent.Key), req.To, req.Subject).Scan(&id); err != nil {
		in.fail(w, fmt.Errorf("refapp: insert email: %w", err))
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
	if !utf8.Valid(body) {
		// JSON text is UTF-8 (RFC 8259). The decoder would turn the bad bytes into
		// U+FFFD, and the message would carry them on as they are.
		writeError(w, http.StatusBadRequest, "invalid_text", "the body is not valid UTF-8, which JSON text must be: send it as UTF-8")
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

// invalid answers a request its payload's rule refuses: 400 invalid_text for text
// no column can hold, invalid_request otherwise.
func invalid(w http.ResponseWriter, err error) {
	code := "invalid_request"
	var te *textError
	if errors.As(err, &te) {
		code = "invalid_text"
	}
	writeError(w, http.StatusBadRequest, code, err.Error())
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

// enqueueFailed answers a message the outbox refused: 413 for one the broker could
// never carry (nothing was written, and the answer is stored: a retry with the same
// key gets it again), 500 otherwise.
func (in *ingress) enqueueFailed(w http.ResponseWriter, err error) {
	if errors.Is(err, outbox.ErrTooLarge) {
		writeError(w, http.StatusRequestEntityTooLarge, "message_too_large", err.Error())
		return
	}
	in.fail(w, err)
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
