package partition

// All of the partitioner's SQL, in one place. DDL cannot take identifiers as bind
// parameters, so the statements that name a table are templates: every %[n]s is an
// identifier already quoted with pgx.Identifier.Sanitize, never user text.
const (
	// sqlLock serialises conversions and maintenance rounds of one database, so two
	// workers never create (or drop) the same partition at once. Transaction-level:
	// released at COMMIT or ROLLBACK. The key is "idpt" in ASCII.
	sqlLock = `SELECT pg_advisory_xact_lock(x'69647074'::int)`

	// sqlPartitions lists a partitioned table's partitions with their bounds, as
	// the catalog has them: the truth, whatever the partitions were named. The
	// catalog prints a bound in the session's TimeZone, with its offset, and the
	// cast reads it back in the same session, so the instants are exact in any.
	sqlPartitions = `
SELECT c.relname::text, b.expr = 'DEFAULT',
       (regexp_match(b.expr, $re$FROM \('([^']+)'\)$re$))[1]::timestamptz,
       (regexp_match(b.expr, $re$TO \('([^']+)'\)$re$))[1]::timestamptz,
       c.reltuples::bigint
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
JOIN pg_class p ON p.oid = i.inhparent
JOIN pg_namespace n ON n.oid = p.relnamespace
CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS expr) AS b
WHERE n.nspname = $1 AND p.relname = $2
ORDER BY c.relname`

	// sqlIndexes lists a plain table's secondary indexes (not its primary key), as
	// CREATE INDEX statements, so the partitioned table gets the same ones.
	sqlIndexes = `
SELECT i.indexname, i.indexdef
FROM pg_indexes i
JOIN pg_class c ON c.relname = i.indexname
JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = i.schemaname
JOIN pg_index x ON x.indexrelid = c.oid
WHERE i.schemaname = $1 AND i.tablename = $2 AND NOT x.indisprimary
ORDER BY i.indexname`

	sqlSetLockTimeout = `SELECT set_config('lock_timeout', $1, true)`

	sqlNow = `SELECT now()`
)

// The conversion of one table, in one transaction: the plain table becomes the
// DEFAULT partition of a new partitioned table of the same name and columns, so
// its rows stay where they are (no copy), every query keeps working, and new rows
// go to the ranged partitions once they exist. %[1]s is the table, %[2]s the
// default partition (both qualified), %[3]s the partition key, %[4]s the new
// primary key's columns (the old ones and the partition key), %[5]s the default
// partition's unqualified name.
const (
	sqlConvertLock   = `LOCK TABLE %[1]s IN ACCESS EXCLUSIVE MODE`
	sqlConvertRename = `ALTER TABLE %[1]s RENAME TO %[5]s`
	sqlConvertCreate = `CREATE TABLE %[1]s (LIKE %[2]s INCLUDING DEFAULTS INCLUDING CONSTRAINTS) PARTITION BY RANGE (%[3]s)`
	sqlConvertPK     = `ALTER TABLE %[1]s ADD PRIMARY KEY (%[4]s)`
	sqlConvertAttach = `ALTER TABLE %[1]s ATTACH PARTITION %[2]s DEFAULT`
	// The renamed table keeps its indexes under their old names; they move aside so
	// the partitioned table's indexes can take the names the migrations gave them.
	sqlRenameIndex    = `ALTER INDEX %[1]s RENAME TO %[2]s`
	sqlDropConstraint = `ALTER TABLE %[1]s DROP CONSTRAINT %[2]s`
	sqlPrimaryKey     = `
SELECT c.conname::text, array_agg(a.attname::text ORDER BY k.n)
FROM pg_constraint c
CROSS JOIN unnest(c.conkey) WITH ORDINALITY AS k(attnum, n)
JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum
WHERE c.conrelid = $1::regclass AND c.contype = 'p'
GROUP BY c.conname`
	// A serial column's sequence belongs to the column it was made for. It moves to
	// the partitioned table, so dropping the old table's rows could never drop it.
	sqlOwnSequence = `
SELECT pg_get_serial_sequence($1, 'id')`
	sqlSequenceOwnedBy = `ALTER SEQUENCE %[1]s OWNED BY %[2]s.id`
)

// Creating and dropping partitions. %[1]s is the partitioned table, %[2]s the
// partition (both qualified).
const (
	// A partition is created as a plain table and then attached: ATTACH takes a
	// SHARE UPDATE EXCLUSIVE lock on the parent, which inserts and queries do not
	// wait on, where CREATE TABLE … PARTITION OF takes an ACCESS EXCLUSIVE one.
	// Attaching creates the partition's copies of the parent's indexes.
	sqlCreateTable = `CREATE TABLE IF NOT EXISTS %[2]s (LIKE %[1]s INCLUDING DEFAULTS INCLUDING CONSTRAINTS)`
	sqlAttach      = `ALTER TABLE %[1]s ATTACH PARTITION %[2]s FOR VALUES FROM ($$%[3]s$$) TO ($$%[4]s$$)`

	// The newest partition key in the default partition: a ranged partition cannot
	// be attached over rows the default already holds. Both tables have an index
	// that answers it (idem_inbox on expires_at; idem_outbox's rows are in id
	// order, created_at within a transaction's span of it).
	sqlDefaultMaxInbox  = `SELECT max(expires_at) FROM %[2]s`
	sqlDefaultMaxOutbox = `SELECT max(created_at) FROM (SELECT created_at FROM %[2]s ORDER BY id DESC LIMIT 1000) AS newest`

	// A drop locks the parent (and with it every partition, in the order queries
	// take them), so it cannot deadlock with a query; lock_timeout bounds how long
	// the queue behind its ACCESS EXCLUSIVE lock can grow. It is held for the
	// index probes of sqlLive* and the DROP: milliseconds.
	sqlLockParent = `LOCK TABLE %[1]s IN ACCESS EXCLUSIVE MODE`
	sqlDrop       = `DROP TABLE %[2]s`

	// Whether a partition still holds a row the collector would not delete: the
	// same definition of "expired" as worker's retention (expires_at < now(); a
	// NULL expiry never expires). Each branch has an index: idem_inbox and
	// idem_outbox are indexed on expires_at, and the partitioned outbox gets
	// idem_outbox_unexpired for the NULLs (pending and unproven rows).
	sqlLiveInbox  = `SELECT EXISTS (SELECT 1 FROM %[2]s WHERE expires_at >= now())`
	sqlLiveOutbox = `
SELECT EXISTS (SELECT 1 FROM %[2]s WHERE expires_at IS NULL)
    OR EXISTS (SELECT 1 FROM %[2]s WHERE expires_at IS NOT NULL AND expires_at >= now())`
)

// sqlOutboxUnexpired is the one index the partitioned outbox adds: rows with no
// expiry yet (pending, or published and not yet proven). It makes "does this
// partition still hold a live row" an index probe, taken under the drop's lock.
const sqlOutboxUnexpired = `CREATE INDEX IF NOT EXISTS idem_outbox_unexpired ON %[1]s (id) WHERE expires_at IS NULL`
