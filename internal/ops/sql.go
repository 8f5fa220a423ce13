package ops

import "github.com/idemkit/idem/internal/pgschema"

// All of ops' SQL, in one place. It names idem's tables plainly; newQueries
// qualifies it for the configured schema once. The application's tables are the
// hooks' business (EffectsFunc, CountsFunc), and the outbox backlog is the outbox's
// (outbox.Outbox.Backlog).
//
// Past the ingress every table stores the scoped key (idem.ScopedKey);
// idem_requests stores the scope and the bare key in two columns.
const (
	sqlNow = `SELECT now()`

	sqlInspectRequest = `
SELECT method, path, status, response_code, response_body, encode(fingerprint, 'hex'),
       locked_at, created_at, expires_at
FROM idem_requests
WHERE scope = $1 AND key = $2`

	sqlInspectOutbox = `
SELECT id, subject, subject || COALESCE(' ' || message_name, ''), msg_id, headers, payload, created_at, published_at, attempts, last_error, expires_at,
       stream, stream_seq, generation, completed_at, alerted_at, dead_lettered_at
FROM idem_outbox
WHERE key = $1
ORDER BY id`

	// The inbox's primary key is (consumer, key, message): a look-up by key alone
	// would scan the table. There are few consumers, so walk them with a "loose
	// index scan" (each step finds the next consumer name with one probe of the
	// primary key) and probe (consumer, key) for each: a handful of index probes,
	// whatever the size of the inbox. One key has a row per message a consumer
	// read; LIMIT keeps each probe from being flattened into a join.
	sqlInspectInbox = `
WITH RECURSIVE consumers(name) AS (
    (SELECT consumer FROM idem_inbox ORDER BY consumer LIMIT 1)
    UNION ALL
    SELECT (SELECT consumer FROM idem_inbox WHERE consumer > c.name ORDER BY consumer LIMIT 1)
    FROM consumers c
    WHERE c.name IS NOT NULL
)
SELECT i.consumer, i.message, i.status, i.result, encode(i.fingerprint, 'hex'), i.lease_until, i.lease_attempts,
       i.step, i.created_at, i.completed_at, i.expires_at
FROM consumers c
CROSS JOIN LATERAL (
    SELECT * FROM idem_inbox WHERE consumer = c.name AND key = $1 ORDER BY message LIMIT 1000
) AS i
ORDER BY i.consumer, i.message`

	sqlInspectDeadLetters = `
SELECT id, consumer, COALESCE(message, subject), subject, reason, deliveries, stream_seq, payload, created_at, replayed_at
FROM idem_dead_letters
WHERE key = $1
ORDER BY id`

	// Only when nothing at all is known about the key: is it known in other scopes?
	// The request table's key is (scope, key), so this scans; it runs once, by hand.
	sqlInspectOtherScopes = `
SELECT DISTINCT scope FROM idem_requests
WHERE key = $1 AND scope <> $2
ORDER BY scope
LIMIT 20`

	// Exact counts: count(*) reads the whole table (or index), which is what an
	// operator who asks "how many" wants, and what a one-off command can afford.
	// The pending count and the oldest pending row are the outbox's Backlog.
	sqlStatsTotals = `
SELECT
    (SELECT count(*) FROM idem_requests),
    (SELECT count(*) FROM idem_requests WHERE status <> 'done'),
    (SELECT count(*) FROM idem_outbox WHERE published_at IS NULL AND attempts > 0),
    (SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL),
    (SELECT count(*) FROM idem_dead_letters),
    (SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NULL)`

	// Dead letters not yet replayed, per consumer: the metrics' gauge. Dead letters
	// are few (poison, bounded by retention), so a scan per scrape is affordable.
	sqlOpenDeadLetters = `
SELECT consumer, count(*) FROM idem_dead_letters WHERE replayed_at IS NULL GROUP BY consumer ORDER BY consumer`

	sqlStatsInbox = `
SELECT consumer, status, count(*),
       count(*) FILTER (WHERE expires_at < now()),
       count(*) FILTER (WHERE status = 'leased' AND lease_until < now())
FROM idem_inbox
GROUP BY consumer, status
ORDER BY consumer, status`
)

// queries is the SQL of one schema.
type queries struct {
	request, outbox, inbox, deadLetters, otherScopes string
	totals, inboxStats, openDeadLetters              string
}

func newQueries(schema string) queries {
	q := func(sql string) string { return pgschema.Qualify(schema, sql) }
	return queries{
		request:         q(sqlInspectRequest),
		outbox:          q(sqlInspectOutbox),
		inbox:           q(sqlInspectInbox),
		deadLetters:     q(sqlInspectDeadLetters),
		otherScopes:     q(sqlInspectOtherScopes),
		openDeadLetters: q(sqlOpenDeadLetters),
		totals:          q(sqlStatsTotals),
		inboxStats:      q(sqlStatsInbox),
	}
}
