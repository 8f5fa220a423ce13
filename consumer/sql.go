package consumer

// All of the consumer's SQL, in one place. The inbox's own SQL lives in package
// dedupe.
const (
	// A redelivered poison message (its terminate was lost) files only once.
	sqlInsertDeadLetter = `
INSERT INTO idem_dead_letters (consumer, key, subject, headers, payload, reason, deliveries, stream_seq)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (consumer, stream_seq) WHERE stream_seq IS NOT NULL DO NOTHING`

	sqlDeadLetterCols = `id, consumer, key, subject, headers, payload, reason, deliveries, created_at, replayed_at`

	sqlListDeadLetters = `SELECT ` + sqlDeadLetterCols + ` FROM idem_dead_letters ORDER BY id DESC LIMIT $1`
	sqlGetDeadLetter   = `SELECT ` + sqlDeadLetterCols + ` FROM idem_dead_letters WHERE id = $1`
	sqlMarkReplayed    = `UPDATE idem_dead_letters SET replayed_at = now() WHERE id = $1`
)
