package store

// idem_outbox_published: what the log relay published (package relay's LogRelay),
// a window of outbox rows per row, and how far the reconciler has proven them.
// The log relay never updates an outbox row it publishes: this table is where the
// fact "published, at these stream sequences" is written, once per window.

const (
	// A window: the outbox ids whose PubAcks all came, and their sequences. $4 and
	// $5 are the lowest and highest id, for the range index.
	sqlPublishedInsert = `
INSERT INTO idem_outbox_published (stream, ids, seqs, id_range, lsn, proven_at)
VALUES ($1, $2::bigint[], $3::bigint[], int8range($4, $5, '[]'), $6::text::pg_lsn,
        CASE WHEN $7::bool THEN now() END)`

	// The reconciler's windows: unproven, of one stream, after the last one of the
	// previous batch, oldest first. SKIP LOCKED: several reconcilers share them.
	// $1 stream, $2 the last window id of the previous batch, $3 how many.
	sqlPublishedUnproven = `
SELECT id FROM idem_outbox_published
WHERE proven_at IS NULL AND stream = $1 AND id > $2
ORDER BY id
LIMIT $3
FOR UPDATE SKIP LOCKED`

	// The rows of those windows still to be judged, with the sequence each landed
	// at: the log relay's own (a row it handed over to the polling relay, or the
	// reconciler re-drove, has left it), neither proven nor given up on. The same
	// columns as the outbox's Unproven, then the window. $1 the windows, $2 After.
	sqlPublishedRows = `
SELECT o.id, o.key, o.subject, o.subject || COALESCE(' ' || o.message_name, ''), o.msg_id,
       COALESCE(o.headers->>'Idem-Replay-For', ''), s.seq, o.generation, o.created_at,
       EXTRACT(EPOCH FROM now() - o.created_at)::float8,
       w.published_at <= now() - $2::interval,
       o.checked_at IS NULL OR o.checked_at <= now() - $2::interval,
       w.id
FROM idem_outbox_published w
CROSS JOIN LATERAL unnest(w.ids, w.seqs) AS s(id, seq)
JOIN idem_outbox o ON o.id = s.id
WHERE w.id = ANY($1::bigint[])
  AND o.relay = 'log' AND o.completed_at IS NULL AND o.alerted_at IS NULL AND o.dead_lettered_at IS NULL
ORDER BY w.id, s.id`

	// Proven: no row of the window is left to judge.
	sqlPublishedProve = `
UPDATE idem_outbox_published SET proven_at = now() WHERE id = ANY($1::bigint[])`

	// The windows a row was published in (its stream sequence in each), for inspect.
	sqlPublishedOf = `
SELECT w.stream, w.seqs[array_position(w.ids, $1::bigint)], w.published_at, w.proven_at
FROM idem_outbox_published w
WHERE w.id_range @> $1::bigint AND $1::bigint = ANY(w.ids)
ORDER BY w.id`

	// Collect: windows proven longer ago than the retention ($2), a bounded batch
	// ($1) per statement. A row the reconciler proved carries its own expiry; the
	// rows of a window no reconciler waits for (proven as it was written) have
	// none, and go with it. One result row per window deleted (the DELETE of the
	// rows runs to completion unread).
	sqlPublishedCollect = `
WITH w AS (
  DELETE FROM idem_outbox_published WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idem_outbox_published WHERE proven_at < now() - $2::interval
    LIMIT $1 FOR UPDATE SKIP LOCKED))
  RETURNING ids
), o AS (
  DELETE FROM idem_outbox WHERE relay = 'log' AND expires_at IS NULL
    AND completed_at IS NULL AND alerted_at IS NULL
    AND id IN (SELECT unnest(ids) FROM w)
  RETURNING 1
)
SELECT 1 FROM w`

	// The reconciler's queue of windows at one moment: their rows, and the oldest.
	sqlPublishedStatus = `
SELECT COALESCE(sum(cardinality(ids)), 0)::bigint,
       COALESCE(EXTRACT(EPOCH FROM now() - min(published_at)), 0)::float8
FROM idem_outbox_published WHERE proven_at IS NULL`
)

// Published is the SQL of idem_outbox_published, qualified for one schema.
type Published struct {
	Insert, Unproven, Rows, Prove, Of, Collect, Status string
}

func newPublished(q func(string) string) Published {
	return Published{
		Insert:   q(sqlPublishedInsert),
		Unproven: q(sqlPublishedUnproven),
		Rows:     q(sqlPublishedRows),
		Prove:    q(sqlPublishedProve),
		Of:       q(sqlPublishedOf),
		Collect:  q(sqlPublishedCollect),
		Status:   q(sqlPublishedStatus),
	}
}
