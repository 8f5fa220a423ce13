package producer

// This file is the server side of the Idempotency-Key protocol (IETF draft
// "The Idempotency-Key HTTP Header Field", as practised by Stripe): an http.Handler
// wrapper that turns "name -> first response" into one Postgres transaction.
//
// The whole request is one transaction:
//
//	BEGIN                                                                   -- 1 round trip
//	  SELECT pg_advisory_xact_lock(space, hash(scope, key))  -- claim: lock_timeout = Wait
//	  SELECT ... FROM idem_requests WHERE (scope, key)       -- a record: replay it
//	  handler(ctx with tx)        -- business rows; Intent.Enqueue only queues
//	  INSERT INTO idem_outbox ...; INSERT INTO idem_requests (response) -- 1 round trip
//	COMMIT
//	wake the relay                -- outside the transaction (outbox.Outbox.Wake)
//	write the captured response
//
// The record is written once, finished, with the effect it answers for: a crash
// anywhere before COMMIT leaves no trace, and the client's retry (same key) simply
// executes again. A concurrent duplicate needs no polling or "in progress" row
// either: it waits on the first arrival's lock, which Postgres drops when that
// transaction ends (commit, rollback, or its connection's death), then looks the
// record up and replays (commit) or executes (no record). The record's primary key
// stays the last guard: a second record for the key fails to commit.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/outbox"
)

// Defaults applied to zero fields of Config.
const (
	// DefaultKeyLifetime is how long a stored response is replayed.
	DefaultKeyLifetime = 48 * time.Hour
	// defaultWait is how long a concurrent duplicate waits for the first arrival.
	defaultWait = 5 * time.Second
	// DefaultMaxBodyBytes is the largest request body accepted.
	DefaultMaxBodyBytes = 1 << 20
	// defaultMaxResponseBytes is the largest response body stored for replay.
	defaultMaxResponseBytes = 1 << 20
	// defaultMaxInFlightWait is how long a request beyond MaxInFlight waits for a
	// slot before it is refused.
	defaultMaxInFlightWait = 250 * time.Millisecond
)

// Config configures a Middleware. The zero value is valid and means the defaults
// documented on each field.
type Config struct {
	// KeyLifetime is how long a stored response is replayed; it sets
	// idem_requests.expires_at. After it, the key may be claimed afresh. It must
	// outlast every window in which the same intent can still arrive (client
	// retries, resume after a restart), so keep it long and bound storage by
	// retention (the worker's collector deletes expired records in small batches)
	// instead. Default DefaultKeyLifetime.
	//
	// It also bounds how old a key may be. A key that carries the time it was
	// minted (a UUIDv7, as idem.NewKey mints) and is older than KeyLifetime, less
	// a margin for the clocks involved (a quarter of it, at most an hour), is
	// refused with 422 idempotency_key_expired unless its record is still live:
	// its first request may have executed and been forgotten since, and running it
	// again would be the double effect the key exists to prevent. Other keys carry
	// no time; their clients must stop re-sending within KeyLifetime on their own.
	KeyLifetime time.Duration

	// Wait is how long a concurrent duplicate waits for the first arrival with the
	// same key to finish before it gets 409 with Retry-After. It is applied as the
	// transaction's lock_timeout, so it also bounds the handler's own lock waits.
	// Keep it well below the HTTP server's WriteTimeout. Default 5s.
	Wait time.Duration

	// MaxBodyBytes is the largest request body accepted; a larger one gets 413 and
	// claims nothing. The body is buffered to fingerprint it. Default
	// DefaultMaxBodyBytes.
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
	// scopes, and one scope never receives another's stored response. Derive it
	// from what the service has verified (the authenticated principal, a tenant in
	// a signed token), never from something the client merely claims: whoever can
	// choose a scope can write into that key space, and can tell from a 422 that a
	// key exists there. An error rejects the request with 400.
	//
	// The default is no scope (one key space for everyone), or the client's
	// Idempotency-Scope header when ScopeFromHeader is set. With no scope, a request
	// that carries the header is refused (400): the client believes its keys are
	// scoped, and they would not be.
	Scope func(r *http.Request) (string, error)

	// ScopeFromHeader, when Scope is nil, takes the scope from the client's
	// Idempotency-Scope header. Enable it only where the header is set or verified
	// by something the service trusts (a gateway that authenticated the caller).
	ScopeFromHeader bool

	// MaxInFlight bounds the state-changing requests running at once; beyond it a
	// request gets 503 with Retry-After before it takes a database connection, so
	// a flood (of same-key duplicates, each waiting up to Wait) cannot starve the
	// rest of the service of connections. Default 0: unbounded (the worker sets it
	// from the pool it is given).
	MaxInFlight int

	// MaxInFlightWait is how long a request beyond MaxInFlight waits for a slot,
	// holding no connection, before it gets the 503: a burst shorter than this is
	// queued rather than refused, since a refused client comes back only after
	// Retry-After (a second). Default 250ms; negative: no wait.
	MaxInFlightWait time.Duration
}

