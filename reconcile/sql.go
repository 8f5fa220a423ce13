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
SELECT id, key, subject, msg_id, COALESCE(headers->>'Idem-Replay-For', ''), stream_seq, generation,
       EXTRACT(EPOCH FROM now() - created_at)::float8,
       published_at <= now() - $3::interval,
       checked_at IS NULL OR checked_at <= now() - $3::interval
FROM idem_outbox
WHERE published_at IS NOT NULL AND completed_at IS NULL AND alerted_at IS NULL
  AND stream = $1 AND id > $2
ORDER BY id
LIMIT $4
FOR UPDATE SKIP LOCKED`

	// Which (consumer, key) pairs are settled: an inbox row that is done, or a dead
	// letter. A lease (an external effect under way) is not a settlement yet.
	sqlSettled = `
SELECT t.c, t.k
FROM unnest($1::text[], $2::text[]) AS t(c, k)
WHERE EXISTS (SELECT 1 FROM idem_inbox i WHERE i.consumer = t.c AND i.key = t.k AND i.status = 'done')
   OR EXISTS (SELECT 1 FROM idem_dead_letters d WHERE d.consumer = t.c AND d.key = t.k)`

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
	// original while every inbox still folds it by key. The proof is checked again
	// in the same statement: a consumer that settled the row while the stream was
	// being looked at must not cause a useless publish. $1/$2 pair each row with a
	// consumer it was missing. attempts restarts at zero: the relay's failure budget
	// (MaxAttempts) is per generation, and the publishes of the lost one succeeded.
	sqlRedrive = `
WITH missing AS (
  SELECT DISTINCT t.i
  FROM unnest($1::bigint[], $2::text[]) AS t(i, c)
  JOIN idem_outbox o ON o.id = t.i
  WHERE NOT EXISTS (SELECT 1 FROM idem_inbox i WHERE i.consumer = t.c AND i.key = o.key AND i.status = 'done')
    AND NOT EXISTS (SELECT 1 FROM idem_dead_letters d WHERE d.consumer = t.c AND d.key = o.key)
)
UPDATE idem_outbox o
SET published_at = NULL, stream = NULL, stream_seq = NULL, next_attempt_at = NULL,
    generation = o.generation + 1, attempts = 0,
    msg_id = regexp_replace(o.msg_id, ' r[0-9]+$', '') || ' r' || (o.generation + 1),
    reconciled = 'redriven', checked_at = now(), last_error = $3
FROM missing
WHERE o.id = missing.i
RETURNING o.id`
	sqlNotify = `SELECT pg_notify($1, '')`

	// Past every horizon: the row is given up on, and each consumer that never
	// settled it gets a dead letter saying so, where operators already look. The
	// dead letter's replay horizon is the one that ran out (now, at the latest), so
	// a replay needs --force, knowingly. A row nobody read has no horizon (a zero
	// interval): no inbox can have forgotten it, and a replay is safe. $1/$2 pair
	// rows with consumers, $3 the reasons, $4 the horizons (as intervals after the
	// row's creation), $5 retention.
	sqlAlert = `
WITH t AS (
  SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::interval[]) AS t(i, c, r, h)
), a AS (
  UPDATE idem_outbox o
  SET alerted_at = now(), reconciled = 'alert', expires_at = now() + $5::interval
  WHERE o.id IN (SELECT i FROM t)
  RETURNING o.id, o.key, o.subject, o.headers, o.payload, o.attempts, o.created_at
)
INSERT INTO idem_dead_letters (consumer, key, subject, headers, payload, reason, deliveries, fingerprint, inbox_expires_at)
SELECT t.c, a.key, a.subject, a.headers, a.payload, t.r, 0, sha256(a.payload),
       CASE WHEN t.h > '0'::interval THEN LEAST(now(), a.created_at + t.h) END
FROM a JOIN t ON t.i = a.id`

	// The registry of consumers, as they registered at start.
	sqlRegistered = `
SELECT name, stream, filter_subject, EXTRACT(EPOCH FROM key_lifetime)::float8, last_seen_at
FROM idem_consumers
ORDER BY name`
	sqlForget   = `DELETE FROM idem_consumers WHERE name = $1`
	sqlRegister = `
INSERT INTO idem_consumers (name, stream, filter_subject, key_lifetime)
VALUES ($1, $2, $3, $4)
ON CONFLICT (name) DO UPDATE
SET stream = EXCLUDED.stream, filter_subject = EXCLUDED.filter_subject,
    key_lifetime = EXCLUDED.key_lifetime, last_seen_at = now()`
	sqlSeen = `UPDATE idem_consumers SET last_seen_at = now() WHERE name = $1`

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
