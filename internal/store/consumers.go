package store

// idem_consumers: the registry: which consumers an installation has, what each
// reads, its key lifetime and where it starts.

const (
	// The registry of consumers, as they registered at start.
	sqlConsumersRegistered = `
SELECT name, stream, filter_subject, EXTRACT(EPOCH FROM key_lifetime)::float8, EXTRACT(EPOCH FROM redelivery)::float8,
       registered_at, last_seen_at, starts_at,
       COALESCE(EXTRACT(EPOCH FROM prior_key_lifetime), 0)::float8, key_lifetime_since
FROM idem_consumers
ORDER BY name`

	sqlConsumersForget = `DELETE FROM idem_consumers WHERE name = $1`

	// A new entry starts now ($6) or backfills (NULL); an existing one keeps its
	// start. A change of its key lifetime keeps the old one as the prior
	// lifetime: the shorter of it and the prior one, unless every row settled
	// under the prior one has expired since (it was last in use longer ago than
	// itself). xmax is 0 on a row this statement inserted.
	sqlConsumersRegister = `
INSERT INTO idem_consumers AS c (name, stream, filter_subject, key_lifetime, redelivery, starts_at)
VALUES ($1, $2, $3, $4, $5, CASE WHEN $6::boolean THEN now() END)
ON CONFLICT (name) DO UPDATE
SET stream = EXCLUDED.stream, filter_subject = EXCLUDED.filter_subject,
    key_lifetime = EXCLUDED.key_lifetime, redelivery = EXCLUDED.redelivery, last_seen_at = now(),
    prior_key_lifetime = CASE WHEN c.key_lifetime = EXCLUDED.key_lifetime THEN c.prior_key_lifetime ELSE
                        CASE WHEN c.prior_key_lifetime IS NULL OR c.key_lifetime_since < now() - c.prior_key_lifetime THEN c.key_lifetime
                             ELSE LEAST(c.prior_key_lifetime, c.key_lifetime) END END,
    key_lifetime_since = CASE WHEN c.key_lifetime = EXCLUDED.key_lifetime THEN c.key_lifetime_since ELSE now() END
RETURNING xmax = 0, registered_at, last_seen_at, starts_at`

	// While $3 is not registered, the other registered consumers of stream $1
	// and filter $2 whose inbox remembers a settlement: what a new name $3 would
	// run again if it backfilled.
	sqlConsumersLikelyRenamed = `
SELECT o.name FROM idem_consumers o
WHERE o.stream = $1 AND o.filter_subject = $2 AND o.name <> $3
  AND NOT EXISTS (SELECT 1 FROM idem_consumers s WHERE s.name = $3)
  AND EXISTS (SELECT 1 FROM idem_inbox i WHERE i.consumer = o.name)
ORDER BY o.name`

	// A rename, in one transaction: the registry entry (locked first), then every
	// row that names the consumer.
	sqlConsumersRenameLock = `SELECT EXTRACT(EPOCH FROM now() - last_seen_at)::float8 FROM idem_consumers WHERE name = $1 FOR UPDATE`

	sqlConsumersRenameConsumer = `UPDATE idem_consumers SET name = $2 WHERE name = $1`

	sqlConsumersRenameInbox = `UPDATE idem_inbox SET consumer = $2 WHERE consumer = $1`

	sqlConsumersRenameAttempts = `UPDATE idem_attempts SET consumer = $2 WHERE consumer = $1`

	sqlConsumersRenameDeadLetters = `UPDATE idem_dead_letters SET consumer = $2 WHERE consumer = $1`

	// A process seen with a key lifetime ($2) other than the registered one (an
	// old process still running during a redeploy) is still settling under it:
	// the prior lifetime as in Register.
	sqlConsumersSeen = `
UPDATE idem_consumers AS c SET last_seen_at = now(),
    prior_key_lifetime = CASE WHEN c.key_lifetime = $2::interval THEN c.prior_key_lifetime ELSE
                        CASE WHEN c.prior_key_lifetime IS NULL OR c.key_lifetime_since < now() - c.prior_key_lifetime THEN $2::interval
                             ELSE LEAST(c.prior_key_lifetime, $2::interval) END END,
    key_lifetime_since = CASE WHEN c.key_lifetime = $2::interval THEN c.key_lifetime_since ELSE now() END
WHERE name = $1`

	// The registered consumers of a stream ($1; empty: of any), for the replay
	// horizon of a dead row that may have been stored.
	sqlConsumersReaders = `
SELECT filter_subject, EXTRACT(EPOCH FROM key_lifetime)::float8
FROM idem_consumers
WHERE $1 = '' OR stream = $1`

	// The longest key lifetime a registered consumer asked for: a partitioned
	// inbox must have partitions out to now() plus it.
	sqlConsumersMaxLifetime = `SELECT COALESCE(EXTRACT(EPOCH FROM max(key_lifetime)), 0)::float8 FROM idem_consumers`
)

// Consumers is the SQL of idem_consumers, qualified for one schema.
type Consumers struct {
	Registered, Forget, Register, LikelyRenamed, RenameLock, RenameConsumer, RenameInbox, RenameAttempts, RenameDeadLetters, Seen, Readers, MaxLifetime string
}

func newConsumers(q func(string) string) Consumers {
	return Consumers{
		Registered:        q(sqlConsumersRegistered),
		Forget:            q(sqlConsumersForget),
		Register:          q(sqlConsumersRegister),
		LikelyRenamed:     q(sqlConsumersLikelyRenamed),
		RenameLock:        q(sqlConsumersRenameLock),
		RenameConsumer:    q(sqlConsumersRenameConsumer),
		RenameInbox:       q(sqlConsumersRenameInbox),
		RenameAttempts:    q(sqlConsumersRenameAttempts),
		RenameDeadLetters: q(sqlConsumersRenameDeadLetters),
		Seen:              q(sqlConsumersSeen),
		Readers:           q(sqlConsumersReaders),
		MaxLifetime:       q(sqlConsumersMaxLifetime),
	}
}
