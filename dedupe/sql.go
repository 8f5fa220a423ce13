package dedupe

// All of the inbox's SQL, in one place.
const (
	// The claim. ON CONFLICT DO NOTHING waits on a concurrent uncommitted claim of the
	// same key, then skips it: exactly one transaction sees each key as new.
	sqlClaimBatch = `
INSERT INTO idem_inbox (consumer, key, fingerprint, status, completed_at, expires_at)
SELECT $1, k, f, 'done', now(), now() + $4::interval
FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS t(k, f, n)
ORDER BY n
ON CONFLICT (consumer, key) DO NOTHING
RETURNING key`

	// One statement per key, pipelined in one round trip: a full primary-key
	// equality has no plan but the index probe.
	sqlSetResult = `UPDATE idem_inbox SET result = $3 WHERE consumer = $1 AND key = $2`

	// One primary-key probe per key, whatever the planner believes about the table:
	// LIMIT 1 keeps the subquery from being flattened into a join that could scan
	// every row of the consumer (what a generic plan made on an empty inbox does).
	sqlLookup = `
SELECT i.key, i.fingerprint, i.status, i.result, i.lease_until, i.step, i.created_at, i.completed_at, i.expires_at
FROM unnest($2::text[]) AS t(k)
CROSS JOIN LATERAL (
  SELECT * FROM idem_inbox WHERE consumer = $1 AND key = t.k LIMIT 1
) AS i`
)

const sqlUnclaim = `DELETE FROM idem_inbox WHERE consumer = $1 AND key = ANY($2::text[])`

// Expired-row deletion, one bounded batch per statement. SKIP LOCKED: a row some
// transaction is using right now is simply left for the next round.
var collectedTables = []struct{ name, sql string }{
	{"idem_inbox", `
DELETE FROM idem_inbox WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM idem_inbox WHERE expires_at < now() LIMIT $1 FOR UPDATE SKIP LOCKED))`},
	{"idem_requests", `
DELETE FROM idem_requests WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM idem_requests WHERE expires_at < now() LIMIT $1 FOR UPDATE SKIP LOCKED))`},
	{"idem_outbox", `
DELETE FROM idem_outbox WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM idem_outbox WHERE published_at IS NOT NULL AND expires_at < now() LIMIT $1 FOR UPDATE SKIP LOCKED))`},
}
