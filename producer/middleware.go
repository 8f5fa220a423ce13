package producer

// This file is the server side of the Idempotency-Key protocol (IETF draft
// "The Idempotency-Key HTTP Header Field", as practised by Stripe): an http.Handler
// wrapper that turns "name -> first response" into one Postgres transaction.
//
// The whole request is one transaction:
//
//	BEGIN
//	  set lock_timeout = Wait
//	  INSERT INTO idem_requests (scope, key, ...) ON CONFLICT DO NOTHING   -- claim
//	  handler(ctx with tx)        -- business rows, outbox.Enqueue, all in tx
//	  UPDATE idem_requests SET response = captured                          -- remember
//	COMMIT
//	write the captured response
//
// Because the claim, the effect and the remembered response commit together, there
// is no moment at which one exists without the others: a crash anywhere before COMMIT
// leaves no trace, and the client's retry (same key) simply executes again. A
// concurrent duplicate needs no polling or "in progress" state either: its INSERT
// blocks on the first arrival's uncommitted unique-index entry and wakes up when that
// transaction ends, then replays (commit) or executes (rollback).

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
)

// Outcomes reported to MiddlewareConfig.OnOutcome, one per state-changing request.
// They are stable strings so they can become metric labels.
const (
	// OutcomeNew: the key was claimed, the handler ran and its response was stored.
	OutcomeNew = "new"
	// OutcomeReplayed: the key had a stored response, which was sent again.
	OutcomeReplayed = "replayed"
	// OutcomeConflict: the first arrival was still running when Wait ran out (409).
	OutcomeConflict = "conflict"
	// OutcomeMismatch: the key was used before with a different request (422).
	OutcomeMismatch = "mismatch"
	// OutcomeRejected: the request was refused before claiming the key: missing or
	// malformed key or scope, unreadable or oversize body (400, 413).
	OutcomeRejected = "rejected"
	// OutcomeFailed: the handler answered 5xx (or panicked); everything was rolled
	// back and nothing stored, so a retry executes again.
	OutcomeFailed = "failed"
	// OutcomeUnavailable: the database could not be reached or failed (503/500);
	// nothing was claimed.
	OutcomeUnavailable = "unavailable"
)

// Defaults applied to zero fields of MiddlewareConfig.
const (
	mwDefaultKeyLifetime  = 48 * time.Hour
	mwDefaultWait         = 5 * time.Second
	mwDefaultMaxBodyBytes = 1 << 20
	mwDefaultMaxRespBytes = 1 << 20
	// mwMaxClaimAttempts bounds the claim loop, which only repeats when the record
	// it conflicted with expired or vanished (retention) between two statements.
	mwMaxClaimAttempts = 3
)

// MiddlewareConfig configures a Middleware. The zero value is valid and means the
// defaults documented on each field.
type MiddlewareConfig struct {
	// KeyLifetime is how long a stored response is replayed; it sets
	// idem_requests.expires_at. After it, the key may be claimed afresh. It must
	// outlast every window in which the same intent can still arrive (client
	// retries, resume after a restart), so keep it long and bound storage by
	// retention (dedupe.Collector deletes expired records in small batches)
	// instead. Default 48h.
	KeyLifetime time.Duration

	// Wait is how long a concurrent duplicate waits for the first arrival with the
	// same key to finish before it gets 409 with Retry-After. It is applied as the
	// transaction's lock_timeout, so it also bounds the handler's own lock waits.
	// Keep it well below the HTTP server's WriteTimeout. Default 5s.
	Wait time.Duration

	// MaxBodyBytes is the largest request body accepted; a larger one gets 413 and
	// claims nothing. The body is buffered to fingerprint it. Default 1 MiB.
	MaxBodyBytes int64

	// MaxResponseBytes is the largest response body the handler may write. The
	// response is stored in idem_requests and replayed for the key's lifetime, so an
	// unbounded one would be unbounded storage. A handler that writes more is
	// rolled back (nothing committed, nothing stored) and the client gets 500
	// response_too_large: a bug to fix in the handler, not something to truncate
	// and replay half of. Default 1 MiB.
	MaxResponseBytes int64

	// Scope returns the Idempotency-Scope of a request: the tenant or principal
	// whose key space the key lives in. Keys are unique per scope, never across
	// scopes, and one scope never receives another's stored response. The default
	// reads the Idempotency-Scope header; a service with authentication should
	// derive the scope from the authenticated principal instead, so a client cannot
	// name someone else's scope. An error rejects the request with 400.
	Scope func(r *http.Request) (string, error)

	// Logger receives the middleware's logs. Default slog.Default().
	Logger *slog.Logger

	// OnOutcome, if set, is called once per state-changing request with one of the
	// Outcome* constants, after the response is decided. It is the hook for
	// metrics; it must be fast and safe for concurrent use.
	OnOutcome func(outcome string)

	// AfterCommit, if set, is called after a new request's record, business rows
	// and outbox rows have committed and before its response is written: the
	// window in which a crash leaves the client without an answer to an effect
	// that happened. Fault injection uses it to crash there for real (the retry
	// must be a replay); it cannot change the response.
	AfterCommit func(ctx context.Context, scope string, key idem.Key)
}

