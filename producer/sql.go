package producer

import (
	"fmt"
	"time"

	"github.com/idemkit/idem/internal/pgschema"
)

// All of the middleware's SQL, in one place, so a reviewer can read the whole
// protocol against the idem_requests table without hunting through Go code.
//
// Every statement runs inside the request's one transaction (see Middleware.Wrap).
const (
	// sqlBegin opens the request's transaction and bounds how long any of its
	// statements waits for a lock, above all the claim's wait on a concurrent
	// duplicate's uncommitted row, in one round trip (two statements in one simple
	// query). The %d is the middleware's Wait in milliseconds, formatted from an
	// integer: SET cannot take a bind parameter.
	sqlBegin = `BEGIN; SET LOCAL lock_timeout = '%dms'`

	// sqlClaim claims (scope, key). It returns a row when this transaction now
	// owns the key, and nothing when the key already has a committed record.
	//
	// The interesting case is a concurrent duplicate: its INSERT finds the first
	// arrival's uncommitted unique-index entry and blocks until that transaction ends.
	// If the first commits, the INSERT sees the conflict and returns nothing (replay);
	// if it rolls back, the INSERT goes through and this request executes instead.
	// The wait is bounded by lock_timeout (SQLSTATE 55P03).
	sqlClaim = `
INSERT INTO idem_requests (scope, key, fingerprint, method, path, status, expires_at)
VALUES ($1, $2, $3, $4, $5, 'running', now() + make_interval(secs => $6::float8))
ON CONFLICT (scope, key) DO NOTHING
RETURNING locked_at`

	// sqlLookup reads the committed record of a key that is already taken.
	sqlLookup = `
SELECT fingerprint, status, response_code, response_headers, response_body,
       expires_at <= now() AS expired
FROM idem_requests
WHERE scope = $1 AND key = $2`

	// sqlDeleteExpired removes a record that has outlived the key lifetime, so
	// the key can be claimed afresh. The expiry test is repeated here because a
	// concurrent request may have replaced the row in between.
	sqlDeleteExpired = `
DELETE FROM idem_requests
WHERE scope = $1 AND key = $2 AND expires_at <= now()`

	// sqlComplete stores the handler's response as the key's first result. It
	// commits together with the handler's business rows and outbox messages, and is
	// sent in one round trip with the handler's outbox INSERTs (Intent.Enqueue).
	sqlComplete = `
UPDATE idem_requests
SET status = 'done', response_code = $3, response_headers = $4, response_body = $5
WHERE scope = $1 AND key = $2`
)

// queries is the SQL of one schema: idem_requests qualified once, when the
// middleware is built.
type queries struct {
	begin, claim, lookup, deleteExpired, complete string
}

func newQueries(schema string, wait time.Duration) queries {
	q := func(sql string) string { return pgschema.Qualify(schema, sql) }
	return queries{
		begin: fmt.Sprintf(sqlBegin, max(wait.Milliseconds(), 1)),
		claim: q(sqlClaim), lookup: q(sqlLookup), deleteExpired: q(sqlDeleteExpired), complete: q(sqlComplete),
	}
}
