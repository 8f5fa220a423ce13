package outbox

// NotifyChannel is the LISTEN/NOTIFY channel that wakes the relay.
const NotifyChannel = "idem_outbox"

// All of the outbox's SQL, in one place.
const (
	sqlEnqueue = `
INSERT INTO idem_outbox (key, subject, msg_id, headers, payload)
SELECT k, s, m, h::jsonb, p
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[]) AS t(k, s, m, h, p)`

	sqlNotify = `SELECT pg_notify($1, '')`
)

const (
	// Claim a batch of unpublished rows. SKIP LOCKED lets several relays drain one
	// outbox without waiting on each other; the row locks are the claim and last
	// until the batch is marked (or the relay dies and Postgres releases them).
	sqlClaim = `
SELECT id, key, subject, msg_id, headers, payload
FROM idem_outbox
WHERE published_at IS NULL
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED`

	sqlMarkPublished = `
UPDATE idem_outbox
SET published_at = now(), attempts = attempts + 1, last_error = NULL, expires_at = now() + $2::interval
WHERE id = ANY($1::bigint[])`

	sqlMarkFailed = `
UPDATE idem_outbox
SET attempts = attempts + 1, last_error = t.e
FROM unnest($1::bigint[], $2::text[]) AS t(i, e)
WHERE id = t.i`

	sqlListen = `LISTEN ` + NotifyChannel
)
