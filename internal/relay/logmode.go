package relay

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/store"
)

// Which relay publishes an installation's outbox. The log relay needs what a
// logical replication client needs; where any of it is missing the polling relay
// runs, and the worker says why.

// Mode names a relay.
type Mode string

const (
	// ModeLog reads committed rows from a logical replication slot (LogRelay).
	ModeLog Mode = "log"
	// ModePoll claims pending rows with SELECT ... FOR UPDATE SKIP LOCKED (Relay).
	ModePoll Mode = "poll"
)

// minLogServer is the oldest Postgres whose pgoutput streams binary tuples.
const minLogServer = 140000

// LogNames are the names the log relay of one installation uses in Postgres.
type LogNames struct {
	// Slot is the logical replication slot, unique in the cluster: it names the
	// database and the schema.
	Slot string
	// Publication is the publication of idem_outbox's INSERTs, unique in the
	// database: it names the schema.
	Publication string
}

// NamesFor returns the log relay's names for database and schema.
func NamesFor(database, schema string) LogNames {
	schema = pgschema.Name(schema)
	pub := "idem_outbox"
	if schema != pgschema.Default {
		pub += "_" + schema
	}
	return LogNames{Slot: identifier("idem_" + database + "_" + schema), Publication: identifier(pub)}
}

// identifier makes s a lower-case identifier of at most 63 bytes, as slot names
// must be: other bytes become '_', and a name too long keeps its start and a hash
// of the whole, so two long names stay apart.
func identifier(s string) string {
	b := []byte(strings.ToLower(s))
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			b[i] = '_'
		}
	}
	if len(b) <= 63 {
		return string(b)
	}
	sum := sha256.Sum256([]byte(s))
	return string(b[:54]) + "_" + hex.EncodeToString(sum[:])[:8]
}

const (
	// sqlLogCapability: what the log relay needs of the server and the role: to
	// replicate, to own the outbox ($1, qualified; it sets the relay column's
	// default), and the publication ($2) or the right to create it.
	sqlLogCapability = `
SELECT current_setting('server_version_num')::int, current_setting('wal_level'),
       (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user),
       current_setting('max_replication_slots')::int, current_database(),
       COALESCE((SELECT pg_has_role(c.relowner, 'MEMBER') FROM pg_class c WHERE c.oid = to_regclass($1)), false),
       EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $2) OR has_database_privilege(current_database(), 'CREATE')`

	sqlPublicationExists = `SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)`

	// sqlSlot: the slot's state; no row when it does not exist.
	sqlSlot = `
SELECT active, COALESCE(active_pid, 0), COALESCE(wal_status, ''), COALESCE(confirmed_flush_lsn::text, ''),
       COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::bigint
FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()`

	sqlDropSlot = `SELECT pg_drop_replication_slot($1)`
)

// Capability is what the server and the role allow.
type Capability struct {
	// Mode is the relay that can run: ModeLog when everything the log relay needs
	// is there, else ModePoll, with Why.
	Mode Mode
	Why  string
	// Database is the pool's database.
	Database string
}

// LogCapability tells whether the log relay can run on pool's server as pool's
// role for the outbox of schema, and why not.
func LogCapability(ctx context.Context, pool *pgxpool.Pool, schema string) (Capability, error) {
	var version, slots int
	var walLevel, database string
	var replicate, owner, publication bool
	var db string
	if err := pool.QueryRow(ctx, sqlDatabase).Scan(&db); err != nil {
		return Capability{}, fmt.Errorf("relay: read the server's settings: %w", err)
	}
	outbox := pgx.Identifier{pgschema.Name(schema), "idem_outbox"}.Sanitize()
	err := pool.QueryRow(ctx, sqlLogCapability, outbox, NamesFor(db, schema).Publication).
		Scan(&version, &walLevel, &replicate, &slots, &database, &owner, &publication)
	if err != nil {
		return Capability{}, fmt.Errorf("relay: read the server's settings: %w", err)
	}
	c := Capability{Mode: ModePoll, Database: database}
	switch {
	case version < minLogServer:
		c.Why = fmt.Sprintf("the log relay needs PostgreSQL 14 or later; the server is %d", version)
	case walLevel != "logical":
		c.Why = fmt.Sprintf("wal_level is %s, the log relay needs logical (ALTER SYSTEM SET wal_level = logical, then restart Postgres)", walLevel)
	case !replicate:
		c.Why = "the database role may not replicate (ALTER ROLE ... REPLICATION lets the log relay read a slot)"
	case slots == 0:
		c.Why = "max_replication_slots is 0"
	case !owner:
		c.Why = "the database role does not own " + outbox + ", whose relay column the log relay sets"
	case !publication:
		c.Why = "the database role may not create the log relay's publication (GRANT CREATE ON DATABASE, or create it: docs/OPERATIONS.md, \"The relay\")"
	default:
		c.Mode, c.Why = ModeLog, "wal_level is logical and the role may replicate"
	}
	return c, nil
}

// slotState is a slot as pg_replication_slots shows it.
type slotState struct {
	exists    bool
	active    bool
	pid       int
	walStatus string // reserved, extended, unreserved, lost
	confirmed string
	lagBytes  int64
}

// Querier is what reads of the relay's state need: a pool, a connection or a
// transaction.
type Querier interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}

func readSlot(ctx context.Context, q Querier, slot string) (slotState, error) {
	s := slotState{exists: true}
	err := q.QueryRow(ctx, sqlSlot, slot).Scan(&s.active, &s.pid, &s.walStatus, &s.confirmed, &s.lagBytes)
	if errors.Is(err, pgx.ErrNoRows) {
		return slotState{}, nil
	}
	if err != nil {
		return slotState{}, fmt.Errorf("relay: read slot %s: %w", slot, err)
	}
	return s, nil
}