// withDefaults returns a copy of c with zero fields replaced by their defaults.
func (c MiddlewareConfig) withDefaults() MiddlewareConfig {
	if c.KeyLifetime == 0 {
		c.KeyLifetime = mwDefaultKeyLifetime
	}
	if c.Wait == 0 {
		c.Wait = mwDefaultWait
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = mwDefaultMaxBodyBytes
	}
	if c.MaxResponseBytes == 0 {
		c.MaxResponseBytes = mwDefaultMaxRespBytes
	}
	if c.Scope == nil {
		c.Scope = mwScopeFromHeader
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.OnOutcome == nil {
		c.OnOutcome = func(string) {}
	}
	return c
}

// validate reports a configuration that cannot work. It is called on the result of
// withDefaults, so it only sees values a user set explicitly.
func (c MiddlewareConfig) validate() error {
	if c.KeyLifetime < time.Second {
		return fmt.Errorf("middleware: KeyLifetime %v is shorter than one second", c.KeyLifetime)
	}
	if c.Wait < time.Millisecond {
		// lock_timeout has millisecond resolution and 0 would mean "wait forever".
		return fmt.Errorf("middleware: Wait %v is shorter than one millisecond", c.Wait)
	}
	if c.MaxBodyBytes < 0 {
		return fmt.Errorf("middleware: MaxBodyBytes %d is negative", c.MaxBodyBytes)
	}
	if c.MaxResponseBytes < 0 {
		return fmt.Errorf("middleware: MaxResponseBytes %d is negative", c.MaxResponseBytes)
	}
	return nil
}

func mwScopeFromHeader(r *http.Request) (string, error) {
	vs := r.Header.Values(idem.HeaderScope)
	if len(vs) > 1 {
		return "", fmt.Errorf("%d %s headers, want at most one", len(vs), idem.HeaderScope)
	}
	if len(vs) == 0 {
		return "", nil
	}
	return vs[0], nil
}

// Middleware enforces the Idempotency-Key protocol on the handlers it wraps. It is
// safe for concurrent use; one Middleware can wrap many handlers.
type Middleware struct {
	pool *pgxpool.Pool
	cfg  MiddlewareConfig
}

// NewMiddleware returns a Middleware that keeps its records in pool's idem_requests
// table (see migrations). The zero MiddlewareConfig means the defaults.
func NewMiddleware(pool *pgxpool.Pool, cfg MiddlewareConfig) (*Middleware, error) {
	if pool == nil {
		return nil, errors.New("middleware: nil pool")
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Middleware{pool: pool, cfg: cfg}, nil
}

// KeyLifetime returns the configured key lifetime, so a service can check at start
// that it outlasts its other retry windows.
func (m *Middleware) KeyLifetime() time.Duration { return m.cfg.KeyLifetime }

// Wrap returns next guarded by the protocol.
//
// Safe methods (GET, HEAD, OPTIONS, TRACE) pass straight through. Every other method
// needs an Idempotency-Key header and runs next inside one Postgres transaction,
// available to next through TxFromContext. next must do all its writes through that
// transaction, must not commit or roll it back, and must not use it after it returns.
//
// What next's response means:
//   - below 500 (2xx, 3xx, 4xx): final. It is stored with the business rows and
//     replayed, with Idempotent-Replayed: true, to every later request with the same
//     scope, key and payload — except 408, 425 and 429, which say "try again" and
//     would be wrong forever if stored; they are treated like a 5xx.
//   - 5xx or a panic: not final. The transaction rolls back — business rows, outbox
//     messages and the claim disappear — and the retry executes again.
//
// The middleware's own answers: 400 missing or malformed key or scope; 413 body over
// MaxBodyBytes; 500 response_too_large (rolled back) when the handler writes more
// than MaxResponseBytes; 422 key reused with a different method, path or body; 409 with
// Retry-After when the first arrival is still running after Wait; 503 when the
// database is unreachable. None of them stores anything.
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		m.serve(w, r, next)
	})
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		// Safe methods have no effect to deduplicate; a key would only cost a row.
		next.ServeHTTP(w, r)
		return
	}
	log := m.cfg.Logger.With("method", r.Method, "path", r.URL.Path)

	// 1. Validate the name of the intent before touching the database: a request
	// that can never succeed must not claim anything.
	key, code, err := mwParseKeyHeader(r.Header.Values(idem.HeaderKey))
	if err != nil {
		m.reject(w, log, http.StatusBadRequest, code, err.Error())
		return
	}
	scope, err := m.cfg.Scope(r)
	if err == nil {
		err = idem.ValidateScope(scope)
	}
	if err != nil {
		m.reject(w, log, http.StatusBadRequest, "malformed_idempotency_scope", err.Error())
		return
	}
	log = log.With("scope", scope, "key", string(key))

	// 2. Buffer the body: the fingerprint needs all of it, and the handler may read
	// it again. An oversize body is refused before the claim, so the client can fix
	// the request and retry with the same key.
	body, err := m.readBody(w, r)
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			m.reject(w, log, http.StatusRequestEntityTooLarge, "body_too_large",
				fmt.Sprintf("request body is larger than %d bytes", m.cfg.MaxBodyBytes))
			return
		}
		m.reject(w, log, http.StatusBadRequest, "unreadable_body", "reading request body: "+err.Error())
		return
	}
	fp := Fingerprint(r.Method, r.URL.Path, body)

	// 3. One transaction for claim, effect and stored response.
	ctx := r.Context()
	tx, err := m.pool.Begin(ctx)
	if err != nil {
		m.dbFailed(w, log, fmt.Errorf("middleware: begin: %w", err))
		return
	}
	defer m.rollback(ctx, tx, log) // a no-op once committed

	if _, err := tx.Exec(ctx, sqlRequestLockTimeout, mwLockTimeout(m.cfg.Wait)); err != nil {
		m.dbFailed(w, log, fmt.Errorf("middleware: set lock_timeout: %w", err))
		return
	}
	claimed, err := m.claim(ctx, tx, scope, key, fp, r)
	if err != nil {
		if mwIsLockTimeout(err) {
			m.conflict(w, log)
			return
		}
		m.dbFailed(w, log, err)
		return
	}
	if !claimed.ok {
		// The key already names a finished request: answer from the record. The
		// transaction did nothing, so the deferred rollback just ends it.
		m.answerFromRecord(w, log, claimed.rec, fp)
		return
	}

	// 4. Run the handler inside the transaction, capturing its response instead of
	// sending it: nothing may reach the client before the record commits.
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	rctx := context.WithValue(ctx, mwCtxKey{}, &mwRequestInfo{tx: tx, scope: scope, key: key})
	capture := newMwCapture(m.cfg.MaxResponseBytes)
	if !m.runHandler(next, capture, r.WithContext(rctx), log) {
		m.rollback(ctx, tx, log)
		m.outcome(OutcomeFailed)
		mwWriteError(w, http.StatusInternalServerError, "internal_error",
			"the request failed and was rolled back; retry with the same Idempotency-Key")
		return
	}
	if capture.overflow {
		m.rollback(ctx, tx, log)
		log.Error("middleware: handler response exceeds MaxResponseBytes; rolled back", "limit", m.cfg.MaxResponseBytes)
		m.outcome(OutcomeFailed)
		mwWriteError(w, http.StatusInternalServerError, "response_too_large",
			fmt.Sprintf("the handler's response is larger than the %d bytes that can be stored for replay; the request was rolled back", m.cfg.MaxResponseBytes))
		return
	}
	resp := capture.result()

	if !mwStoresResponse(resp.status) {
		// Not a final answer: forget everything, so the retry executes again.
		m.rollback(ctx, tx, log)
		log.Warn("middleware: handler answered with a retryable status; rolled back", "status", resp.status)
		m.outcome(OutcomeFailed)
		mwWriteResponse(w, resp, false)
		return
	}

	// 5. Remember the response together with the effect, then commit.
	if _, err := tx.Exec(ctx, sqlRequestComplete, scope, string(key), resp.status, resp.header, resp.body); err != nil {
		// Most likely the handler ignored a failed statement and the transaction
		// is aborted; either way nothing of this request survives.
		m.dbFailed(w, log, fmt.Errorf("middleware: store response: %w", err))
		return
	}
	if err := tx.Commit(ctx); err != nil {
		// If the connection broke during COMMIT, the outcome is unknown. That is
		// exactly what the key is for: the retry replays or executes, never both.
		m.dbFailed(w, log, fmt.Errorf("middleware: commit: %w", err))
		return
	}
	if m.cfg.AfterCommit != nil {
		m.cfg.AfterCommit(ctx, scope, key)
	}
	log.Debug("middleware: executed and stored", "status", resp.status)
	m.outcome(OutcomeNew)
	mwWriteResponse(w, resp, false)
}

