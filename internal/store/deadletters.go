package store

// idem_dead_letters: messages that can never succeed as they are, with the reason.
// Every writer of a dead letter is here: a consumer, the relay and the reconciler.

const (
	// A redelivered poison message (its terminate was lost) files only once; a
	// message is its stream sequence, key and payload, so a stream recreated from
	// sequence 1 does not make a new message collide with an old dead letter.
	//
	// inbox_expires_at is the replay horizon: when the consumer's inbox may forget
	// the delivery, now plus its KeyLifetime — or sooner, when the inbox already
	// holds it (a fingerprint mismatch: that row expires first, and a replay after
	// it would no longer be folded). expires_at stays NULL: retention is the
	// collector's policy (worker.RetentionConfig.DeadLetters after created_at, and
	// never before inbox_expires_at), so it can change without rewriting rows.
	sqlDeadlettersInsert = `
INSERT INTO idem_dead_letters (consumer, key, message, subject, headers, payload, reason, deliveries, stream_seq, fingerprint, inbox_expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
        LEAST(now() + $11::interval,
              (SELECT min(expires_at) FROM idem_inbox WHERE consumer = $1 AND key = $2 AND message IN ($3, ''))))
ON CONFLICT (consumer, stream_seq, key, fingerprint) WHERE stream_seq IS NOT NULL DO NOTHING`

	// A row that can never be published leaves the queue for the dead letters, with
	// the broker's reason, in the relay's transaction: never retried forever, never
	// dropped. The outbox row is kept for its retention, as evidence. $5 are the
	// replay horizons, after each row's creation (Relay.replayHorizons; NULL: none).
	sqlDeadlettersInsertRelay = `
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

	// Past every horizon: the row is given up on, and each consumer that never
	// settled it gets a dead letter saying so, where operators already look. The
	// dead letter's replay horizon is the one that ran out (now, at the latest), so
	// a replay needs --force, knowingly. A row no registered consumer reads gets a
	// zero horizon, passed at once: it was published, and a consumer outside the
	// registry may have run it and forgotten its key. $1/$2 pair rows with
	// consumers, $3 the reasons, $4 the horizons (as intervals after the row's
	// creation), $5 retention.
	sqlDeadlettersInsertAlert = `
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

	// The last column is the horizon as the database's clock sees it: NULL when
	// unknown (filed before schema v3), else whether a replay is still safe.
	sqlDeadlettersCols = `id, consumer, key, COALESCE(message, subject), subject, headers, payload, reason, deliveries, created_at, replayed_at, inbox_expires_at, now()`

	// A Filter, as parameters $1..$6; an empty or NULL parameter selects all.
	sqlDeadlettersFilter = `
WHERE ($1 = '' OR consumer = $1)
  AND ($2 = '' OR starts_with(reason, $2))
  AND ($3::timestamptz IS NULL OR created_at >= $3)
  AND ($4::timestamptz IS NULL OR created_at < $4)
  AND ($5::bigint[] IS NULL OR id = ANY($5))
  AND ($6 OR replayed_at IS NULL)`

	// Newest first; LIMIT NULL is no limit.
	sqlDeadlettersFind = `SELECT ` + sqlDeadlettersCols + ` FROM idem_dead_letters` + sqlDeadlettersFilter + `
ORDER BY id DESC LIMIT $7`

	// A bulk replay pages through the matching dead letters oldest first, one batch
	// per transaction. SKIP LOCKED: a dead letter another replay holds is left to
	// it, so two operators replaying at once each replay a dead letter once, never
	// both (the other's commit sets replayed_at, which the filter then excludes).
	sqlDeadlettersReplayBatch = `SELECT ` + sqlDeadlettersCols + ` FROM idem_dead_letters` + sqlDeadlettersFilter + `
  AND id > $7
ORDER BY id LIMIT $8
FOR UPDATE SKIP LOCKED`

	// A dry run reads the same rows without locking them, so it never makes a real
	// replay running at the same time skip anything.
	sqlDeadlettersReplayBatchDry = `SELECT ` + sqlDeadlettersCols + ` FROM idem_dead_letters` + sqlDeadlettersFilter + `
  AND id > $7
ORDER BY id LIMIT $8`

	// FOR UPDATE: two replays of one dead letter at once enqueue it once each, in
	// turn, never interleaved with the other's mark.
	sqlDeadlettersGetForUpdate = `SELECT ` + sqlDeadlettersCols + ` FROM idem_dead_letters WHERE id = $1 FOR UPDATE`

	sqlDeadlettersGet = `SELECT ` + sqlDeadlettersCols + ` FROM idem_dead_letters WHERE id = $1`

	// A replay starts with a fresh attempt count: the one its dead letter used up
	// would dead-letter it again at its first failure.
	sqlDeadlettersMarkReplayed = `
WITH d AS (
  UPDATE idem_dead_letters SET replayed_at = now() WHERE id = ANY($1) RETURNING consumer, key, COALESCE(message, subject) AS message
)
DELETE FROM idem_attempts a USING d WHERE a.consumer = d.consumer AND a.key = d.key AND a.message = d.message`

	sqlDeadlettersInspect = `
SELECT id, consumer, COALESCE(message, subject), subject, reason, deliveries, stream_seq, payload, created_at, replayed_at
FROM idem_dead_letters
WHERE key = $1
ORDER BY id`

	// Dead letters not yet replayed, per consumer: the metrics' gauge. Dead letters
	// are few (poison, bounded by retention), so a scan per scrape is affordable.
	sqlDeadlettersOpen = `
SELECT consumer, count(*) FROM idem_dead_letters WHERE replayed_at IS NULL GROUP BY consumer ORDER BY consumer`

	// The consumer files a same-key-different-payload message with a reason that
	// starts with "fingerprint mismatch".
	sqlDeadlettersReasons = `SELECT reason FROM idem_dead_letters WHERE consumer = $1 AND key = $2 ORDER BY id`

	// Collect deletes expired rows, one bounded batch ($1 rows) per statement.
	// SKIP LOCKED: a row some transaction is using right now is left for the next
	// round. It reads and deletes its ctids in ONLY the table: a ctid names a row
	// within one relation, and through a partitioned parent the same ctid is a row
	// in each partition. Run against a table that was converted after the round
	// looked at its layout (partition.Convert), it finds no row in the parent
	// itself and deletes nothing; the next round collects the default partition.
	//
	// Past retention ($2, by created_at, its index) and past the replay horizon:
	// until then a replay is still allowed, and the row is its only record. A row
	// with no horizon (filed before schema v3, or for a message the broker
	// refused) goes by age alone.
	sqlDeadlettersCollect = `
DELETE FROM ONLY idem_dead_letters WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM ONLY idem_dead_letters
  WHERE created_at < now() - $2::interval AND (inbox_expires_at IS NULL OR inbox_expires_at < now())
  LIMIT $1 FOR UPDATE SKIP LOCKED))`

	// Counts: every dead letter, and those not yet replayed.
	sqlDeadlettersCounts = `
SELECT (SELECT count(*) FROM idem_dead_letters), (SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NULL)`
)