// State is which relay publishes an installation's outbox and, for the log
// relay, its slot, as an operator sees them.
type State struct {
	// Mode is the relay new rows belong to.
	Mode Mode `json:"mode"`
	// Slot is the log relay's slot (empty while the polling relay publishes).
	Slot string `json:"slot,omitempty"`
	// SlotExists, SlotActive (a relay streams it now) and SlotLost (Postgres
	// removed WAL it still needed: max_slot_wal_keep_size) describe the slot.
	SlotExists bool `json:"slot_exists"`
	SlotActive bool `json:"slot_active"`
	SlotLost   bool `json:"slot_lost"`
	// SlotLagBytes is the WAL written since the position the log relay last
	// confirmed: what the slot keeps, and what a relay starting now reads again.
	SlotLagBytes int64 `json:"slot_lag_bytes"`
}

// sqlDatabase is the database a querier is connected to.
const sqlDatabase = `SELECT current_database()`

// ReadState reads the relay's State of schema's outbox.
func ReadState(ctx context.Context, q Querier, st *store.Store, schema string) (State, error) {
	mode, err := relayDefault(ctx, q, st)
	if err != nil {
		return State{}, err
	}
	var database string
	if err := q.QueryRow(ctx, sqlDatabase).Scan(&database); err != nil {
		return State{}, fmt.Errorf("relay: %w", err)
	}
	s := State{Mode: mode}
	names := NamesFor(database, schema)
	slot, err := readSlot(ctx, q, names.Slot)
	if err != nil {
		return State{}, err
	}
	if slot.exists || s.Mode == ModeLog {
		s.Slot = names.Slot
	}
	s.SlotExists, s.SlotActive, s.SlotLost, s.SlotLagBytes = slot.exists, slot.active, slot.walStatus == "lost", slot.lagBytes
	return s, nil
}

// relayDefault reads which relay new rows belong to.
func relayDefault(ctx context.Context, q Querier, st *store.Store) (Mode, error) {
	var def string
	if err := q.QueryRow(ctx, st.Outbox.RelayDefault).Scan(&def); err != nil {
		return "", fmt.Errorf("relay: read the outbox's relay: %w", err)
	}
	if strings.HasPrefix(def, "'log'") {
		return ModeLog, nil
	}
	return ModePoll, nil
}

// setRelayDefault makes new rows belong to mode's relay. The ALTER TABLE waits for
// the transactions writing the outbox (bounded by lock_timeout, so the ingress
// waits at most that long behind it).
func setRelayDefault(ctx context.Context, pool *pgxpool.Pool, st *store.Store, mode Mode) error {
	if cur, err := relayDefault(ctx, pool, st); err != nil || cur == mode {
		return err
	}
	sql := st.Outbox.RelayToPoll
	if mode == ModeLog {
		sql = st.Outbox.RelayToLog
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("relay: hand the outbox to the %s relay: %w", mode, err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '5s'`); err != nil {
		return fmt.Errorf("relay: hand the outbox to the %s relay: %w", mode, err)
	}
	if _, err := tx.Exec(ctx, sql); err != nil {
		return fmt.Errorf("relay: hand the outbox to the %s relay (the role must own idem_outbox): %w", mode, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("relay: hand the outbox to the %s relay: %w", mode, err)
	}
	return nil
}

// ensurePublication creates the publication of the outbox's INSERTs when it does
// not exist. Rows of a partitioned outbox are published as the parent's.
func ensurePublication(ctx context.Context, pool *pgxpool.Pool, schema, name string) error {
	var exists bool
	if err := pool.QueryRow(ctx, sqlPublicationExists, name).Scan(&exists); err != nil {
		return fmt.Errorf("relay: publication %s: %w", name, err)
	}
	if exists {
		return nil
	}
	table := pgx.Identifier{pgschema.Name(schema), "idem_outbox"}.Sanitize()
	_, err := pool.Exec(ctx, "CREATE PUBLICATION "+pgx.Identifier{name}.Sanitize()+" FOR TABLE "+table+
		" WITH (publish = 'insert', publish_via_partition_root = true)")
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42710" { // duplicate_object: another relay made it
		return nil
	}
	if err != nil {
		return fmt.Errorf("relay: create publication %s (the role needs CREATE on the database and to own idem_outbox): %w", name, err)
	}
	return nil
}

// UsePolling hands schema's outbox back to the polling relay: new rows are its
// own, and the log relay's rows no window holds (never published) become its own
// too. A slot no relay reads is dropped, so it stops holding WAL.
func UsePolling(ctx context.Context, pool *pgxpool.Pool, st *store.Store, database, schema string) (handedOver int64, err error) {
	if err := setRelayDefault(ctx, pool, st, ModePoll); err != nil {
		return 0, err
	}
	tag, err := pool.Exec(ctx, st.Outbox.HandOverUnpublished, "the log relay stopped before publishing it", "infinity")
	if err != nil {
		return 0, fmt.Errorf("relay: hand the log relay's rows to the polling relay: %w", err)
	}
	names := NamesFor(database, schema)
	s, err := readSlot(ctx, pool, names.Slot)
	if err != nil {
		return tag.RowsAffected(), err
	}
	if s.exists && !s.active {
		if _, err := pool.Exec(ctx, sqlDropSlot, names.Slot); err != nil {
			return tag.RowsAffected(), fmt.Errorf("relay: drop the log relay's slot %s: %w", names.Slot, err)
		}
	}
	return tag.RowsAffected(), nil
}
