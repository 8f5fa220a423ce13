package producer

// All of the middleware's SQL, in one place, so a reviewer can read the whole
// protocol against the idem_requests table without hunting through Go code.
//
// Every statement runs inside the request's one transaction (see Middleware.Wrap).
const (
	// sqlRequestLockTimeout bounds how long any statement of the transaction waits
	// for a lock, above all the claim's wait on a concurrent duplicate's uncommitted
	// row. SET LOCAL cannot take a bind parameter; set_config(..., true) is the same
	// thing, scoped to the transaction, and can.
	sqlRequestLockTimeout = `SELECT set_config('lock_timeout', $1, true)`

	// sqlRequestClaim claims (scope, key). It returns a row when this transaction now
	// owns the key, and nothing when the key already has a committed record.
	//
	// The interesting case is a concurrent duplicate: its INSERT finds the first
	// arrival's uncommitted unique-index entry and blocks until that transaction ends.
	// If the first commits, the INSERT sees the conflict and returns nothing (replay);
	// if it rolls back, the INSERT goes through and this request executes instead.
	// The wait is bounded by lock_timeout (SQLSTATE 55P03).
	sqlRequestClaim = `
INSERT INTO idem_requests (scope, key, fingerprint, method, path, status, expires_at)
VALUES ($1, $2, $3, $4, $5, 'running', now() + make_interval(secs => $6::float8))
ON CONFLICT (scope, key) DO NOTHING
RETURNING locked_at`

	// sqlRequestLookup reads the committed record of a key that is already taken.
	sqlRequestLookup = `
SELECT fingerprint, status, response_code, response_headers, response_body,
       expires_at <= now() AS expired
FROM idem_requests
WHERE scope = $1 AND key = $2`

	// sqlRequestDeleteExpired removes a record that has outlived the key lifetime, so
	// the key can be claimed afresh. The expiry test is repeated here because a
	// concurrent request may have replaced the row in between.
	sqlRequestDeleteExpired = `
DELETE FROM idem_requests
WHERE scope = $1 AND key = $2 AND expires_at <= now()`

	// sqlRequestComplete stores the handler's response as the key's first result. It
	// commits together with the handler's business rows and outbox messages.
	sqlRequestComplete = `
UPDATE idem_requests
SET status = 'done', response_code = $3, response_headers = $4, response_body = $5
WHERE scope = $1 AND key = $2`
)