// WithDefaults returns a copy of c with zero fields replaced by their defaults.
func (c Config) WithDefaults() Config {
	if c.KeyLifetime == 0 {
		c.KeyLifetime = DefaultKeyLifetime
	}
	if c.Wait == 0 {
		c.Wait = defaultWait
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.MaxResponseBytes == 0 {
		c.MaxResponseBytes = defaultMaxResponseBytes
	}
	if c.MaxInFlightWait == 0 {
		c.MaxInFlightWait = defaultMaxInFlightWait
	}
	if c.Scope == nil {
		c.Scope = noScope
		if c.ScopeFromHeader {
			c.Scope = scopeFromHeader
		}
	}
	return c
}

// validate reports a configuration that cannot work. It is called on the result of
// withDefaults, so it only sees values a user set explicitly.
func (c Config) validate() error {
	if c.KeyLifetime < time.Second {
		return fmt.Errorf("producer: KeyLifetime %v is shorter than one second", c.KeyLifetime)
	}
	if c.Wait < time.Millisecond {
		// lock_timeout has millisecond resolution and 0 would mean "wait forever".
		return fmt.Errorf("producer: Wait %v is shorter than one millisecond", c.Wait)
	}
	if c.MaxBodyBytes < 0 {
		return fmt.Errorf("producer: MaxBodyBytes %d is negative", c.MaxBodyBytes)
	}
	if c.MaxInFlight < 0 {
		return fmt.Errorf("producer: MaxInFlight %d is negative", c.MaxInFlight)
	}
	if c.MaxResponseBytes < 0 {
		return fmt.Errorf("producer: MaxResponseBytes %d is negative", c.MaxResponseBytes)
	}
	return nil
}

// errScopeNotAccepted is noScope's refusal of a client's Idempotency-Scope.
var errScopeNotAccepted = fmt.Errorf("this service does not take the %s header: the scope of a key comes from the service (the authenticated caller), not from the client; send the request without it", idem.HeaderScope)

// noScope is the default scope: none. A client that sends a scope would otherwise
// believe its keys are kept apart from other tenants' when they are not.
func noScope(r *http.Request) (string, error) {
	if len(r.Header.Values(idem.HeaderScope)) > 0 {
		return "", errScopeNotAccepted
	}
	return "", nil
}

func scopeFromHeader(r *http.Request) (string, error) {
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
	pool     *pgxpool.Pool
	cfg      Config
	q        store.Requests
	outbox   *outbox.Outbox
	log      *slog.Logger
	observer idem.Observer
	// waitMs is Wait as a lock_timeout setting, the claim's $7.
	waitMs   string
	inFlight chan struct{} // a slot per request in flight; nil when unbounded
	// keyAgeLimit: a UUIDv7 key older than this with no live record is refused;
	// keyAgeMargin: one dated further than this ahead of this process's clock too.
	keyAgeLimit, keyAgeMargin time.Duration
	clock                     *clockWatch      // the database's clock against this process's
	now                       func() time.Time // this process's wall clock (tests set it)
}

// NewMiddleware returns the ingress of inst: a Middleware that keeps its records
// in inst's idem_requests, writes the request's messages into inst's outbox
// (whose stream's subjects and broker's max_payload bound what Intent.Enqueue
// accepts), wakes inst's relays, and logs and reports its events through inst.
// The zero Config means the defaults.
func NewMiddleware(inst *install.Installation, cfg Config) (*Middleware, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	m := &Middleware{
		pool: inst.Pool(), cfg: cfg, q: parts.Of(inst).Store.Requests, outbox: outbox.New(inst),
		log: inst.Logger(), observer: inst.Observer(),
		waitMs: fmt.Sprintf("%dms", max(cfg.Wait.Milliseconds(), 1)), keyAgeLimit: keyAgeLimit(cfg.KeyLifetime),
		keyAgeMargin: keyAgeMargin(cfg.KeyLifetime), clock: newClockWatch(), now: time.Now,
	}
	if cfg.MaxInFlight > 0 {
		m.inFlight = make(chan struct{}, cfg.MaxInFlight)
	}
	return m, nil
}

// Config returns the configuration with defaults filled in, so a service can check
// at start that the key lifetime outlasts its other retry windows.
func (m *Middleware) Config() Config { return m.cfg }

// Wrap returns next guarded by the protocol.
//
// Safe methods (GET, HEAD, OPTIONS, TRACE) pass straight through. Every other method
// needs an Idempotency-Key header and runs next inside one Postgres transaction,
// available to next through IntentFrom. next must do all its writes through that
// transaction (Intent.Tx, Intent.Enqueue), must not commit or roll it back, and must
// not use it after it returns.
//
// What next's response means:
//   - below 500 (2xx, 3xx, 4xx): final. It is stored with the business rows and
//     replayed, with Idempotent-Replayed: true, to every later request with the same
//     scope, key and payload — except 408, 425 and 429, which say "try again" and
//     would be wrong forever if stored; they are treated like a 5xx.
//   - 5xx or a panic: not final. The transaction rolls back — business rows, outbox
//     messages and the claim disappear — and the retry executes again.
//
// The middleware's own answers: 400 missing or malformed key or scope, or a scope
// header the service does not take; 413 body over MaxBodyBytes; 500
// response_too_large (rolled back) when the handler writes more than
// MaxResponseBytes; 422 key reused with a different method, path or body, or a
// key older than the service remembers keys (see Config.KeyLifetime); 409 with
// Retry-After when the first arrival is still running after Wait; 503 when the
// database is unreachable or MaxInFlight requests are running. None of them stores
// anything.
//
// Wrap on a nil Middleware (a worker's Ingress when worker.Config.Ingress was left
// out) logs the mistake once and returns a handler that never runs next and answers
// every request 500 ingress_not_configured, saying so.
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	if m == nil {
		return notConfigured()
	}
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
	ctx := r.Context()
	a := &answer{m: m, w: w, ctx: ctx, start: time.Now(), log: m.log.With("method", r.Method, "path", r.URL.Path)}

	// 1. Validate the name of the intent before touching the database: a request
	// that can never succeed must not claim anything.
	key, code, err := parseKeyHeader(r.Header.Values(idem.HeaderKey))
	if err != nil {
		a.reject(http.StatusBadRequest, code, err.Error())
		return
	}
	scope, err := m.cfg.Scope(r)
	if err == nil {
		err = idem.ValidateScope(scope)
	}
	if err != nil {
		code := codeMalformedScope
		if errors.Is(err, errScopeNotAccepted) {
			code = codeScopeNotAccepted
		}
		a.reject(http.StatusBadRequest, code, err.Error())
		return
	}
	a.log = a.log.With("scope", scope, "key", string(key))

	// 2. Take a slot among the requests in flight before reading the body, so that
	// the bodies buffered at once are bounded by MaxInFlight, not by how many
	// connections are open.
	if m.inFlight != nil {
		if !m.enter(ctx) {
			a.busy()
			return
		}
		defer func() { <-m.inFlight }()
	}

	// 3. Buffer the body: the fingerprint needs all of it, and the handler may read
	// it again. An oversize body is refused before the claim, so the client can fix
	// the request and retry with the same key.
	body, err := m.readBody(w, r)
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			a.reject(http.StatusRequestEntityTooLarge, codeBodyTooLarge,
				fmt.Sprintf("request body is larger than %d bytes", m.cfg.MaxBodyBytes))
			return
		}
		a.reject(http.StatusBadRequest, codeUnreadableBody, "reading request body: "+err.Error())
		return
	}
	fp := fingerprint(r.Method, r.URL.RequestURI(), body)

	// 4. One transaction for claim, effect and stored response. BEGIN rides with
	// the claim, the key's lock and the lookup of its record, and COMMIT with the
	// record, written once (requestTx).
	var rec record
	found := false
	tx, err := begin(ctx, m.pool, m.q.Lock, []any{int32(store.RequestLock(scope, string(key))), m.waitMs},
		m.q.Lookup, []any{scope, string(key)}, func(row pgx.Row) error {
			err := row.Scan(&rec.fingerprint, &rec.status, &rec.code, &rec.header, &rec.body, &rec.expired, &rec.expiresAt, &rec.dbNow)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil
			}
			found = err == nil
			return err
		})
	if tx != nil {
		defer a.end(tx) // a no-op once committed
	}
	if err == nil && found && m.forgets(ctx, a, rec) {
		// The key outlived its lifetime; it now names nothing. Its old record goes
		// in this transaction, which holds the key.
		if _, err = tx.Exec(ctx, m.q.DeleteExpired, scope, string(key)); err != nil {
			err = fmt.Errorf("producer: delete expired record: %w", err)
		}
		found = false
	}
	if err != nil {
		if isLockTimeout(err) {
			a.conflict()
			return
		}
		a.dbFailed(err)
		return
	}
	if found {
		// The key already names a finished request: answer from the record. The
		// transaction did nothing, so the deferred rollback just ends it.
		a.fromRecord(rec, fp)
		return
	}
	if code, msg, refused := m.keyAgeRefusal(key, m.now()); refused {
		// No live record, and the key's age says it must not execute (keyage.go).
		a.end(tx)
		a.reject(http.StatusUnprocessableEntity, code, msg)
		return
	}

	// 5. Run the handler inside the transaction, capturing its response instead of
	// sending it: nothing may reach the client before the record commits.
	setBody(r, body)
	intent := &Intent{Tx: tx, Scope: scope, Key: key, outbox: m.outbox, batch: &pgx.Batch{}}
	capture := newCapture(m.cfg.MaxResponseBytes)
	if !a.runHandler(next, capture, r.WithContext(withIntent(ctx, intent))) {
		a.end(tx)
		a.fail(http.StatusInternalServerError, codeInternalError,
			"the request failed and was rolled back; retry with the same Idempotency-Key")
		return
	}
	if capture.overflow {
		a.end(tx)
		a.log.ErrorContext(ctx, "producer: handler response exceeds MaxResponseBytes; rolled back", "limit", m.cfg.MaxResponseBytes)
		a.fail(http.StatusInternalServerError, codeResponseTooLarge,
			fmt.Sprintf("the handler's response is larger than the %d bytes that can be stored for replay; the request was rolled back", m.cfg.MaxResponseBytes))
		return
	}
	resp := capture.result()

	if !storesResponse(resp.status) {
		// Not a final answer: forget everything, so the retry executes again.
		a.end(tx)
		a.log.WarnContext(ctx, "producer: handler answered with a retryable status; rolled back", "status", resp.status)
		a.respond(idem.OutcomeFailed, resp, false)
		return
	}

	// 6. Write the handler's outbox messages, remember the response and commit, in
	// one round trip.
	messages := intent.batch.Len()
	intent.batch.Queue(m.q.Record, scope, string(key), fp, r.Method, r.URL.Path,
		resp.status, storedHeader(resp.header), resp.body, m.cfg.KeyLifetime.Seconds())
	if err := tx.commit(ctx, intent.batch); err != nil {
		if isRecordTaken(err) {
			// Another transaction committed the key's record first (an ingress of an
			// older release, which does not take the lock): this one is rolled back,
			// and the first response is the answer.
			a.end(tx)
			m.replayCommitted(ctx, a, scope, key, fp)
			return
		}
		// Most likely the handler ignored a failed statement and the transaction
		// is aborted; either way nothing of this request survives. If instead the
		// connection broke during COMMIT, the outcome is unknown. That is exactly
		// what the key is for: the retry replays or executes, never both.
		a.dbFailed(fmt.Errorf("producer: enqueue, store response and commit: %w", err))
		return
	}
	// The window in which a crash leaves the client without an answer to an effect
	// that happened: the retry must be a replay.
	if err := faults.From(ctx).Hit(ctx, faults.IngressAfterCommit, []string{intent.ScopedKey()}); err != nil {
		// Abandoned as if the process died here: the connection breaks unanswered.
		a.log.WarnContext(ctx, "producer: response abandoned after commit (fault point)", "err", err)
		panic(http.ErrAbortHandler)
	}
	if messages > 0 {
		// After the commit, so the relay finds the rows. A failure only delays them
		// to the relay's next poll.
		if err := m.outbox.Wake(ctx); err != nil {
			a.log.WarnContext(ctx, "producer: waking the relay failed; it will find the messages at its next poll", "err", err)
		}
	}
	a.log.DebugContext(ctx, "producer: executed and stored", "status", resp.status)
	a.respond(idem.OutcomeNew, resp, false)
}

