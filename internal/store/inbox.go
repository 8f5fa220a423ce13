package store

// idem_inbox: the consumers' inbox, one row per delivery, (consumer, key, message)
// -> the first result (packages dedupe and consumer).
//
// A row whose message is '' was written before schema v5 and settles every
// message of its key for its consumer; no new row is written with ''. Every claim
// and look-up therefore also probes for such a row: an index probe of
// idem_inbox_before_v5, which is empty once they have expired.

const (
	// The settlement of deliveries a claim judged new (package dedupe): each
	// delivery's one row, written done with its result in the effect's
	// transaction. Nothing is written before the effect: the row is the claim and
	// the settlement at once.
	//
	// On a plain inbox a plain INSERT: the primary key makes a concurrent settlement
	// of the same delivery wait for the other transaction and then fail with a
	// unique violation if it committed, so of two copies exactly one commits. No ON
	// CONFLICT: a speculative insertion costs WAL and work for a conflict that is
	// rare and is the caller's cue to roll back. The subquery inserts nothing once
	// the table is partitioned (package partition converts it in place, under a
	// running worker): there the primary key no longer makes a delivery unique, and
	// the caller must learn the layout again and settle the partitioned way.
	sqlInboxSettle = `
INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, result, completed_at, expires_at)
SELECT $1, k, m, f, 'done', r, now(), now() + $6::interval
FROM unnest($2::text[], $3::text[], $4::bytea[], $5::bytea[]) WITH ORDINALITY AS t(k, m, f, r, n)
WHERE (SELECT c.relkind FROM pg_class c WHERE c.oid = 'idem_inbox'::regclass) = 'r'
ORDER BY n`

	// A partitioned inbox (package partition) cannot enforce uniqueness with a
	// unique index: Postgres's unique indexes on a partitioned table must contain
	// the partition key, expires_at. So the claim takes a transaction-level
	// advisory lock per (consumer, key) first, in one global order (no deadlock
	// between two batches), and the settlement, under the same locks, inserts only
	// the deliveries no partition has. The lock and the statements after it are
	// separate statements: under READ COMMITTED each later statement's snapshot is
	// taken after the lock was granted, so it sees a row that the lock's previous
	// holder committed. The first statement reports the isolation level, which the
	// claim checks.
	sqlInboxClaimLock = `
SELECT current_setting('transaction_isolation'), count(*)
FROM (
  SELECT pg_advisory_xact_lock(x'69646962'::int, h)
  FROM (SELECT DISTINCT hashtext($1 || chr(31) || k) AS h FROM unnest($2::text[]) AS t(k) ORDER BY 1) AS keys
) AS locked`

	// The look-up of each delivery is a LATERAL … LIMIT 1, one index probe per
	// partition, for the reason given at sqlLookup: as a NOT EXISTS the planner may
	// turn it into an anti-join that reads every partition whole.
	sqlInboxSettlePartitioned = `
INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, result, completed_at, expires_at)
SELECT $1, k, m, f, 'done', r, now(), now() + $6::interval
FROM unnest($2::text[], $3::text[], $4::bytea[], $5::bytea[]) WITH ORDINALITY AS t(k, m, f, r, n)
LEFT JOIN LATERAL (
  SELECT true AS held FROM idem_inbox i WHERE i.consumer = $1 AND i.key = t.k AND i.message IN (t.m, '') LIMIT 1
) AS e ON true
WHERE e.held IS NULL
  AND current_setting('transaction_isolation') = 'read committed'
ORDER BY n`

	// One primary-key probe per delivery, whatever the planner believes about the
	// table: LIMIT 1 keeps the subquery from being flattened into a join that could
	// scan every row of the consumer (what a generic plan made on an empty inbox
	// does). A row of the delivery itself comes before one written before v5.
	sqlInboxLookup = `
SELECT t.k, t.m, i.message, i.fingerprint, i.status, i.result, i.lease_until, i.step, i.created_at, i.completed_at, i.expires_at
FROM unnest($2::text[], $3::text[]) AS t(k, m)
CROSS JOIN LATERAL (
  SELECT * FROM idem_inbox WHERE consumer = $1 AND key = t.k AND message IN (t.m, '') ORDER BY message DESC LIMIT 1
) AS i`

	// The acquisition of a delivery no row settles yet: it is inserted as leased.
	// Nothing comes back when a row exists (this delivery's, or one written before
	// v5 for every message of the key); the caller then inspects it.
	sqlInboxLeaseInsert = `
INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, lease_until, lease_owner, lease_attempts, expires_at)
SELECT $1, $2, $3, $4, 'leased', now() + $5::interval, $6, 1, now() + $7::interval
WHERE NOT EXISTS (SELECT 1 FROM idem_inbox WHERE consumer = $1 AND key = $2 AND message = '')
ON CONFLICT (consumer, key, message) DO NOTHING
RETURNING message, lease_attempts, step, step_state, lease_until`

	// The same on a partitioned inbox, sent as one pipeline after sqlClaimLock (the
	// key's advisory lock) in one implicit transaction.
	sqlInboxLeaseInsertPartitioned = `
INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, lease_until, lease_owner, lease_attempts, expires_at)
SELECT $1, $2, $3, $4, 'leased', now() + $5::interval, $6, 1, now() + $7::interval
WHERE NOT EXISTS (SELECT 1 FROM idem_inbox WHERE consumer = $1 AND key = $2 AND message IN ($3, ''))
RETURNING message, lease_attempts, step, step_state, lease_until`

	// What stood in the way of an acquisition, judged by the database's clock: the
	// delivery's own row, else one written before v5 for every message of the key.
	sqlInboxLeaseInspect = `
SELECT message, status, fingerprint, result, lease_until, now()
FROM idem_inbox WHERE consumer = $1 AND key = $2 AND message IN ($3, '')
ORDER BY message DESC LIMIT 1`

	// Taking an expired lease over. Under READ COMMITTED an UPDATE re-evaluates
	// its WHERE on the row's latest version once it holds the row's lock, so of
	// two workers racing for one expired lease the second sees the first's fresh
	// lease_until and takes nothing. The recovery point (step, step_state) is left
	// as the previous holder left it.
	sqlInboxLeaseTakeOver = `
UPDATE idem_inbox AS i
SET lease_until = now() + $5::interval, lease_owner = $6, lease_attempts = i.lease_attempts + 1
WHERE consumer = $1 AND key = $2 AND message = $3 AND status = 'leased'
  AND (lease_until IS NULL OR lease_until <= now())
  AND fingerprint = $4
RETURNING message, lease_attempts, step, step_state, lease_until`

	// The holder-only statements: each matches the row only while lease_owner is
	// still this acquisition's token and the effect is not yet done.
	sqlInboxLeaseExtend = `
UPDATE idem_inbox SET lease_until = now() + $5::interval
WHERE consumer = $1 AND key = $2 AND message = $3 AND lease_owner = $4 AND status = 'leased'
RETURNING lease_until`

	sqlInboxLeaseStep = `
UPDATE idem_inbox SET step = $5, step_state = $6
WHERE consumer = $1 AND key = $2 AND message = $3 AND lease_owner = $4 AND status = 'leased'`

	// Completion does not look at lease_until: an effect that was performed is
	// recorded whenever the token still holds, even when the lease ran out while
	// the database stalled, as long as nobody took it over.
	sqlInboxLeaseComplete = `
UPDATE idem_inbox
SET status = 'done', result = $5, completed_at = now(), lease_until = NULL, lease_owner = NULL
WHERE consumer = $1 AND key = $2 AND message = $3 AND lease_owner = $4 AND status = 'leased'`

	// Release ends the lease now (the take-over's "<= now()" then holds at once)
	// and keeps the recovery point, so the retry resumes where this attempt stopped.
	sqlInboxLeaseRelease = `
UPDATE idem_inbox SET lease_until = now(), lease_owner = NULL
WHERE consumer = $1 AND key = $2 AND message = $3 AND lease_owner = $4 AND status = 'leased'`

	// Which (consumer, row) pairs are settled: an inbox row of the delivery that is
	// done and not yet expired (a row written before schema v5, message '', settles
	// every message of its key), or a dead letter of the delivery filed since the
	// row was written. A lease (an external effect under way) is not a settlement
	// yet; an expired inbox row is none any more (the consumer may forget it at any
	// moment); a dead letter older than the row is the one a replay row replays,
	// and proves nothing about the replay.
	//
	// $1 consumers, $2 keys, $3 messages, $4 the rows' creation times, $5 row ids;
	// $6 and $7 are the negative controls (faults.RedriveToAll: an expired row
	// proves; faults.OldDeadLettersProve: any dead letter of the key proves).
	sqlInboxSettled = `
SELECT t.c, t.i
FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::bigint[]) AS t(c, k, m, w, i)
WHERE EXISTS (SELECT 1 FROM idem_inbox n WHERE n.consumer = t.c AND n.key = t.k AND n.message IN (t.m, '')
                AND n.status = 'done' AND (n.expires_at > now() OR $6))
   OR EXISTS (SELECT 1 FROM idem_dead_letters d WHERE d.consumer = t.c AND d.key = t.k
                AND ((COALESCE(d.message, d.subject) = t.m AND d.created_at >= t.w) OR $7))`

	// The inbox's primary key is (consumer, key, message): a look-up by key alone
	// would scan the table. There are few consumers, so walk them with a "loose
	// index scan" (each step finds the next consumer name with one probe of the
	// primary key) and probe (consumer, key) for each: a handful of index probes,
	// whatever the size of the inbox. One key has a row per message a consumer
	// read; LIMIT keeps each probe from being flattened into a join.
	sqlInboxInspect = `
WITH RECURSIVE consumers(name) AS (
    (SELECT consumer FROM idem_inbox ORDER BY consumer LIMIT 1)
    UNION ALL
    SELECT (SELECT consumer FROM idem_inbox WHERE consumer > c.name ORDER BY consumer LIMIT 1)
    FROM consumers c
    WHERE c.name IS NOT NULL
)
SELECT i.consumer, i.message, i.status, i.result, encode(i.fingerprint, 'hex'), i.lease_until, i.lease_attempts,
       i.step, i.created_at, i.completed_at, i.expires_at
FROM consumers c
CROSS JOIN LATERAL (
    SELECT * FROM idem_inbox WHERE consumer = c.name AND key = $1 ORDER BY message LIMIT 1000
) AS i
ORDER BY i.consumer, i.message`

	sqlInboxStats = `
SELECT consumer, status, count(*),
       count(*) FILTER (WHERE expires_at < now()),
       count(*) FILTER (WHERE status = 'leased' AND lease_until < now())
FROM idem_inbox
GROUP BY consumer, status
ORDER BY consumer, status`

	// Collect deletes expired rows, one bounded batch ($1 rows) per statement.
	// SKIP LOCKED: a row some transaction is using right now is left for the next
	// round. It reads and deletes its ctids in ONLY the table: a ctid names a row
	// within one relation, and through a partitioned parent the same ctid is a row
	// in each partition. Run against a table that was converted after the round
	// looked at its layout (partition.Convert), it finds no row in the parent
	// itself and deletes nothing; the next round collects the default partition.
	sqlInboxCollect = `
DELETE FROM ONLY idem_inbox WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM ONLY idem_inbox WHERE expires_at < now() LIMIT $1 FOR UPDATE SKIP LOCKED))`
)