// DeadLetters is the SQL of idem_dead_letters, qualified for one schema.
type DeadLetters struct {
	Insert, InsertRelay, InsertAlert, Find, ReplayBatch, ReplayBatchDry, GetForUpdate, Get, MarkReplayed, Inspect, Open, Reasons, Collect, Counts string
}

func newDeadLetters(q func(string) string) DeadLetters {
	return DeadLetters{
		Insert:         q(sqlDeadlettersInsert),
		InsertRelay:    q(sqlDeadlettersInsertRelay),
		InsertAlert:    q(sqlDeadlettersInsertAlert),
		Find:           q(sqlDeadlettersFind),
		ReplayBatch:    q(sqlDeadlettersReplayBatch),
		ReplayBatchDry: q(sqlDeadlettersReplayBatchDry),
		GetForUpdate:   q(sqlDeadlettersGetForUpdate),
		Get:            q(sqlDeadlettersGet),
		MarkReplayed:   q(sqlDeadlettersMarkReplayed),
		Inspect:        q(sqlDeadlettersInspect),
		Open:           q(sqlDeadlettersOpen),
		Reasons:        q(sqlDeadlettersReasons),
		Collect:        q(sqlDeadlettersCollect),
		Counts:         q(sqlDeadlettersCounts),
	}
}