// mwParseKeyHeader validates the Idempotency-Key header values. It returns an error
// code for the JSON body alongside the error.
func mwParseKeyHeader(values []string) (idem.Key, string, error) {
	switch len(values) {
	case 0:
		return "", "missing_idempotency_key",
			fmt.Errorf("this request changes state and needs an %s header (1..%d printable ASCII bytes, e.g. a UUID minted by the client)", idem.HeaderKey, idem.MaxKeyLen)
	case 1:
	default:
		return "", "malformed_idempotency_key", fmt.Errorf("%d %s headers, want exactly one", len(values), idem.HeaderKey)
	}
	if values[0] == "" {
		// A present but empty header is a malformed key, not a missing one: the
		// client tried to send a key and got it wrong.
		return "", "malformed_idempotency_key", fmt.Errorf("%s header is empty", idem.HeaderKey)
	}
	key, err := idem.ParseKey(values[0])
	if err != nil {
		return "", "malformed_idempotency_key", err
	}
	return key, "", nil
}

func (m *Middleware) readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	if r.Body == nil {
		return []byte{}, nil
	}
	if r.ContentLength > m.cfg.MaxBodyBytes {
		// Refuse on the declared length without reading a byte.
		return nil, &http.MaxBytesError{Limit: m.cfg.MaxBodyBytes}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.cfg.MaxBodyBytes))
	if err != nil {
		return nil, err
	}
	return body, nil
}

