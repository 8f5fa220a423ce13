package store

// idem_requests: the HTTP ingress's records: (scope, key) -> the first response
// (package producer).

const (
	// sqlClaimFirst is sqlClaim as the transaction's first statement: its FROM
	// subquery, evaluated before the row is inserted (so before any wait on a
	// concurrent duplicate's uncommitted row), sets lock_timeout to $7, Wait, for
	// the rest of the transaction (set_config with is_local true is SET LOCAL).
	// The handler's statements inherit it.
	sqlRequestsClaimFirst = `
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
	sqlRequestsClaim = `
INSERT INTO idem_requests (scope, key, fingerprint, method, path, status, expires_at)
VALUES ($1, $2, $3, $4, $5, 'running', now() + make_interval(secs => $6::float8))
ON CONFLICT (scope, key) DO NOTHING
RETURNING locked_at`

	// sqlLookup reads the committed record of a key that is already taken.
	sqlRequestsLookup = `
SELECT fingerprint, status, response_code, response_headers, response_body,
       expires_at <= now() AS expired
FROM idem_requests
WHERE scope = $1 AND key = $2`

	// sqlDeleteExpired removes a record that has outlived the key lifetime, so
	// the key can be claimed afresh. The expiry test is repeated here because a
	// concurrent request may have replaced the row in between.
	sqlRequestsDeleteExpired = `
DELETE FROM idem_requests
WHERE scope = $1 AND key = $2 AND expires_at <= now()`

	// sqlComplete stores the handler's response as the key's first result. It
	// commits together with the handler's business rows and outbox messages, and is
	// sent in one round trip with the handler's outbox INSERTs (Intent.Enqueue).
	sqlRequestsComplete = `
UPDATE idem_requests
SET status = 'done', response_code = $3, response_headers = $4, response_body = $5
WHERE scope = $1 AND key = $2`

	sqlRequestsInspect = `
SELECT method, path, status, response_code, response_body, encode(fingerprint, 'hex'),
       locked_at, created_at, expires_at
FROM idem_requests
WHERE scope = $1 AND key = $2`

	// Only when nothing at all is known about the key: is it known in other scopes?
	// The request table's key is (scope, key), so this scans; it runs once, by hand.
	sqlRequestsOtherScopes = `
SELECT DISTINCT scope FROM idem_requests
WHERE key = $1 AND scope <> $2
ORDER BY scope
LIMIT 20`

	// Collect deletes expired rows, one bounded batch ($1 rows) per statement.
	// SKIP LOCKED: a row some transaction is using right now is left for the next
	// round. It reads and deletes its ctids in ONLY the table: a ctid names a row
	// within one relation, and through a partitioned parent the same ctid is a row
	// in each partition. Run against a table that was converted after the round
	// looked at its layout (partition.Convert), it finds no row in the parent
	// itself and deletes nothing; the next round collects the default partition.
	sqlRequestsCollect = `
DELETE FROM ONLY idem_requests WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM ONLY idem_requests WHERE expires_at < now() LIMIT $1 FOR UPDATE SKIP LOCKED))`

	// Counts: every record, and those not yet done.
	sqlRequestsCounts = `
SELECT (SELECT count(*) FROM idem_requests), (SELECT count(*) FROM idem_requests WHERE status <> 'done')`
)

// Requests is the SQL of idem_requests, qualified for one schema.
type Requests struct {
	ClaimFirst, Claim, Lookup, DeleteExpired, Complete, Inspect, OtherScopes, Collect, Counts string
}

func newRequests(q func(string) string) Requests {
	return Requests{
		ClaimFirst:    q(sqlRequestsClaimFirst),
		Claim:         q(sqlRequestsClaim),
		Lookup:        q(sqlRequestsLookup),
		DeleteExpired: q(sqlRequestsDeleteExpired),
		Complete:      q(sqlRequestsComplete),
		Inspect:       q(sqlRequestsInspect),
		OtherScopes:   q(sqlRequestsOtherScopes),
		Collect:       q(sqlRequestsCollect),
		Counts:        q(sqlRequestsCounts),
	}
}