// setBody gives the handler the buffered body, readable again.
func setBody(r *http.Request, body []byte) {
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
}

// enter takes one of the MaxInFlight slots, waiting up to MaxInFlightWait for one.
func (m *Middleware) enter(ctx context.Context) bool {
	select {
	case m.inFlight <- struct{}{}:
		return true
	default:
	}
	if m.cfg.MaxInFlightWait < 0 {
		return false
	}
	t := time.NewTimer(m.cfg.MaxInFlightWait)
	defer t.Stop()
	select {
	case m.inFlight <- struct{}{}:
		return true
	case <-t.C:
		return false
	case <-ctx.Done():
		return false
	}
}

// parseKeyHeader validates the Idempotency-Key header values. It returns an error
// code for the JSON body alongside the error.
func parseKeyHeader(values []string) (idem.Key, string, error) {
	switch len(values) {
	case 0:
		return "", codeMissingKey,
			fmt.Errorf("this request changes state and needs an %s header (1..%d printable ASCII bytes, e.g. a UUID minted by the client)", idem.HeaderKey, idem.MaxKeyLen)
	case 1:
	default:
		return "", codeMalformedKey, fmt.Errorf("%d %s headers, want exactly one", len(values), idem.HeaderKey)
	}
	if values[0] == "" {
		// A present but empty header is a malformed key, not a missing one: the
		// client tried to send a key and got it wrong.
		return "", codeMalformedKey, fmt.Errorf("%s header is empty", idem.HeaderKey)
	}
	key, err := idem.ParseKey(values[0])
	if err != nil {
		return "", codeMalformedKey, err
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

// fingerprint identifies a request's payload: SHA-256 over its method, target (path
// and query string: "?amount=1" and "?amount=100" are different requests) and body,
// each prefixed by its length so that no two different requests can encode to the
// same byte stream (without the prefixes, path "/ab"+body "c" and path "/a"+body
// "bc" would collide). Same key with a different fingerprint is a client bug: 422.
func fingerprint(method, target string, body []byte) []byte {
	h := sha256.New()
	var n [8]byte
	for _, part := range [][]byte{[]byte(method), []byte(target), body} {
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write(part)
	}
	return h.Sum(nil)
}

// record is a committed idem_requests row, as read by a duplicate.
type record struct {
	fingerprint []byte
	status      string
	code        *int
	header      http.Header
	body        []byte
	expired     bool      // by the database's clock
	expiresAt   time.Time // the database's
	dbNow       time.Time // the database's clock at the lookup
}

// forgets reports whether rec, found by the lookup, is expired and may be
// forgotten: only when the database's clock and this process's agree. A record is
// forgotten and its key executed again, so a clock that jumped ahead would mean a
// second execution; the record is kept (and replayed) while either clock says it
// is live, or while the database's clock ran ahead of this process's (clockWatch).
func (m *Middleware) forgets(ctx context.Context, a *answer, rec record) bool {
	if !rec.expired {
		m.clock.check(rec.dbNow)
		return false
	}
	if skew, jumped := m.clock.check(rec.dbNow); jumped {
		a.log.ErrorContext(ctx, "producer: the database's clock ran ahead of this process's; an expired record is kept and replayed, not forgotten",
			"ahead", skew.Round(time.Second), "expires_at", rec.expiresAt)
		return false
	}
	if rec.expiresAt.After(m.now()) {
		a.log.WarnContext(ctx, "producer: a record the database's clock calls expired is live by this process's clock; replayed, not forgotten",
			"expires_at", rec.expiresAt, "database_now", rec.dbNow)
		return false
	}
	return true
}

// replayCommitted answers from the key's committed record after this request's
// own record lost to it.
func (m *Middleware) replayCommitted(ctx context.Context, a *answer, scope string, key idem.Key, fp []byte) {
	var rec record
	err := m.pool.QueryRow(ctx, m.q.Lookup, scope, string(key)).
		Scan(&rec.fingerprint, &rec.status, &rec.code, &rec.header, &rec.body, &rec.expired, &rec.expiresAt, &rec.dbNow)
	if err != nil {
		a.dbFailed(fmt.Errorf("producer: look up the record that came first: %w", err))
		return
	}
	a.fromRecord(rec, fp)
}

// isRecordTaken reports the unique violation of the key's record (Requests.Record).
func isRecordTaken(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.TableName == "idem_requests"
}

// storesResponse reports whether a handler's status is a final answer worth
// replaying. 5xx means the server failed; 408, 425 and 429 mean "not now". Storing
// any of them would turn a passing problem into a permanent answer for the key.
func storesResponse(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status < 500
}

func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03" // lock_not_available
}