// Fingerprint identifies a request's payload: SHA-256 over its method, path and
// body, each prefixed by its length so that no two different requests can encode to
// the same byte stream (without the prefixes, path "/ab"+body "c" and path "/a"+body
// "bc" would collide). Same key with a different fingerprint is a client bug: 422.
func Fingerprint(method, path string, body []byte) []byte {
	h := sha256.New()
	var n [8]byte
	for _, part := range [][]byte{[]byte(method), []byte(path), body} {
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write(part)
	}
	return h.Sum(nil)
}

// mwRecord is a committed idem_requests row, as read by a duplicate.
type mwRecord struct {
	fingerprint []byte
	status      string
	code        *int
	header      http.Header
	body        []byte
	expired     bool
}

type mwClaim struct {
	ok  bool     // this transaction owns the key
	rec mwRecord // otherwise: the record that owns it
}

// claim takes (scope, key) for this transaction, or returns the live record that
// already holds it. An expired record is deleted and the key claimed afresh.
func (m *Middleware) claim(ctx context.Context, tx pgx.Tx, scope string, key idem.Key, fp []byte, r *http.Request) (mwClaim, error) {
	for range mwMaxClaimAttempts {
		var lockedAt time.Time
		err := tx.QueryRow(ctx, sqlRequestClaim, scope, string(key), fp, r.Method, r.URL.Path,
			m.cfg.KeyLifetime.Seconds()).Scan(&lockedAt)
		if err == nil {
			return mwClaim{ok: true}, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return mwClaim{}, fmt.Errorf("middleware: claim: %w", err)
		}

		var rec mwRecord
		err = tx.QueryRow(ctx, sqlRequestLookup, scope, string(key)).
			Scan(&rec.fingerprint, &rec.status, &rec.code, &rec.header, &rec.body, &rec.expired)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			// Deleted by retention between the two statements: claim again.
			continue
		case err != nil:
			return mwClaim{}, fmt.Errorf("middleware: look up record: %w", err)
		case rec.expired:
			// The key outlived its lifetime; it now names nothing. Delete the old
			// record in this transaction and claim again.
			if _, err := tx.Exec(ctx, sqlRequestDeleteExpired, scope, string(key)); err != nil {
				return mwClaim{}, fmt.Errorf("middleware: delete expired record: %w", err)
			}
			continue
		}
		return mwClaim{rec: rec}, nil
	}
	return mwClaim{}, fmt.Errorf("middleware: claim: record kept changing after %d attempts", mwMaxClaimAttempts)
}

