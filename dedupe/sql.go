package dedupe

import "github.com/idemkit/idem/internal/pgschema"

// All of the inbox's SQL, in one place. It names idem_inbox plainly; newQueries
// qualifies it for the configured schema once, when the Inbox is built.
//
// A row is one delivery: (consumer, key, message). A row whose message is ” was
// written before schema v5 and settles every message of its key for its consumer;
// no new row is written with ”. Every claim and look-up therefore also probes for
// such a row: an index probe of idem_inbox_before_v5, which is empty once they have
// expired.
const (
	// The claim. ON CONFLICT DO NOTHING waits on a concurrent uncommitted claim of the
	// same delivery, then skips it: exactly one transaction sees each as new.
	//
	// The look-up of a row from before v5 is a LATERAL … LIMIT 1, one probe of
	// idem_inbox_before_v5 per key: as a NOT EXISTS the planner may instead scan
	// every such row of the consumer once per claim, which right after an upgrade
	// is most of the inbox.
	sqlClaim = `
INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, completed_at, expires_at)
SELECT $1, k, m, f, 'done', now(), now() + $5::interval
FROM unnest($2::text[], $3::text[], $4::bytea[]) WITH ORDINALITY AS t(k, m, f, n)
LEFT JOIN LATERAL (
  SELECT true AS held FROM idem_inbox l WHERE l.consumer = $1 AND l.key = t.k AND l.message = '' LIMIT 1
) AS e ON true
WHERE e.held IS NULL
ORDER BY n
ON CONFLICT (consumer, key, message) DO NOTHING
RETURNING key, message`

	// A partitioned inbox (package partition) cannot enforce uniqueness with a
	// unique index: Postgres's unique indexes on a partitioned table must contain
	// the partition key, expires_at. So the claim takes a transaction-level
	// advisory lock per (consumer, key) first, in one global order (no deadlock
	// between two batches), and then inserts only the deliveries no partition has.
	// The lock and the insert are two statements: under READ COMMITTED the
	// insert's snapshot is taken after the lock was granted, so it sees a row that
	// the lock's previous holder committed. The first statement reports the
	// isolation level, which the claim checks.
	sqlClaimLock = `
SELECT current_setting('transaction_isolation'), count(*)
FROM (
  SELECT pg_advisory_xact_lock(x'69646962'::int, h)
  FROM (SELECT DISTINCT hashtext($1 || chr(31) || k) AS h FROM unnest($2::text[]) AS t(k) ORDER BY 1) AS keys
) AS locked`

	// The look-up of each delivery is a LATERAL … LIMIT 1, one index probe per
	// partition, for the reason given at sqlLookup: as a NOT EXISTS the planner may
	// turn it into an anti-join that reads every partition whole.
	sqlClaimPartitioned = `
INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, completed_at, expires_at)
SELECT $1, k, m, f, 'done', now(), now() + $5::interval
FROM unnest($2::text[], $3::text[], $4::bytea[]) WITH ORDINALITY AS t(k, m, f, n)
LEFT JOIN LATERAL (
  SELECT true AS held FROM idem_inbox i WHERE i.consumer = $1 AND i.key = t.k AND i.message IN (t.m, '') LIMIT 1
) AS e ON true
WHERE e.held IS NULL
  AND current_setting('transaction_isolation') = 'read committed'
ORDER BY n
RETURNING key, message`

	// One statement per delivery, pipelined in one round trip: a full primary-key
	// equality has no plan but the index probe.
	sqlSetResult = `UPDATE idem_inbox SET result = $4 WHERE consumer = $1 AND key = $2 AND message = $3`

	// One primary-key probe per delivery, whatever the planner believes about the
	// table: LIMIT 1 keeps the subquery from being flattened into a join that could
	// scan every row of the consumer (what a generic plan made on an empty inbox
	// does). A row of the delivery itself comes before one written before v5.
	sqlLookup = `
SELECT t.k, t.m, i.message, i.fingerprint, i.status, i.result, i.lease_until, i.step, i.created_at, i.completed_at, i.expires_at
FROM unnest($2::text[], $3::text[]) AS t(k, m)
CROSS JOIN LATERAL (
  SELECT * FROM idem_inbox WHERE consumer = $1 AND key = t.k AND message IN (t.m, '') ORDER BY message DESC LIMIT 1
) AS i`
)

// queries is the SQL of one schema.
type queries struct {
	claim, setResult, lookup                            string
	leaseInspect, leaseTakeOver, leaseExtend, leaseStep string
	leaseComplete, leaseRelease                         string

	// The plain inbox's lease insert, and the partitioned inbox's claims (see
	// sqlClaimLock).
	leaseInsert, claimLock, claimPartitioned, leaseInsertPartitioned string
}

func newQueries(schema string) queries {
	q := func(sql string) string { return pgschema.Qualify(schema, sql) }
	return queries{
		claim: q(sqlClaim), setResult: q(sqlSetResult), lookup: q(sqlLookup),
		leaseInspect: q(sqlLeaseInspect), leaseTakeOver: q(sqlLeaseTakeOver), leaseExtend: q(sqlLeaseExtend),
		leaseStep: q(sqlLeaseStep), leaseComplete: q(sqlLeaseComplete), leaseRelease: q(sqlLeaseRelease),
		leaseInsert: q(sqlLeaseInsert),
		claimLock:   sqlClaimLock, claimPartitioned: q(sqlClaimPartitioned),
		leaseInsertPartitioned: q(sqlLeaseInsertPartitioned),
	}
}
