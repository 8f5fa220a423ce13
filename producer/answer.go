package producer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem"
)

// answer is one request's way out: every response the middleware writes goes
// through it, so that each request reports exactly one outcome, with its duration.
type answer struct {
	m     *Middleware
	w     http.ResponseWriter
	ctx   context.Context
	log   *slog.Logger
	start time.Time
}

func (a *answer) observe(outcome idem.Outcome) {
	a.m.observer.Observe(idem.Event{Component: idem.ComponentIngress, Outcome: outcome, Count: 1, Duration: time.Since(a.start)})
}

// respond writes a captured or stored response.
func (a *answer) respond(outcome idem.Outcome, resp response, replayed bool) {
	a.observe(outcome)
	dst := a.w.Header()
	for name, values := range resp.header {
		dst[name] = append([]string(nil), values...)
	}
	if replayed {
		dst.Set(idem.HeaderReplayed, "true")
	}
	dst.Set("Content-Length", strconv.Itoa(len(resp.body)))
	a.w.WriteHeader(resp.status)
	_, _ = a.w.Write(resp.body) // the client may be gone; the record is safe either way
}

// errorBody is the JSON body of every answer the middleware itself gives:
// {"error": "what went wrong, for people", "code": "a_stable_code"}.
type errorBody struct {
	Error string `json:"error"`
	Code  string `json:"code"`
}

// WriteError writes the middleware's JSON error body with status:
// {"error": msg, "code": code}. Handlers behind the middleware use it
// for their own errors, so that a client parses one format.
func WriteError(w http.ResponseWriter, status int, code, msg string) {
	body, _ := json.Marshal(errorBody{Error: msg, Code: code})
	body = append(body, '\n')
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// writeError writes one of the middleware's own answers.
func (a *answer) writeError(outcome idem.Outcome, status int, code, msg string) {
	a.observe(outcome)
	WriteError(a.w, status, code, msg)
}

func (a *answer) reject(status int, code, msg string) {
	a.log.InfoContext(a.ctx, "producer: rejected", "status", status, "code", code, "reason", msg)
	a.writeError(idem.OutcomeRejected, status, code, msg)
}

// fail answers a request that ran and was rolled back.
func (a *answer) fail(status int, code, msg string) {
	a.writeError(idem.OutcomeFailed, status, code, msg)
}

// busy answers a request beyond MaxInFlight; nothing was claimed.
func (a *answer) busy() {
	a.log.WarnContext(a.ctx, "producer: too many requests in flight", "max_in_flight", a.m.cfg.MaxInFlight)
	a.w.Header().Set("Retry-After", "1")
	a.writeError(idem.OutcomeBusy, http.StatusServiceUnavailable, codeTooManyInFlight,
		"the service is at its limit of requests in flight and nothing was recorded; retry later with the same Idempotency-Key")
}

func (a *answer) conflict() {
	a.log.InfoContext(a.ctx, "producer: key in use past the wait", "wait", a.m.cfg.Wait)
	secs := int(math.Ceil(a.m.cfg.Wait.Seconds()))
	a.w.Header().Set("Retry-After", strconv.Itoa(max(secs, 1)))
	a.writeError(idem.OutcomeConflict, http.StatusConflict, codeKeyInUse,
		"a request with this Idempotency-Key is still being processed; retry later with the same key")
}

// dbFailed answers a failure of the database machinery. Nothing was stored, so the
// client may retry with the same key. A server-side SQL error (the server answered)
// is our bug or the handler's: 500. Anything else means the database could not be
// reached or the connection broke: 503.
func (a *answer) dbFailed(err error) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		a.log.ErrorContext(a.ctx, "producer: database error", "err", err)
		a.writeError(idem.OutcomeUnavailable, http.StatusInternalServerError, codeInternalError,
			"the request failed and was rolled back; retry with the same Idempotency-Key")
		return
	}
	a.log.ErrorContext(a.ctx, "producer: database unavailable", "err", err)
	a.w.Header().Set("Retry-After", "1")
	a.writeError(idem.OutcomeUnavailable, http.StatusServiceUnavailable, codeDatabaseUnavailable,
		"the idempotency store is unavailable and nothing was recorded; retry later with the same Idempotency-Key")
}

// fromRecord answers a request whose key already has a committed record.
func (a *answer) fromRecord(rec record, fp []byte) {
	switch {
	case !bytes.Equal(rec.fingerprint, fp):
		a.log.InfoContext(a.ctx, "producer: key reused with a different payload")
		a.writeError(idem.OutcomeMismatch, http.StatusUnprocessableEntity, codeKeyMismatch,
			"this Idempotency-Key was already used with a different method, path or body; mint a new key for a new intent")
	case rec.status != "done" || rec.code == nil:
		// Cannot happen with one-transaction requests (a row commits only with its
		// response), but a record without a response must never be replayed.
		a.conflict()
	default:
		a.log.DebugContext(a.ctx, "producer: replayed", "status", *rec.code)
		a.respond(idem.OutcomeReplayed, response{status: *rec.code, header: rec.header, body: rec.body}, true)
	}
}

// runHandler runs next and reports whether it returned normally. A panic is logged
// and swallowed so the caller can roll back and answer 500; http.ErrAbortHandler is
// re-raised (after the deferred rollback in serve) because it asks net/http to abort
// the connection.
func (a *answer) runHandler(next http.Handler, w http.ResponseWriter, r *http.Request) (ok bool) {
	defer func() {
		if v := recover(); v != nil {
			if v == http.ErrAbortHandler {
				panic(v)
			}
			a.log.ErrorContext(a.ctx, "producer: handler panicked; rolled back", "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
			ok = false
		}
	}()
	next.ServeHTTP(w, r)
	return true
}

// end rolls back the request's transaction unless it has ended, and gives its
// connection back to the pool.
func (a *answer) end(tx *requestTx) {
	if err := tx.rollback(a.ctx); err != nil {
		a.log.WarnContext(a.ctx, "producer: rollback", "err", err)
	}
}
