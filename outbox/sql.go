package outbox

import "github.com/idemkit/idem/internal/pgschema"

// notifyChannel is the LISTEN/NOTIFY channel that wakes the relays of a schema.
func notifyChannel(schema string) string { return pgschema.Channel(schema, "idem_outbox") }

// All of the outbox's SQL, in one place. It names idem_outbox plainly; newQueries
// qualifies it for the configured schema once.
const (
	// sqlBeginRelay opens a relay batch's transaction. The relay reads and updates
	// only rows it has locked, by primary key, a few hundred at a time; a sequential
	// scan or a hash join over the outbox is never the right plan for that. The
	// planner picks one anyway: a generic plan made while the table was small (pgx
	// prepares every statement, and Postgres keeps a connection's generic plan until
	// the table is next analyzed) goes on scanning it as it grows, and the cost
	// model, which prices each index probe as a random read, prefers a hash join to
	// 250 probes once the table holds some 20,000 rows. Both were measured, in
	// BENCHMARKS.md. Turning those plans off for the relay's own transaction keeps
	// every statement on an index, whatever the statistics say; and since that
	// plan is right for any batch, the generic plan is forced too, so a small batch
	// is not planned afresh each time (some 70 µs per statement). All in the same
	// round trip as BEGIN.
	sqlBeginRelay = `BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_hashjoin = off; ` +
		`SET LOCAL enable_mergejoin = off; SET LOCAL plan_cache_mode = force_generic_plan`

	// sqlEnqueue inserts any number of messages in one statement, one array per
	// column. sqlEnqueueOne is the same for the commonest case, one message per
	// transaction (one intent per request): there a plain VALUES row cost Postgres
	// 80–185 µs less per transaction than unnest over one-element arrays
	// (BENCHMARKS.md, "The ingress's SQL alone").
	sqlEnqueue = `
INSERT INTO idem_outbox (key, subject, msg_id, headers, payload, message_name)
SELECT k, s, m, h::jsonb, p, NULLIF(n, '')
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::text[]) AS t(k, s, m, h, p, n)`
	sqlEnqueueOne = `
INSERT INTO idem_outbox (key, subject, msg_id, headers, payload, message_name)
VALUES ($1, $2, $3, $4::text::jsonb, $5::bytea, NULLIF($6::text, ''))`
	sqlNotify = `SELECT pg_notify($1, '')`

	// Claim a batch of pending rows whose backoff has passed, with their sizes (what
	// NATS will count: payload, headers, key and Msg-Id). SKIP LOCKED lets several
	// relays drain one outbox without waiting on each other; the row locks are the
	// claim and last until the batch is settled (or the relay dies and Postgres
	// releases them).
	sqlClaim = `
SELECT id, octet_length(payload) + octet_length(headers::text) + octet_length(key) + octet_length(msg_id)
FROM idem_outbox
WHERE published_at IS NULL AND dead_lettered_at IS NULL
  AND (next_attempt_at IS NULL OR next_attempt_at <= now())
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED`

	// Load the claimed rows that fit in the batch's byte budget.
	sqlLoad = `
SELECT id, key, subject, msg_id, headers, payload, attempts, created_at, COALESCE(message_name, '')
FROM idem_outbox
WHERE id = ANY($1::bigint[])
ORDER BY id`

	// Published: where the stream put it (the PubAck), and an expiry unless the
	// reconciler is to prove it first (a zero retention).
	sqlMarkPublished = `
UPDATE idem_outbox
SET published_at = now(), attempts = attempts + 1, last_error = NULL, next_attempt_at = NULL,
    stream = t.s, stream_seq = t.q,
    expires_at = CASE WHEN $4::interval > '0'::interval THEN now() + $4::interval END
FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS t(i, s, q)
WHERE id = t.i`

	// The relay drains in id order, so the lowest pending id is the row that has
	// waited longest; the partial index idem_outbox_pending finds it at once.
	sqlBacklog = `
SELECT (SELECT count(*) FROM idem_outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL),
       o.created_at,
       COALESCE(EXTRACT(EPOCH FROM now() - o.created_at), 0)::float8
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
  SELECT created_at FROM idem_outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL ORDER BY id LIMIT 1
) AS o ON true`

	// A failed publish is charged to the row, which steps aside until its backoff
	// has passed.
	sqlMarkFailed = `
UPDATE idem_outbox
SET attempts = attempts + 1, last_error = t.e, next_attempt_at = now() + t.w
FROM unnest($1::bigint[], $2::text[], $3::interval[]) AS t(i, e, w)
WHERE id = t.i`

	// A row that can never be published leaves the queue for the dead letters, with
	// the broker's reason, in the relay's transaction: never retried forever, never
	// dropped. The outbox row is kept for its retention, as evidence. $5 are the
	// replay horizons, after each row's creation (Relay.replayHorizons; NULL: none).
	sqlDeadLetter = `
WITH d AS (
  UPDATE idem_outbox
  SET attempts = attempts + 1, last_error = t.e, dead_lettered_at = now(), expires_at = now() + $3::interval
  FROM unnest($1::bigint[], $2::text[], $5::interval[]) AS t(i, e, h)
  WHERE id = t.i
  RETURNING key, subject, message_name, headers, payload, attempts, last_error, created_at, t.h
)
INSERT INTO idem_dead_letters (consumer, key, subject, message, headers, payload, reason, deliveries, fingerprint, inbox_expires_at)
SELECT $4, key, subject, subject || COALESCE(' ' || message_name, ''), headers, payload, 'relay: ' || last_error, attempts, sha256(payload),
       created_at + h
FROM d`

	// The registered consumers of a stream ($1; empty: of any), for the replay
	// horizon of a dead row that may have been stored.
	sqlReaders = `
SELECT filter_subject, EXTRACT(EPOCH FROM key_lifetime)::float8
FROM idem_consumers
WHERE $1 = '' OR stream = $1`
)

