package outbox

import "github.com/idemkit/idem/internal/pgschema"

// notifyChannel is the LISTEN/NOTIFY channel that wakes the relays of a schema.
func notifyChannel(schema string) string { return pgschema.Channel(schema, "idem_outbox") }

// The relay's statements that name no table; idem_outbox's own are in package
// store (internal/store/outbox.go).
const (
	// sqlBeginRelay opens a relay batch's transaction. The relay reads and updates
	// only rows it has locked, by primary key, a few hundred at a time; a sequential
	// scan or a hash join over the outbox is never the right plan for that. The
	// planner picks one anyway: a generic plan made while the table was small (pgx
	// prepares every statement, and Postgres keeps a connection's generic plan until
	// the table is next analyzed) goes on scanning it as it grows, and the cost
	// model, which prices each index probe as a random read, prefers a hash join to
	// 250 probes once the table holds some 20,000 rows. Both were measured, in
	// BENCHMARKS.md. Turning those plans off for the relay's own transaction keeps
	// every statement on an index, whatever the statistics say; and since that
	// plan is right for any batch, the generic plan is forced too, so a small batch
	// is not planned afresh each time (some 70 µs per statement). All in the same
	// round trip as BEGIN.
	sqlBeginRelay = `BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_hashjoin = off; ` +
		`SET LOCAL enable_mergejoin = off; SET LOCAL plan_cache_mode = force_generic_plan`

	sqlNotify = `SELECT pg_notify($1, '')`
)
