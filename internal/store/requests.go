package store

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
)

// idem_requests: the HTTP ingress's records: (scope, key) -> the first response
// (package producer).

const (
	// sqlRequestsLock is the first statement of a request's transaction: it waits
	// for the key's transaction advisory lock (key1 the installation's lock space,
	// key2 $1, RequestLock), which a request holds from its claim to its commit or
	// rollback, so a concurrent duplicate waits here for the first arrival to end.
	// Its FROM subquery, evaluated before the lock is requested, sets lock_timeout
	// to $2, Wait, for the rest of the transaction (set_config with is_local true is
	// SET LOCAL); the handler's statements inherit it. The wait ends in SQLSTATE
	// 55P03 past it. Postgres drops the lock with the transaction, so a request
	// whose process or connection died leaves nothing to take over.
	sqlRequestsLock = `
SELECT pg_advisory_xact_lock(%d, $1)
FROM (SELECT set_config('lock_timeout', $2, true)) AS wait_lock_timeout`

	// sqlLookup reads the committed record of a key. It is a statement of its own,
	// after sqlRequestsLock: in READ COMMITTED a statement reads as of its start,
	// so only a statement that starts once the lock is held sees a record its
	// holder committed while this one waited. It returns the database's clock too,
	// for the ingress's guard against a jump of it (an expired record is forgotten
	// only when both clocks agree).
	sqlRequestsLookup = `
SELECT fingerprint, status, response_code, response_headers, response_body,
       expires_at <= now() AS expired, expires_at, now()
FROM idem_requests
WHERE scope = $1 AND key = $2`

	// sqlDeleteExpired removes a record that has outlived the key lifetime, so
	// the key can be executed afresh. The expiry test is repeated in the statement.
	sqlRequestsDeleteExpired = `
DELETE FROM idem_requests
WHERE scope = $1 AND key = $2 AND expires_at <= now()`

	// sqlRecord writes the key's record, once: the handler's response as its first
	// result, finished (status defaults to 'done'). It commits together with the
	// handler's business rows and outbox messages, and is sent in one round trip
	// with the handler's outbox INSERTs and COMMIT (Intent.Enqueue). The primary
	// key is the last guard: a record some other transaction committed meanwhile
	// (an ingress of an older release, which claims by an uncommitted row instead
	// of the lock) fails it with a unique violation, and the request rolls back and
	// replays that record.
	sqlRequestsRecord = `
INSERT INTO idem_requests (scope, key, fingerprint, method, path, response_code, response_headers, response_body, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now() + make_interval(secs => $9::float8))`

	// sqlRequestsInFlight finds the request holding the key's lock (sqlRequestsLock)
	// right now, for inspect: its backend, since when its transaction runs, and how
	// many duplicates wait behind it. pg_locks shows the lock's two keys as classid
	// and objid, objsubid 2. Two keys whose hashes meet (1 in 2^32) share a lock:
	// they wait for each other, and each shows the other in flight.
	sqlRequestsInFlight = `
SELECT l.pid, a.xact_start,
       (SELECT count(*) FROM pg_locks w
        WHERE w.locktype = 'advisory' AND w.database = l.database AND w.classid = l.classid
          AND w.objid = l.objid AND w.objsubid = 2 AND NOT w.granted)
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = %d::bigint::oid AND l.objid = $1::bigint::oid`

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

	// Counts: every record, and the requests running now: the key locks of this
	// installation's lock space held (sqlRequestsLock), plus any record an older
	// release left unfinished.
	sqlRequestsCounts = `
SELECT (SELECT count(*) FROM idem_requests),
       (SELECT count(*) FROM pg_locks
        WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid = %d::bigint::oid
          AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))
     + (SELECT count(*) FROM idem_requests WHERE status <> 'done')`
)

// Requests is the SQL of idem_requests, qualified for one schema.
type Requests struct {
	Lock, Lookup, DeleteExpired, Record, InFlight, Inspect, OtherScopes, Collect, Counts string
	// LockSpace is the installation's first advisory-lock key (RequestLock).
	LockSpace uint32
}

func newRequests(q func(string) string, schema string) Requests {
	space := lockSpace(schema)
	return Requests{
		Lock:          q(fmt.Sprintf(sqlRequestsLock, int32(space))),
		Lookup:        q(sqlRequestsLookup),
		DeleteExpired: q(sqlRequestsDeleteExpired),
		Record:        q(sqlRequestsRecord),
		InFlight:      q(fmt.Sprintf(sqlRequestsInFlight, space)),
		Inspect:       q(sqlRequestsInspect),
		OtherScopes:   q(sqlRequestsOtherScopes),
		Collect:       q(sqlRequestsCollect),
		Counts:        q(fmt.Sprintf(sqlRequestsCounts, space)),
		LockSpace:     space,
	}
}

// lockSpace is an installation's first advisory-lock key: a hash of its schema, so
// installations in one database (whose advisory locks are shared) lock apart, and
// apart from an application's own two-key locks unless a hash meets.
func lockSpace(schema string) uint32 {
	if schema == "" {
		schema = "public"
	}
	h := fnv.New32a()
	h.Write([]byte("idem_requests\x00" + schema))
	return h.Sum32()
}

// RequestLock is the second advisory-lock key of (scope, key): a hash of both,
// each prefixed by its length so that no two pairs encode alike. Passed to
// Requests.Lock as an int4 and matched in pg_locks.objid as an oid.
func RequestLock(scope, key string) uint32 {
	h := fnv.New32a()
	var n [4]byte
	for _, part := range []string{scope, key} {
		binary.BigEndian.PutUint32(n[:], uint32(len(part)))
		h.Write(n[:])
		h.Write([]byte(part))
	}
	return h.Sum32()
}