// Ordering by key (RelayConfig.OrderedSubjects; ordering.go, docs/ORDERING.md).
const (
	// The unordered claim of a relay that also relays ordered subjects: sqlClaim,
	// leaving the ordered subjects ($2, anchored regular expressions) to
	// sqlLockOrdered and sqlClaimOrdered.
	sqlClaimUnordered = `
SELECT id, octet_length(payload) + octet_length(headers::text) + octet_length(key) + octet_length(msg_id)
FROM idem_outbox
WHERE published_at IS NULL AND dead_lettered_at IS NULL
  AND (next_attempt_at IS NULL OR next_attempt_at <= now())
  AND NOT (subject ~ ANY($2::text[]))
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED`

	// Lock the ordered subjects this relay may publish now: those whose oldest
	// pending row ("head") is due, oldest head first, each under a
	// transaction-scoped advisory lock ($3, hashtext($4 || subject)) that no
	// other relay holds. Row locks with SKIP LOCKED cannot do this: two relays
	// claiming the same subject's rows at once would each skip the other's and
	// take the rows behind them. The CTEs are materialised so that a lock is
	// tried only for the subjects returned, never for one the LIMIT drops. A
	// subject whose head is in its backoff is not returned: it is blocked. The
	// scan reads every pending row of the ordered subjects (idem_outbox_pending),
	// which is the backlog, not the table.
	sqlLockOrdered = `
WITH heads AS MATERIALIZED (
  SELECT DISTINCT ON (subject) subject, id, next_attempt_at
  FROM idem_outbox
  WHERE published_at IS NULL AND dead_lettered_at IS NULL AND subject ~ ANY($1::text[])
  ORDER BY subject, id
), due AS MATERIALIZED (
  SELECT subject, id FROM heads
  WHERE next_attempt_at IS NULL OR next_attempt_at <= now()
  ORDER BY id
  LIMIT $2
)
SELECT subject FROM due
WHERE pg_try_advisory_xact_lock($3::int, hashtext($4::text || subject))
ORDER BY id`

	// Claim the oldest pending rows of the subjects locked above ($1), in id order,
	// with their sizes. A subject's rows stop before its first row still in its
	// backoff (held), so a later row never overtakes an earlier one that has
	// neither been published nor dead-lettered. Run after the advisory locks were
	// taken, its snapshot holds whatever the previous holder committed.
	sqlClaimOrdered = `
SELECT id, octet_length(payload) + octet_length(headers::text) + octet_length(key) + octet_length(msg_id)
FROM idem_outbox
WHERE id IN (
  SELECT id FROM (
    SELECT id, bool_or(next_attempt_at > now()) OVER (PARTITION BY subject ORDER BY id) AS held
    FROM idem_outbox
    WHERE published_at IS NULL AND dead_lettered_at IS NULL AND subject = ANY($1::text[])
  ) AS p
  WHERE NOT COALESCE(held, false)
  ORDER BY id
  LIMIT $2
)
ORDER BY id
FOR UPDATE`
)

// queries is the SQL of one schema.
type queries struct {
	enqueue, enqueueOne, claim, load, markPublished, markFailed, deadLetter, backlog, readers string
	claimUnordered, lockOrdered, claimOrdered                                                 string
}

func newQueries(schema string) queries {
	q := func(sql string) string { return pgschema.Qualify(schema, sql) }
	return queries{
		enqueue: q(sqlEnqueue), enqueueOne: q(sqlEnqueueOne), claim: q(sqlClaim), load: q(sqlLoad), markPublished: q(sqlMarkPublished),
		markFailed: q(sqlMarkFailed), deadLetter: q(sqlDeadLetter), backlog: q(sqlBacklog), readers: q(sqlReaders),
		claimUnordered: q(sqlClaimUnordered), lockOrdered: q(sqlLockOrdered), claimOrdered: q(sqlClaimOrdered),
	}
}
