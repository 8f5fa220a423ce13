package store

// idem_outbox: the transactional outbox: written in the producer's transaction,
// published by the relay, proven by the reconciler.

const (
	// sqlEnqueue inserts any number of messages in one statement, one array per
	// column. sqlEnqueueOne is the same for the commonest case, one message per
	// transaction (one intent per request): there a plain VALUES row costs Postgres
	// less than unnest over one-element arrays (BENCHMARKS.md, "The ingress's SQL
	// alone").
	sqlOutboxEnqueue = `
INSERT INTO idem_outbox (key, subject, msg_id, headers, payload, message_name)
SELECT k, s, m, h::jsonb, p, NULLIF(n, '')
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::text[]) AS t(k, s, m, h, p, n)`

	sqlOutboxEnqueueOne = `
INSERT INTO idem_outbox (key, subject, msg_id, headers, payload, message_name)
VALUES ($1, $2, $3, $4::text::jsonb, $5::bytea, NULLIF($6::text, ''))`

	// Claim a batch of pending rows whose backoff has passed, with their sizes (what
	// NATS will count: payload, headers, key and Msg-Id). SKIP LOCKED lets several
	// relays drain one outbox without waiting on each other; the row locks are the
	// claim and last until the batch is settled (or the relay dies and Postgres
	// releases them).
	sqlOutboxClaim = `
SELECT id, octet_length(payload) + octet_length(headers::text) + octet_length(key) + octet_length(msg_id)
FROM idem_outbox
WHERE published_at IS NULL AND dead_lettered_at IS NULL AND relay IS NULL
  AND (next_attempt_at IS NULL OR next_attempt_at <= now())
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED`

	// Load the claimed rows that fit in the batch's byte budget.
	sqlOutboxLoad = `
SELECT id, key, subject, msg_id, headers, payload, attempts, created_at, COALESCE(message_name, '')
FROM idem_outbox
WHERE id = ANY($1::bigint[])
ORDER BY id`

	// Published: where the stream put it (the PubAck), and an expiry unless the
	// reconciler is to prove it first (a zero retention).
	sqlOutboxMarkPublished = `
UPDATE idem_outbox
SET published_at = now(), attempts = attempts + 1, last_error = NULL, next_attempt_at = NULL,
    stream = t.s, stream_seq = t.q,
    expires_at = CASE WHEN $4::interval > '0'::interval THEN now() + $4::interval END
FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS t(i, s, q)
WHERE id = t.i`

	// The relay drains in id order, so the lowest pending id is the row that has
	// waited longest; the partial index idem_outbox_pending finds it at once.
	sqlOutboxBacklog = `
SELECT (SELECT count(*) FROM idem_outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL AND relay IS NULL),
       o.created_at,
       COALESCE(EXTRACT(EPOCH FROM now() - o.created_at), 0)::float8
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
  SELECT created_at FROM idem_outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL AND relay IS NULL ORDER BY id LIMIT 1
) AS o ON true`

	// A failed publish is charged to the row, which steps aside until its backoff
	// has passed.
	sqlOutboxMarkFailed = `
UPDATE idem_outbox
SET attempts = attempts + 1, last_error = t.e, next_attempt_at = now() + t.w
FROM unnest($1::bigint[], $2::text[], $3::interval[]) AS t(i, e, w)
WHERE id = t.i`

	// The unordered claim of a relay that also relays ordered subjects: sqlClaim,
	// leaving the ordered subjects ($2, anchored regular expressions) to
	// sqlLockOrdered and sqlClaimOrdered.
	sqlOutboxClaimUnordered = `
SELECT id, octet_length(payload) + octet_length(headers::text) + octet_length(key) + octet_length(msg_id)
FROM idem_outbox
WHERE published_at IS NULL AND dead_lettered_at IS NULL AND relay IS NULL
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
	sqlOutboxLockOrdered = `
WITH heads AS MATERIALIZED (
  SELECT DISTINCT ON (subject) subject, id, next_attempt_at
  FROM idem_outbox
  WHERE published_at IS NULL AND dead_lettered_at IS NULL AND relay IS NULL AND subject ~ ANY($1::text[])
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
	sqlOutboxClaimOrdered = `
SELECT id, octet_length(payload) + octet_length(headers::text) + octet_length(key) + octet_length(msg_id)
FROM idem_outbox
WHERE id IN (
  SELECT id FROM (
    SELECT id, bool_or(next_attempt_at > now()) OVER (PARTITION BY subject ORDER BY id) AS held
    FROM idem_outbox
    WHERE published_at IS NULL AND dead_lettered_at IS NULL AND relay IS NULL AND subject = ANY($1::text[])
  ) AS p
  WHERE NOT COALESCE(held, false)
  ORDER BY id
  LIMIT $2
)
ORDER BY id
FOR UPDATE`

	// The unproven rows of one stream, a batch at a time in id order, with their
	// ages by the database's clock. SKIP LOCKED: several reconcilers share the work
	// and never judge one row twice at once. The partial index idem_outbox_unproven
	// holds exactly these rows.
	//
	// $1 stream, $2 the last id of the previous batch, $3 ReconcileAfter, $4 batch size.
	sqlOutboxUnproven = `
SELECT id, key, subject, subject || COALESCE(' ' || message_name, ''), msg_id,
       COALESCE(headers->>'Idem-Replay-For', ''), stream_seq, generation, created_at,
       EXTRACT(EPOCH FROM now() - created_at)::float8,
       published_at <= now() - $3::interval,
       checked_at IS NULL OR checked_at <= now() - $3::interval
FROM idem_outbox
WHERE published_at IS NOT NULL AND completed_at IS NULL AND alerted_at IS NULL
  AND stream = $1 AND id > $2
ORDER BY id
LIMIT $4
FOR UPDATE SKIP LOCKED`

	// Complete: every consumer that should see the row has settled it. From now on
	// the row is evidence only, kept for the retention.
	sqlOutboxComplete = `
UPDATE idem_outbox
SET completed_at = now(), expires_at = now() + $2::interval
WHERE id = ANY($1::bigint[])`

	// Lag and unrouted are verdicts, not actions: the row waits, and is looked at in
	// the stream again one ReconcileAfter later.
	sqlOutboxVerdict = `
UPDATE idem_outbox
SET reconciled = $2, checked_at = now()
WHERE id = ANY($1::bigint[])`

	// Re-drive: the row goes back to the relay's queue under a new Msg-Id
	// generation, so the broker's duplicate window does not fold it into the lost
	// original, addressed (Idem-Replay-For) to the consumers still missing it only:
	// one that settled it acks the copy without an effect, even after its inbox
	// forgot the key. The proof is checked again in the same statement, by the
	// same rules as sqlSettled: a consumer that settled the row while the stream
	// was being looked at gets no copy, and a row nobody misses any more is not
	// published. $1/$2 pair each row with a consumer it was missing. attempts
	// restarts at zero: the relay's failure budget (MaxAttempts) is per
	// generation, and the publishes of the lost one succeeded.
	//
	// The generation follows the byte 0x1D, which no key contains; a row re-driven
	// before schema v5 ended in " r<n>" instead, which is stripped once. $4 and $5
	// are the negative controls of sqlSettled's $6 and $7 ($4 also leaves the
	// copy unaddressed).
	sqlOutboxRedrive = `
WITH missing AS (
  SELECT t.i, string_agg(DISTINCT t.c, ',') AS cs
  FROM unnest($1::bigint[], $2::text[]) AS t(i, c)
  JOIN idem_outbox o ON o.id = t.i
  WHERE NOT EXISTS (SELECT 1 FROM idem_inbox n WHERE n.consumer = t.c AND n.key = o.key
                      AND n.message IN (o.subject || COALESCE(' ' || o.message_name, ''), '')
                      AND n.status = 'done' AND (n.expires_at > now() OR $4))
    AND NOT EXISTS (SELECT 1 FROM idem_dead_letters d WHERE d.consumer = t.c AND d.key = o.key
                      AND ((COALESCE(d.message, d.subject) = o.subject || COALESCE(' ' || o.message_name, '')
                            AND d.created_at >= o.created_at) OR $5))
  GROUP BY t.i
)
UPDATE idem_outbox o
SET published_at = NULL, stream = NULL, stream_seq = NULL, next_attempt_at = NULL, relay = NULL,
    generation = o.generation + 1, attempts = 0,
    msg_id = CASE WHEN o.generation > 0 AND position(chr(29) IN o.msg_id) = 0
                  THEN regexp_replace(o.msg_id, ' r[0-9]+$', '')
                  ELSE regexp_replace(o.msg_id, chr(29) || 'r[0-9]+$', '')
             END || chr(29) || 'r' || (o.generation + 1),
    headers = CASE WHEN $4 THEN o.headers ELSE o.headers || jsonb_build_object('Idem-Replay-For', missing.cs) END,
    reconciled = 'redriven', checked_at = now(), last_error = $3
FROM missing
WHERE o.id = missing.i
RETURNING o.id`

	// The reconciler's queue at one moment: the polling relay's published rows
	// not yet proven, and the log relay's rows in windows not yet proven. Each
	// reads a partial index (the windows' queue, then their rows by id), so a
	// scrape stays cheap however many completed rows the outbox keeps.
	sqlOutboxStatus = `
WITH u AS (
  SELECT created_at, reconciled FROM idem_outbox
  WHERE published_at IS NOT NULL AND completed_at IS NULL AND alerted_at IS NULL
  UNION ALL
  SELECT o.created_at, o.reconciled FROM idem_outbox o
  WHERE o.id IN (SELECT unnest(ids) FROM idem_outbox_published WHERE proven_at IS NULL)
    AND o.relay = 'log' AND o.completed_at IS NULL AND o.alerted_at IS NULL AND o.dead_lettered_at IS NULL
)
SELECT (SELECT count(*) FROM u),
       COALESCE((SELECT EXTRACT(EPOCH FROM now() - min(created_at))::float8 FROM u), 0),
       (SELECT count(*) FROM u WHERE reconciled = 'lag'),
       (SELECT count(*) FROM u WHERE reconciled = 'unrouted'),
       (SELECT count(*) FROM idem_outbox WHERE generation > 0),
       (SELECT count(*) FROM idem_outbox WHERE alerted_at IS NOT NULL)`

	sqlOutboxInspect = `
SELECT id, subject, subject || COALESCE(' ' || message_name, ''), msg_id, headers, payload, created_at, published_at, attempts, last_error, expires_at,
       stream, stream_seq, generation, completed_at, alerted_at, dead_lettered_at
FROM idem_outbox
WHERE key = $1
ORDER BY id`

	// Collect deletes expired rows, one bounded batch ($1 rows) per statement.
	// SKIP LOCKED: a row some transaction is using right now is left for the next
	// round. It reads and deletes its ctids in ONLY the table: a ctid names a row
	// within one relation, and through a partitioned parent the same ctid is a row
	// in each partition. Run against a table that was converted after the round
	// looked at its layout (partition.Convert), it finds no row in the parent
	// itself and deletes nothing; the next round collects the default partition.
	//
	// Published rows, rows the relay dead-lettered (their dead letter holds the
	// message) and the log relay's rows, once their retention has passed; never a
	// pending row (a log relay's row has an expiry only once it is proven). With a
	// reconciler a published row has no expiry until the reconciler proves it
	// complete (or gives up on it, past every horizon): never deleted by age alone.
	sqlOutboxCollect = `
DELETE FROM ONLY idem_outbox WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM ONLY idem_outbox
  WHERE (published_at IS NOT NULL OR dead_lettered_at IS NOT NULL OR relay = 'log') AND expires_at < now()
  LIMIT $1 FOR UPDATE SKIP LOCKED))`

	// The log relay hands rows over to the polling relay: a publish it could not
	// complete with the broker up (a refusal, a lost PubAck) is charged to the row,
	// which then takes the polling relay's path (backoff, MaxAttempts, dead letter).
	sqlOutboxHandOver = `
UPDATE idem_outbox
SET relay = NULL, attempts = attempts + 1, last_error = t.e, next_attempt_at = now() + t.w
FROM unnest($1::bigint[], $2::text[], $3::interval[]) AS t(i, e, w)
WHERE id = t.i AND relay = 'log'`

	// After a slot was lost (or dropped), the log relay's rows written before its
	// new slot ($2) that no window holds were never published: they go to the
	// polling relay, uncharged. Rows proven, given up on or dead-lettered are left.
	// $1 the reason.
	sqlOutboxHandOverUnpublished = `
UPDATE idem_outbox o
SET relay = NULL, last_error = $1
WHERE o.relay = 'log' AND o.created_at < $2::timestamptz
  AND o.completed_at IS NULL AND o.alerted_at IS NULL AND o.dead_lettered_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM idem_outbox_published w WHERE w.id_range @> o.id AND o.id = ANY(w.ids))`

	// Which relay new rows belong to: the default of the relay column ('log' or
	// none). ALTER TABLE waits for every transaction writing the outbox, so a row
	// is either written before the change or after it.
	sqlOutboxRelayDefault = `
SELECT COALESCE(pg_get_expr(d.adbin, d.adrelid), '')
FROM pg_attribute a
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE a.attrelid = 'idem_outbox'::regclass AND a.attname = 'relay'`
	sqlOutboxRelayToLog  = `ALTER TABLE idem_outbox ALTER COLUMN relay SET DEFAULT 'log'`
	sqlOutboxRelayToPoll = `ALTER TABLE idem_outbox ALTER COLUMN relay DROP DEFAULT`

	// Counts: rows not yet published that failed a publish, and rows published.
	sqlOutboxCounts = `
SELECT (SELECT count(*) FROM idem_outbox WHERE published_at IS NULL AND attempts > 0),
       (SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL)`
)

// Outbox is the SQL of idem_outbox, qualified for one schema.
// EnqueuedAtLayout formats a row's created_at in idem.HeaderEnqueuedAt: UTC,
// microseconds (Postgres's precision), fixed width, so the outbox's size check
// counts it exactly.
const EnqueuedAtLayout = "2006-01-02T15:04:05.000000Z07:00"

type Outbox struct {
	// Channel is the LISTEN/NOTIFY channel that wakes the schema's relays; Notify
	// sends on it ($1: the channel).
	Channel                                                                                                                                                                                 string
	Notify                                                                                                                                                                                  string
	Enqueue, EnqueueOne, Claim, Load, MarkPublished, Backlog, MarkFailed, ClaimUnordered, LockOrdered, ClaimOrdered, Unproven, Complete, Verdict, Redrive, Status, Inspect, Collect, Counts string
	// The log relay's: its hand-overs to the polling relay, and which relay new rows belong to.
	HandOver, HandOverUnpublished, RelayDefault, RelayToLog, RelayToPoll string
}

func newOutbox(q func(string) string, channel string) Outbox {
	return Outbox{
		Channel:        channel,
		Notify:         `SELECT pg_notify($1, '')`,
		Enqueue:        q(sqlOutboxEnqueue),
		EnqueueOne:     q(sqlOutboxEnqueueOne),
		Claim:          q(sqlOutboxClaim),
		Load:           q(sqlOutboxLoad),
		MarkPublished:  q(sqlOutboxMarkPublished),
		Backlog:        q(sqlOutboxBacklog),
		MarkFailed:     q(sqlOutboxMarkFailed),
		ClaimUnordered: q(sqlOutboxClaimUnordered),
		LockOrdered:    q(sqlOutboxLockOrdered),
		ClaimOrdered:   q(sqlOutboxClaimOrdered),
		Unproven:       q(sqlOutboxUnproven),
		Complete:       q(sqlOutboxComplete),
		Verdict:        q(sqlOutboxVerdict),
		Redrive:        q(sqlOutboxRedrive),
		Status:         q(sqlOutboxStatus),
		Inspect:        q(sqlOutboxInspect),
		Collect:        q(sqlOutboxCollect),
		Counts:         q(sqlOutboxCounts),

		HandOver:            q(sqlOutboxHandOver),
		HandOverUnpublished: q(sqlOutboxHandOverUnpublished),
		RelayDefault:        q(sqlOutboxRelayDefault),
		RelayToLog:          q(sqlOutboxRelayToLog),
		RelayToPoll:         q(sqlOutboxRelayToPoll),
	}
}