// answerFromRecord answers a request whose key already has a committed record.
func (m *Middleware) answerFromRecord(w http.ResponseWriter, log *slog.Logger, rec mwRecord, fp []byte) {
	switch {
	case !bytes.Equal(rec.fingerprint, fp):
		log.Info("middleware: key reused with a different payload")
		m.outcome(OutcomeMismatch)
		mwWriteError(w, http.StatusUnprocessableEntity, "idempotency_key_mismatch",
			"this Idempotency-Key was already used with a different method, path or body; mint a new key for a new intent")
	case rec.status != "done" || rec.code == nil:
		// Cannot happen with one-transaction requests (a row commits only with its
		// response), but a record without a response must never be replayed.
		m.conflict(w, log)
	default:
		log.Debug("middleware: replayed", "status", *rec.code)
		m.outcome(OutcomeReplayed)
		mwWriteResponse(w, mwResponse{status: *rec.code, header: rec.header, body: rec.body}, true)
	}
}

// runHandler runs next and reports whether it returned normally. A panic is logged
// and swallowed so the caller can roll back and answer 500; http.ErrAbortHandler is
// re-raised (after the deferred rollback in serve) because it asks net/http to abort
// the connection.
func (m *Middleware) runHandler(next http.Handler, w http.ResponseWriter, r *http.Request, log *slog.Logger) (ok bool) {
	defer func() {
		if v := recover(); v != nil {
			if v == http.ErrAbortHandler {
				panic(v)
			}
			log.Error("middleware: handler panicked; rolled back", "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
			ok = false
		}
	}()
	next.ServeHTTP(w, r)
	return true
}

// mwStoresResponse reports whether a handler's status is a final answer worth
// replaying. 5xx means the server failed; 408, 425 and 429 mean "not now". Storing
// any of them would turn a passing problem into a permanent answer for the key.
func mwStoresResponse(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status < 500
}

func (m *Middleware) rollback(ctx context.Context, tx pgx.Tx, log *slog.Logger) {
	// The request's context may be cancelled (client gone); the rollback must still
	// reach the server so the connection returns clean to the pool.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		log.Warn("middleware: rollback", "err", err)
	}
}

func (m *Middleware) outcome(o string) { m.cfg.OnOutcome(o) }

func (m *Middleware) reject(w http.ResponseWriter, log *slog.Logger, status int, code, msg string) {
	log.Info("middleware: rejected", "status", status, "code", code, "reason", msg)
	m.outcome(OutcomeRejected)
	mwWriteError(w, status, code, msg)
}

func (m *Middleware) conflict(w http.ResponseWriter, log *slog.Logger) {
	log.Info("middleware: key in use past the wait", "wait", m.cfg.Wait)
	m.outcome(OutcomeConflict)
	secs := int(math.Ceil(m.cfg.Wait.Seconds()))
	w.Header().Set("Retry-After", strconv.Itoa(max(secs, 1)))
	mwWriteError(w, http.StatusConflict, "idempotency_key_in_use",
		"a request with this Idempotency-Key is still being processed; retry later with the same key")
}

// dbFailed answers a failure of the database machinery. Nothing was stored, so the
// client may retry with the same key. A server-side SQL error (the server answered)
// is our bug or the handler's: 500. Anything else means the database could not be
// reached or the connection broke: 503.
func (m *Middleware) dbFailed(w http.ResponseWriter, log *slog.Logger, err error) {
	m.outcome(OutcomeUnavailable)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		log.Error("middleware: database error", "err", err)
		mwWriteError(w, http.StatusInternalServerError, "internal_error",
			"the request failed and was rolled back; retry with the same Idempotency-Key")
		return
	}
	log.Error("middleware: database unavailable", "err", err)
	w.Header().Set("Retry-After", "1")
	mwWriteError(w, http.StatusServiceUnavailable, "database_unavailable",
		"the idempotency store is unavailable and nothing was recorded; retry later with the same Idempotency-Key")
}

func mwIsLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03" // lock_not_available
}

func mwLockTimeout(d time.Duration) string {
	return strconv.FormatInt(max(d.Milliseconds(), 1), 10) + "ms"
}

// mwResponse is a response as captured from the handler or read from a record.
type mwResponse struct {
	status int
	header http.Header
	body   []byte
}