// Inbox is the SQL of idem_inbox, qualified for one schema.
type Inbox struct {
	Settle, ClaimLock, SettlePartitioned, Lookup, LeaseInsert, LeaseInsertPartitioned, LeaseInspect, LeaseTakeOver, LeaseExtend, LeaseStep, LeaseComplete, LeaseRelease, Settled, Inspect, Stats, Collect string
}

func newInbox(q func(string) string) Inbox {
	return Inbox{
		Settle:                 q(sqlInboxSettle),
		ClaimLock:              q(sqlInboxClaimLock),
		SettlePartitioned:      q(sqlInboxSettlePartitioned),
		Lookup:                 q(sqlInboxLookup),
		LeaseInsert:            q(sqlInboxLeaseInsert),
		LeaseInsertPartitioned: q(sqlInboxLeaseInsertPartitioned),
		LeaseInspect:           q(sqlInboxLeaseInspect),
		LeaseTakeOver:          q(sqlInboxLeaseTakeOver),
		LeaseExtend:            q(sqlInboxLeaseExtend),
		LeaseStep:              q(sqlInboxLeaseStep),
		LeaseComplete:          q(sqlInboxLeaseComplete),
		LeaseRelease:           q(sqlInboxLeaseRelease),
		Settled:                q(sqlInboxSettled),
		Inspect:                q(sqlInboxInspect),
		Stats:                  q(sqlInboxStats),
		Collect:                q(sqlInboxCollect),
	}
}
