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
	// A request runs in a requestTx: BEGIN goes in one batch with sqlClaimFirst,
	// COMMIT in one with the outbox INSERTs and sqlComplete. Extended-protocol
	// statements, one per message, so no SET LOCAL can ride along: sqlClaimFirst
	// sets the lock timeout itself.
	sqlBeginRequest    = `BEGIN`
	sqlCommitRequest   = `COMMIT`
	sqlRollbackRequest = `ROLLBACK`
	// sqlNoop changes nothing; requestTx.LargeObjects sends it where pgx sends BEGIN.
	sqlNoop = `SELECT 1`

	// A handler's nested transaction (Intent.Tx.Begin) is a savepoint, named
	// idem_sp_<n> (appended), as pgx's own nested transactions are.
	sqlSavepoint           = `SAVEPOINT `
	sqlReleaseSavepoint    = `RELEASE SAVEPOINT `
	sqlRollbackToSavepoint = `ROLLBACK TO SAVEPOINT `

	// sqlClaimFirst is sqlClaim as the transaction's first statement: its FROM
	// subquery, evaluated before the row is inserted (so before any wait on a
	// concurrent duplicate's uncommitted row), sets lock_timeout to $7, Wait, for
	// the rest of the transaction (set_config with is_local true is SET LOCAL).
	// The handler's statements inherit it.
	sqlClaimFirst = `
INSERT INTO idem_requests (scope, key, fingerprint, method, path, status, expires_at)
SELECT $1, $2, $3, $4, $5, 'running', now() + make_interval(secs => $6::float8)
FROM (SELECT set_config('lock_timeout', $7, true)) AS wait_lock_timeout
ON CONFLICT (scope, key) DO NOTHING
RETURNING locked_at`

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
	claim, claimFirst, lookup, deleteExpired, complete string
	// waitMs is Wait as a lock_timeout setting, sqlClaimFirst's $7.
	waitMs string
}

func newQueries(schema string, wait time.Duration) queries {
	q := func(sql string) string { return pgschema.Qualify(schema, sql) }
	return queries{
		claim: q(sqlClaim), claimFirst: q(sqlClaimFirst), lookup: q(sqlLookup), deleteExpired: q(sqlDeleteExpired), complete: q(sqlComplete),
		waitMs: fmt.Sprintf("%dms", max(wait.Milliseconds(), 1)),
	}
}