// mwCapture is an http.ResponseWriter that records instead of sending. Like a real
// ResponseWriter it freezes the header at the first WriteHeader or Write, so the
// stored response is exactly what the client would have seen.
type mwCapture struct {
	header   http.Header // the handler's working header
	sent     http.Header // the snapshot taken when the status was written
	status   int
	body     bytes.Buffer
	limit    int64 // MaxResponseBytes
	overflow bool  // the handler tried to write more than limit
}

// errResponseTooLarge is what a handler's Write returns past MaxResponseBytes.
var errResponseTooLarge = errors.New("middleware: response exceeds MaxResponseBytes")

func newMwCapture(limit int64) *mwCapture { return &mwCapture{header: http.Header{}, limit: limit} }

func (c *mwCapture) Header() http.Header { return c.header }

func (c *mwCapture) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code)) // as net/http does
	}
	if c.status != 0 || code < 200 {
		// Already written, or informational (1xx): a replay cannot send 1xx.
		return
	}
	c.status = code
	c.sent = c.header.Clone()
}

func (c *mwCapture) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if c.overflow || int64(c.body.Len())+int64(len(p)) > c.limit {
		c.overflow = true
		return 0, errResponseTooLarge
	}
	return c.body.Write(p)
}

// result returns what the handler answered, cleaned for storage and replay.
func (c *mwCapture) result() mwResponse {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	h := c.sent
	// These describe one connection or one transfer, not the response, and net/http
	// recomputes them; replaying the first ones would be wrong.
	for _, name := range []string{
		"Connection", "Keep-Alive", "Proxy-Connection", "Transfer-Encoding", "Upgrade",
		"Trailer", "Te", "Content-Length", "Date",
	} {
		h.Del(name)
	}
	body := c.body.Bytes()
	if _, ok := h["Content-Type"]; !ok && len(body) > 0 {
		// net/http would sniff it on the wire; do it now so replays match.
		h.Set("Content-Type", http.DetectContentType(body))
	}
	if body == nil {
		body = []byte{}
	}
	return mwResponse{status: c.status, header: h, body: body}
}

func mwWriteResponse(w http.ResponseWriter, resp mwResponse, replayed bool) {
	dst := w.Header()
	for name, values := range resp.header {
		dst[name] = append([]string(nil), values...)
	}
	if replayed {
		dst.Set(idem.HeaderReplayed, "true")
	}
	dst.Set("Content-Length", strconv.Itoa(len(resp.body)))
	w.WriteHeader(resp.status)
	_, _ = w.Write(resp.body) // the client may be gone; the record is safe either way
}

// mwError is the JSON body of every answer the middleware itself gives.
type mwError struct {
	Error string `json:"error"`
	Code  string `json:"code"`
}

func mwWriteError(w http.ResponseWriter, status int, code, msg string) {
	body, _ := json.Marshal(mwError{Error: msg, Code: code})
	body = append(body, '\n')
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// Request context: what the wrapped handler needs to join the transaction and to
// stamp its outbox messages with the intent's name.

type mwCtxKey struct{}

type mwRequestInfo struct {
	tx    pgx.Tx
	scope string
	key   idem.Key
}

func mwInfo(ctx context.Context) (*mwRequestInfo, bool) {
	info, ok := ctx.Value(mwCtxKey{}).(*mwRequestInfo)
	return info, ok
}

// TxFromContext returns the request's transaction inside a handler wrapped by
// Middleware. Do every write of the request through it: it commits with the stored
// response, or not at all. ok is false outside the middleware.
func TxFromContext(ctx context.Context) (tx pgx.Tx, ok bool) {
	info, ok := mwInfo(ctx)
	if !ok {
		return nil, false
	}
	return info.tx, true
}

// KeyFromContext returns the request's Idempotency-Key. ok is false outside the
// middleware.
func KeyFromContext(ctx context.Context) (key idem.Key, ok bool) {
	info, ok := mwInfo(ctx)
	if !ok {
		return "", false
	}
	return info.key, true
}

// ScopeFromContext returns the request's Idempotency-Scope; "" means no scope (and
// is also what it returns outside the middleware).
func ScopeFromContext(ctx context.Context) string {
	info, ok := mwInfo(ctx)
	if !ok {
		return ""
	}
	return info.scope
}

// ScopedKeyFromContext returns idem.ScopedKey(scope, key): the identity to put on
// outbox messages (idem.Message.Key), so two tenants' identical keys stay two
// intents past the ingress. ok is false outside the middleware.
func ScopedKeyFromContext(ctx context.Context) (scoped string, ok bool) {
	info, ok := mwInfo(ctx)
	if !ok {
		return "", false
	}
	return idem.ScopedKey(info.scope, info.key), true
}
