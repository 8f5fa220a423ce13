package outbox

import "github.com/idemkit/idem/internal/pgschema"

// notifyChannel is the LISTEN/NOTIFY channel that wakes the relays of a schema.
func notifyChannel(schema string) string { return pgschema.Channel(schema, "idem_outbox") }

// All of the outbox's SQL, in one place. It names idem_outbox plainly; newQueries
// qualifies it for the configured schema once.
const (
	sqlEnqueue = `
INSERT INTO idem_outbox (key, subject, msg_id, headers, payload)
SELECT k, s, m, h::jsonb, p
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[]) AS t(k, s, m, h, p)`
	sqlNotify = `SELECT pg_notify($1, '')`

	// Claim a batch of unpublished rows. SKIP LOCKED lets several relays drain one
	// outbox without waiting on each other; the row locks are the claim and last
	// until the batch is marked (or the relay dies and Postgres releases them).
	sqlClaim = `
SELECT id, key, subject, msg_id, headers, payload
FROM idem_outbox
WHERE published_at IS NULL AND dead_lettered_at IS NULL
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED`

	sqlMarkPublished = `
UPDATE idem_outbox
SET published_at = now(), attempts = attempts + 1, last_error = NULL, expires_at = now() + $2::interval
WHERE id = ANY($1::bigint[])`

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

	sqlMarkFailed = `
UPDATE idem_outbox
SET attempts = attempts + 1, last_error = t.e
FROM unnest($1::bigint[], $2::text[]) AS t(i, e)
WHERE id = t.i`
)

// queries is the SQL of one schema.
type queries struct {
	enqueue, claim, markPublished, markFailed, backlog string
}

func newQueries(schema string) queries {
	q := func(sql string) string { return pgschema.Qualify(schema, sql) }
	return queries{enqueue: q(sqlEnqueue), claim: q(sqlClaim), markPublished: q(sqlMarkPublished), markFailed: q(sqlMarkFailed), backlog: q(sqlBacklog)}
}
