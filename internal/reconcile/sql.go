package reconcile

import "github.com/idemkit/idem/internal/pgschema"

// All of the reconciler's SQL, in one place. newQueries qualifies it for the
// configured schema once.
const (
	// The unproven rows of one stream, a batch at a time in id order, with their
	// ages by the database's clock. SKIP LOCKED: several reconcilers share the work
	// and never judge one row twice at once. The partial index idem_outbox_unproven
	// holds exactly these rows.
	//
	// $1 stream, $2 the last id of the previous batch, $3 ReconcileAfter, $4 batch size.
	sqlUnproven = `
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
	sqlSettled = `
SELECT t.c, t.i
FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::bigint[]) AS t(c, k, m, w, i)
WHERE EXISTS (SELECT 1 FROM idem_inbox n WHERE n.consumer = t.c AND n.key = t.k AND n.message IN (t.m, '')
                AND n.status = 'done' AND (n.expires_at > now() OR $6))
   OR EXISTS (SELECT 1 FROM idem_dead_letters d WHERE d.consumer = t.c AND d.key = t.k
                AND ((COALESCE(d.message, d.subject) = t.m AND d.created_at >= t.w) OR $7))`

	// Complete: every consumer that should see the row has settled it. From now on
	// the row is evidence only, kept for the retention.
	sqlComplete = `
UPDATE idem_outbox
SET completed_at = now(), expires_at = now() + $2::interval
WHERE id = ANY($1::bigint[])`

	// Lag and unrouted are verdicts, not actions: the row waits, and is looked at in
	// the stream again one ReconcileAfter later.
	sqlVerdict = `
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
	sqlRedrive = `
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
SET published_at = NULL, stream = NULL, stream_seq = NULL, next_attempt_at = NULL,
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

	sqlNotify = `SELECT pg_notify($1, '')`

	// Past every horizon: the row is given up on, and each consumer that never
	// settled it gets a dead letter saying so, where operators already look. The
	// dead letter's replay horizon is the one that ran out (now, at the latest), so
	// a replay needs --force, knowingly. A row no registered consumer reads gets a
	// zero horizon, passed at once: it was published, and a consumer outside the
	// registry may have run it and forgotten its key. $1/$2 pair rows with
	// consumers, $3 the reasons, $4 the horizons (as intervals after the row's
	// creation), $5 retention.
	sqlAlert = `
WITH t AS (
  SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::interval[]) AS t(i, c, r, h)
), a AS (
  UPDATE idem_outbox o
  SET alerted_at = now(), reconciled = 'alert', expires_at = now() + $5::interval
  WHERE o.id IN (SELECT i FROM t)
  RETURNING o.id, o.key, o.subject, o.message_name, o.headers, o.payload, o.attempts, o.created_at
)
INSERT INTO idem_dead_letters (consumer, key, subject, message, headers, payload, reason, deliveries, fingerprint, inbox_expires_at)
SELECT t.c, a.key, a.subject, a.subject || COALESCE(' ' || a.message_name, ''), a.headers, a.payload, t.r, 0, sha256(a.payload),
       LEAST(now(), a.created_at + t.h)
FROM a JOIN t ON t.i = a.id`

	// The registry of consumers, as they registered at start.
	sqlRegistered = `
SELECT name, stream, filter_subject, EXTRACT(EPOCH FROM key_lifetime)::float8, EXTRACT(EPOCH FROM redelivery)::float8,
       registered_at, last_seen_at, starts_at
FROM idem_consumers
ORDER BY name`
	sqlForget = `DELETE FROM idem_consumers WHERE name = $1`
	// A new entry starts now ($6) or backfills (NULL); an existing one keeps its
	// start. xmax is 0 on a row this statement inserted.
	sqlRegister = `
INSERT INTO idem_consumers (name, stream, filter_subject, key_lifetime, redelivery, starts_at)
VALUES ($1, $2, $3, $4, $5, CASE WHEN $6::boolean THEN now() END)
ON CONFLICT (name) DO UPDATE
SET stream = EXCLUDED.stream, filter_subject = EXCLUDED.filter_subject,
    key_lifetime = EXCLUDED.key_lifetime, redelivery = EXCLUDED.redelivery, last_seen_at = now()
RETURNING xmax = 0, registered_at, last_seen_at, starts_at`
	// Other consumers of the same stream and filter, silent for $4.
	sqlVanished = `
SELECT name FROM idem_consumers
WHERE stream = $1 AND filter_subject = $2 AND name <> $3 AND last_seen_at < now() - $4::interval
ORDER BY name`

	// A rename, in one transaction: the registry entry (locked first), then every
	// row that names the consumer.
	sqlRenameLock        = `SELECT EXTRACT(EPOCH FROM now() - last_seen_at)::float8 FROM idem_consumers WHERE name = $1 FOR UPDATE`
	sqlRenameConsumer    = `UPDATE idem_consumers SET name = $2 WHERE name = $1`
	sqlRenameInbox       = `UPDATE idem_inbox SET consumer = $2 WHERE consumer = $1`
	sqlRenameAttempts    = `UPDATE idem_attempts SET consumer = $2 WHERE consumer = $1`
	sqlRenameDeadLetters = `UPDATE idem_dead_letters SET consumer = $2 WHERE consumer = $1`
	sqlSeen              = `UPDATE idem_consumers SET last_seen_at = now() WHERE name = $1`

	// The reconciler's queue at one moment. Each count reads a partial index, so a
	// scrape stays cheap however many completed rows the outbox keeps.
	sqlStatus = `
SELECT (SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL AND completed_at IS NULL AND alerted_at IS NULL),
       COALESCE((SELECT EXTRACT(EPOCH FROM now() - created_at)::float8 FROM idem_outbox
         WHERE published_at IS NOT NULL AND completed_at IS NULL AND alerted_at IS NULL ORDER BY id LIMIT 1), 0),
       (SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL AND completed_at IS NULL AND alerted_at IS NULL AND reconciled = 'lag'),
       (SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL AND completed_at IS NULL AND alerted_at IS NULL AND reconciled = 'unrouted'),
       (SELECT count(*) FROM idem_outbox WHERE generation > 0),
       (SELECT count(*) FROM idem_outbox WHERE alerted_at IS NOT NULL)`
)

// queries is the SQL of one schema.
type queries struct {
	unproven, settled, complete, verdict, redrive, alert, registered, forget, status string
}

func newQueries(schema string) queries {
	q := func(sql string) string { return pgschema.Qualify(schema, sql) }
	return queries{
		unproven: q(sqlUnproven), settled: q(sqlSettled), complete: q(sqlComplete), verdict: q(sqlVerdict),
		redrive: q(sqlRedrive), alert: q(sqlAlert), registered: q(sqlRegistered), forget: q(sqlForget),
		status: q(sqlStatus),
	}
}
