package store

// idem_attempts: the attempts at each delivery, counted by the consumers: what
// MaxDeliver is compared with.

const (
	// A redelivered attempt starts: count it. No row yet means the attempts before
	// left no trace: this one is at least the second.
	sqlAttemptsStart = `
INSERT INTO idem_attempts AS a (consumer, key, message, attempts, expires_at)
VALUES ($1, $2, $3, 2, now() + $4::interval)
ON CONFLICT (consumer, key, message) DO UPDATE
SET attempts = a.attempts + 1, updated_at = now(), expires_at = EXCLUDED.expires_at
RETURNING attempts`

	// A handler failed the current attempt: keep its error; the attempt was counted
	// when it started (the first one is counted here).
	sqlAttemptsFail = `
INSERT INTO idem_attempts AS a (consumer, key, message, attempts, last_error, expires_at)
VALUES ($1, $2, $3, 1, $4, now() + $5::interval)
ON CONFLICT (consumer, key, message) DO UPDATE
SET attempts = GREATEST(a.attempts, 1), last_error = EXCLUDED.last_error, updated_at = now(), expires_at = EXCLUDED.expires_at
RETURNING attempts`

	// Collect deletes expired rows, one bounded batch ($1 rows) per statement.
	// SKIP LOCKED: a row some transaction is using right now is left for the next
	// round. It reads and deletes its ctids in ONLY the table: a ctid names a row
	// within one relation, and through a partitioned parent the same ctid is a row
	// in each partition. Run against a table that was converted after the round
	// looked at its layout (partition.Convert), it finds no row in the parent
	// itself and deletes nothing; the next round collects the default partition.
	sqlAttemptsCollect = `
DELETE FROM ONLY idem_attempts WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM ONLY idem_attempts WHERE expires_at < now() LIMIT $1 FOR UPDATE SKIP LOCKED))`
)

// Attempts is the SQL of idem_attempts, qualified for one schema.
type Attempts struct {
	Start, Fail, Collect string
}

func newAttempts(q func(string) string) Attempts {
	return Attempts{
		Start:   q(sqlAttemptsStart),
		Fail:    q(sqlAttemptsFail),
		Collect: q(sqlAttemptsCollect),
	}
}
