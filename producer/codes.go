package producer

// The codes of the middleware's own answers, the "code" of their JSON body
// ({"error": "...", "code": "..."}): stable strings a client branches on, where
// the "error" text is for people and may change. The browser client matches
// codeKeyInUse, codeKeyExpired and codeKeyClockSkew by these names
// (clients/browser/src/retry.js, answer.js).
const (
	// 400: no Idempotency-Key on a state-changing request.
	codeMissingKey = "missing_idempotency_key"
	// 400: the key is empty, repeated, too long or not printable ASCII.
	codeMalformedKey = "malformed_idempotency_key"
	// 400: the Idempotency-Scope header is malformed.
	codeMalformedScope = "malformed_idempotency_scope"
	// 400: the request sent an Idempotency-Scope header to a service whose
	// scope comes from the authenticated caller (Config.ScopeFromHeader unset).
	codeScopeNotAccepted = "idempotency_scope_not_accepted"
	// 413: the body exceeds Config.MaxBodyBytes.
	codeBodyTooLarge = "body_too_large"
	// 400: the body could not be read.
	codeUnreadableBody = "unreadable_body"
	// 409: the first arrival with this key still runs; retry after Retry-After.
	codeKeyInUse = "idempotency_key_in_use"
	// 422: the key was seen before with another payload; a producer bug.
	codeKeyMismatch = "idempotency_key_mismatch"
	// 422: the key is older than the service remembers keys; it is not executed.
	codeKeyExpired = "idempotency_key_expired"
	// 422: the key is dated ahead of the service's clock by more than allowed.
	codeKeyClockSkew = "idempotency_key_clock_skew"
	// 503: Config.MaxInFlight requests are running; retry later.
	codeTooManyInFlight = "too_many_requests_in_flight"
	// 503: the database did not answer; retry later with the same key.
	codeDatabaseUnavailable = "database_unavailable"
	// 500: the handler's response exceeds Config.MaxResponseBytes, so it could
	// not be stored for replay; the request's transaction was rolled back.
	codeResponseTooLarge = "response_too_large"
	// 500: anything else that went wrong inside the middleware.
	codeInternalError = "internal_error"
	// 500: a Middleware's zero value, or one whose NewMiddleware failed, served.
	codeNotConfigured = "ingress_not_configured"
)
