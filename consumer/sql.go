package consumer

import "github.com/idemkit/idem/internal/pgschema"

// All of the consumer's SQL, in one place. The inbox's own SQL lives in package
// dedupe. newQueries qualifies it for the configured schema once.
const (
	// A redelivered poison message (its terminate was lost) files only once; a
	// message is its stream sequence, key and payload, so a stream recreated from
	// sequence 1 does not make a new message collide with an old dead letter.
	//
	// inbox_expires_at is the replay horizon: when the consumer's inbox may forget
	// the delivery, now plus its KeyLifetime — or sooner, when the inbox already
	// holds it (a fingerprint mismatch: that row expires first, and a replay after
	// it would no longer be folded). expires_at stays NULL: retention is the
	// collector's policy (worker.DefaultDeadLetterRetention after created_at, and
	// never before inbox_expires_at), so it can change without rewriting rows.
	sqlInsertDeadLetter = `
INSERT INTO idem_dead_letters (consumer, key, message, subject, headers, payload, reason, deliveries, stream_seq, fingerprint, inbox_expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
        LEAST(now() + $11::interval,
              (SELECT min(expires_at) FROM idem_inbox WHERE consumer = $1 AND key = $2 AND message IN ($3, ''))))
ON CONFLICT (consumer, stream_seq, key, fingerprint) WHERE stream_seq IS NOT NULL DO NOTHING`

	// The last column is the horizon as the database's clock sees it: NULL when
	// unknown (filed before schema v3), else whether a replay is still safe.
	sqlDeadLetterCols = `id, consumer, key, COALESCE(message, subject), subject, headers, payload, reason, deliveries, created_at, replayed_at, inbox_expires_at, inbox_expires_at > now()`

	// A Filter, as parameters $1..$6; an empty or NULL parameter selects all.
	sqlDeadLetterFilter = `
WHERE ($1 = '' OR consumer = $1)
  AND ($2 = '' OR starts_with(reason, $2))
  AND ($3::timestamptz IS NULL OR created_at >= $3)
  AND ($4::timestamptz IS NULL OR created_at < $4)
  AND ($5::bigint[] IS NULL OR id = ANY($5))
  AND ($6 OR replayed_at IS NULL)`

	// Newest first; LIMIT NULL is no limit.
	sqlFindDeadLetters = `SELECT ` + sqlDeadLetterCols + ` FROM idem_dead_letters` + sqlDeadLetterFilter + `
ORDER BY id DESC LIMIT $7`

	// A bulk replay pages through the matching dead letters oldest first, one batch
	// per transaction. SKIP LOCKED: a dead letter another replay holds is left to
	// it, so two operators replaying at once each replay a dead letter once, never
	// both (the other's commit sets replayed_at, which the filter then excludes).
	sqlReplayBatch = `SELECT ` + sqlDeadLetterCols + ` FROM idem_dead_letters` + sqlDeadLetterFilter + `
  AND id > $7
ORDER BY id LIMIT $8
FOR UPDATE SKIP LOCKED`
	// A dry run reads the same rows without locking them, so it never makes a real
	// replay running at the same time skip anything.
	sqlReplayBatchDry = `SELECT ` + sqlDeadLetterCols + ` FROM idem_dead_letters` + sqlDeadLetterFilter + `
  AND id > $7
ORDER BY id LIMIT $8`

	// FOR UPDATE: two replays of one dead letter at once enqueue it once each, in
	// turn, never interleaved with the other's mark.
	sqlGetDeadLetterForUpdate = `SELECT ` + sqlDeadLetterCols + ` FROM idem_dead_letters WHERE id = $1 FOR UPDATE`
	sqlGetDeadLetter          = `SELECT ` + sqlDeadLetterCols + ` FROM idem_dead_letters WHERE id = $1`
	// A replay starts with a fresh attempt count: the one its dead letter used up
	// would dead-letter it again at its first failure.
	sqlMarkReplayed = `
WITH d AS (
  UPDATE idem_dead_letters SET replayed_at = now() WHERE id = ANY($1) RETURNING consumer, key, COALESCE(message, subject) AS message
)
DELETE FROM idem_attempts a USING d WHERE a.consumer = d.consumer AND a.key = d.key AND a.message = d.message`
)

// queries is the SQL of one schema.
type queries struct {
	insertDeadLetter, findDeadLetters, getDeadLetter, getDeadLetterForUpdate string
	replayBatch, replayBatchDry, markReplayed                                string
	attemptStart, attemptFail                                                string
}

func newQueries(schema string) queries {
	q := func(sql string) string { return pgschema.Qualify(schema, sql) }
	return queries{
		insertDeadLetter: q(sqlInsertDeadLetter), findDeadLetters: q(sqlFindDeadLetters),
		getDeadLetter: q(sqlGetDeadLetter), getDeadLetterForUpdate: q(sqlGetDeadLetterForUpdate),
		replayBatch: q(sqlReplayBatch), replayBatchDry: q(sqlReplayBatchDry),
		markReplayed: q(sqlMarkReplayed),
		attemptStart: q(sqlAttemptStart), attemptFail: q(sqlAttemptFail),
	}
}

// The attempts' SQL (see attemptCounter).
const (
	// A redelivered attempt starts: count it. No row yet means the attempts before
	// left no trace: this one is at least the second.
	sqlAttemptStart = `
INSERT INTO idem_attempts AS a (consumer, key, message, attempts, expires_at)
VALUES ($1, $2, $3, 2, now() + $4::interval)
ON CONFLICT (consumer, key, message) DO UPDATE
SET attempts = a.attempts + 1, updated_at = now(), expires_at = EXCLUDED.expires_at
RETURNING attempts`

	// A handler failed the current attempt: keep its error; the attempt was counted
	// when it started (the first one is counted here).
	sqlAttemptFail = `
INSERT INTO idem_attempts AS a (consumer, key, message, attempts, last_error, expires_at)
VALUES ($1, $2, $3, 1, $4, now() + $5::interval)
ON CONFLICT (consumer, key, message) DO UPDATE
SET attempts = GREATEST(a.attempts, 1), last_error = EXCLUDED.last_error, updated_at = now(), expires_at = EXCLUDED.expires_at
RETURNING attempts`
)
