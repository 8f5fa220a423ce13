package dedupe

import "github.com/idemkit/idem/internal/pgschema"

// All of the inbox's SQL, in one place. It names idem_inbox plainly; newQueries
// qualifies it for the configured schema once, when the Inbox is built.
const (
	// The claim. ON CONFLICT DO NOTHING waits on a concurrent uncommitted claim of the
	// same key, then skips it: exactly one transaction sees each key as new.
	sqlClaim = `
INSERT INTO idem_inbox (consumer, key, fingerprint, status, completed_at, expires_at)
SELECT $1, k, f, 'done', now(), now() + $4::interval
FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS t(k, f, n)
ORDER BY n
ON CONFLICT (consumer, key) DO NOTHING
RETURNING key`

	// A partitioned inbox (package partition) cannot enforce (consumer, key) with a
	// unique index: Postgres's unique indexes on a partitioned table must contain
	// the partition key, expires_at. So the claim takes a transaction-level
	// advisory lock per key first, in one global order (no deadlock between two
	// batches), and then inserts only the keys no partition has. The lock and the
	// insert are two statements: under READ COMMITTED the insert's snapshot is
	// taken after the lock was granted, so it sees a key that the lock's previous
	// holder committed. The first statement reports the isolation level, which the
	// claim checks.
	sqlClaimLock = `
SELECT current_setting('transaction_isolation'), count(*)
FROM (
  SELECT pg_advisory_xact_lock(x'69646962'::int, h)
  FROM (SELECT DISTINCT hashtext($1 || chr(31) || k) AS h FROM unnest($2::text[]) AS t(k) ORDER BY 1) AS keys
) AS locked`

	// The look-up of each key is a LATERAL … LIMIT 1, one index probe per
	// partition, for the reason given at sqlLookup: as a NOT EXISTS the planner may
	// turn it into an anti-join that reads every partition whole.
	sqlClaimPartitioned = `
INSERT INTO idem_inbox (consumer, key, fingerprint, status, completed_at, expires_at)
SELECT $1, k, f, 'done', now(), now() + $4::interval
FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS t(k, f, n)
LEFT JOIN LATERAL (
  SELECT true AS held FROM idem_inbox i WHERE i.consumer = $1 AND i.key = t.k LIMIT 1
) AS e ON true
WHERE e.held IS NULL
  AND current_setting('transaction_isolation') = 'read committed'
ORDER BY n
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

// queries is the SQL of one schema.
type queries struct {
	claim, setResult, lookup                                          string
	leaseAcquire, leaseInspect, leaseExtend, leaseStep, leaseComplete string
	leaseRelease                                                      string

	// The partitioned inbox's claims (see sqlClaimLock).
	claimLock, claimPartitioned, leaseInsert, leaseTakeOver string
}

func newQueries(schema string) queries {
	q := func(sql string) string { return pgschema.Qualify(schema, sql) }
	return queries{
		claim: q(sqlClaim), setResult: q(sqlSetResult), lookup: q(sqlLookup),
		leaseAcquire: q(sqlLeaseAcquire), leaseInspect: q(sqlLeaseInspect), leaseExtend: q(sqlLeaseExtend),
		leaseStep: q(sqlLeaseStep), leaseComplete: q(sqlLeaseComplete), leaseRelease: q(sqlLeaseRelease),
		claimLock: sqlClaimLock, claimPartitioned: q(sqlClaimPartitioned),
		leaseInsert: q(sqlLeaseInsert), leaseTakeOver: q(sqlLeaseTakeOver),
	}
}
