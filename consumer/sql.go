package consumer

import "github.com/idemkit/idem/internal/pgschema"

// All of the consumer's SQL, in one place. The inbox's own SQL lives in package
// dedupe. newQueries qualifies it for the configured schema once.
const (
	// A redelivered poison message (its terminate was lost) files only once; a
	// message is its stream sequence, key and payload, so a stream recreated from
	// sequence 1 does not make a new message collide with an old dead letter.
	sqlInsertDeadLetter = `
INSERT INTO idem_dead_letters (consumer, key, subject, headers, payload, reason, deliveries, stream_seq, fingerprint)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (consumer, stream_seq, key, fingerprint) WHERE stream_seq IS NOT NULL DO NOTHING`

	sqlDeadLetterCols = `id, consumer, key, subject, headers, payload, reason, deliveries, created_at, replayed_at`

	sqlListDeadLetters = `SELECT ` + sqlDeadLetterCols + ` FROM idem_dead_letters ORDER BY id DESC LIMIT $1`
	// FOR UPDATE: two replays of one dead letter at once enqueue it once each, in
	// turn, never interleaved with the other's mark.
	sqlGetDeadLetterForUpdate = `SELECT ` + sqlDeadLetterCols + ` FROM idem_dead_letters WHERE id = $1 FOR UPDATE`
	sqlGetDeadLetter          = `SELECT ` + sqlDeadLetterCols + ` FROM idem_dead_letters WHERE id = $1`
	sqlMarkReplayed           = `UPDATE idem_dead_letters SET replayed_at = now() WHERE id = $1`
)

// queries is the SQL of one schema.
type queries struct {
	insertDeadLetter, listDeadLetters, getDeadLetter, getDeadLetterForUpdate, markReplayed string
}

func newQueries(schema string) queries {
	q := func(sql string) string { return pgschema.Qualify(schema, sql) }
	return queries{
		insertDeadLetter: q(sqlInsertDeadLetter), listDeadLetters: q(sqlListDeadLetters),
		getDeadLetter: q(sqlGetDeadLetter), getDeadLetterForUpdate: q(sqlGetDeadLetterForUpdate),
		markReplayed: q(sqlMarkReplayed),
	}
}
