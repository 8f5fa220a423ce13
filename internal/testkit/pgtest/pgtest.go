// Package pgtest gives each test its own real Postgres database with idem's schema
// applied, so tests run in parallel without seeing each other's rows.
//
// It connects to the server named by DATABASE_URL (default: the local trust-auth
// server), creates idem_t_<random>, migrates it (idem's tables only) and drops it
// when the test ends.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/migrations"
)

// DefaultURL is the database the tests use when DATABASE_URL is unset.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// AdminURL returns DATABASE_URL or the default.
func AdminURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// DB is one test's database.
type DB struct {
	Pool *pgxpool.Pool
	// URL connects to this database (for subprocesses and second pools).
	URL  string
	Name string

	adminURL string // where it was created, and is dropped
}

// Options shape a test database. The zero value is a database with idem's schema
// applied in public.
type Options struct {
	// AdminURL names the server the database is created on (default AdminURL():
	// $DATABASE_URL, else DefaultURL). Its role must be allowed to CREATE DATABASE.
	AdminURL string
	// Schema is where idem's tables go (default public).
	Schema string
	// MaxConns sizes the database's pool (default 16).
	MaxConns int32
	// NoMigrate leaves the database empty.
	NoMigrate bool
	// Partitioned converts idem_inbox and idem_outbox to partitioned tables
	// (package partition) after the migrations. IDEM_TEST_PARTITIONED=1 sets it
	// for every test database, to run a package's tests against that layout.
	Partitioned bool
}

// partitionedByEnv reports IDEM_TEST_PARTITIONED=1.
func partitionedByEnv() bool { return os.Getenv("IDEM_TEST_PARTITIONED") == "1" }

// PollRole is the role a test database belongs to, and is used through, under
// IDEM_TEST_RELAY=poll: one that may not replicate, so that every worker and
// relay a test starts runs the polling relay, as it does where the log relay
// cannot run. Otherwise tests use the admin role, which may (on a server with
// wal_level = logical), and run the log relay.
const PollRole = "idem_test_poll"

// pollByEnv reports IDEM_TEST_RELAY=poll.
func pollByEnv() bool { return os.Getenv("IDEM_TEST_RELAY") == "poll" }

// sqlPollRole makes PollRole when it is missing. Two test processes may race to
// make it; the loser's duplicate_object is ignored.
const sqlPollRole = `DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '` + PollRole + `') THEN
    CREATE ROLE ` + PollRole + ` LOGIN CREATEDB NOREPLICATION;
  END IF;
END $$`

// New creates a fresh migrated database for t and drops it at cleanup.
func New(t testing.TB) *DB {
	t.Helper()
	return NewWith(t, Options{})
}

// NewWith creates a fresh database shaped by opts and drops it at cleanup.
func NewWith(t testing.TB, opts Options) *DB {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	db, err := Create(ctx, opts)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		if err := db.Drop(); err != nil {
			t.Logf("pgtest: %v", err)
		}
	})
	return db
}

// Unreachable returns a pool of a server that is not there (port 1 of the
// loopback), closed at cleanup. Creating the pool connects nowhere; any query
// fails within a second. A test that must show a setup step touches no database
// (config validation, say) hands it this pool: a step that queried would fail.
func Unreachable(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://idem@127.0.0.1:1/none?connect_timeout=1&pool_max_conns=64")
	if err != nil {
		t.Fatalf("pgtest: unreachable pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Create creates a fresh database shaped by opts on the server at AdminURL: what
// New does without a test, for TestMain, Example functions and other kits. Drop it
// when done.
func Create(ctx context.Context, opts Options) (*DB, error) {
	if opts.AdminURL == "" {
		opts.AdminURL = AdminURL()
	}
	if opts.MaxConns == 0 {
		opts.MaxConns = 16
	}
	u, err := url.Parse(opts.AdminURL)
	if err != nil {
		return nil, fmt.Errorf("parse the database URL: %w", err)
	}
	admin, err := pgx.Connect(ctx, opts.AdminURL)
	if err != nil {
		return nil, fmt.Errorf("connect to %s (is Postgres running? see .ci/run): %w", u.Redacted(), err)
	}
	defer admin.Close(ctx)

	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "idem_t_" + hex.EncodeToString(b[:])
	create := "CREATE DATABASE " + name
	if pollByEnv() {
		_, err := admin.Exec(ctx, sqlPollRole)
		var pgErr *pgconn.PgError
		if err != nil && !(errors.As(err, &pgErr) && (pgErr.Code == "42710" || pgErr.Code == "23505")) {
			return nil, fmt.Errorf("create role %s for IDEM_TEST_RELAY=poll: %w", PollRole, err)
		}
		create += " OWNER " + PollRole
		u.User = url.User(PollRole)
	}
	if _, err := admin.Exec(ctx, create); err != nil {
		return nil, fmt.Errorf("create database: %w", err)
	}
	u.Path = "/" + name
	db := &DB{URL: u.String(), Name: name, adminURL: opts.AdminURL}
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		return nil, errors.Join(err, db.Drop())
	}
	cfg.MaxConns = opts.MaxConns
	if db.Pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, errors.Join(fmt.Errorf("open pool: %w", err), db.Drop())
	}
	if opts.NoMigrate {
		return db, nil
	}
	if _, err := migrations.Apply(ctx, db.Pool, migrations.Config{Schema: opts.Schema}); err != nil {
		return nil, errors.Join(fmt.Errorf("migrate: %w", err), db.Drop())
	}
	if opts.Partitioned || partitionedByEnv() {
		pc := partition.Config{Schema: opts.Schema}
		if _, err := partition.Convert(ctx, db.Pool, pc); err != nil {
			return nil, errors.Join(err, db.Drop())
		}
		if _, err := partition.Maintain(ctx, db.Pool, pc); err != nil {
			return nil, errors.Join(err, db.Drop())
		}
	}
	return db, nil
}

// Drop closes the database's pool and drops it, with FORCE: a killed subprocess
// may still hold a connection.
func (db *DB) Drop() error {
	if db.Pool != nil {
		db.Pool.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, db.adminURL)
	if err != nil {
		return fmt.Errorf("drop %s: %w", db.Name, err)
	}
	defer c.Close(ctx)
	// FORCE ends the database's connections, a log relay's walsender among them;
	// until that one has gone its slot is active, and the drop refused (55006).
	// Postgres drops the database's inactive slots with it.
	for {
		_, err := c.Exec(ctx, "DROP DATABASE IF EXISTS "+db.Name+" WITH (FORCE)")
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55006" && ctx.Err() == nil {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		if err != nil {
			return fmt.Errorf("drop %s: %w", db.Name, err)
		}
		return nil
	}
}

// Count runs a COUNT-style query and returns the integer.
func (db *DB) Count(t testing.TB, query string, args ...any) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatalf("pgtest: %s: %v", query, err)
	}
	return n
}

// String formats the database for messages.
func (db *DB) String() string { return fmt.Sprintf("pgtest.DB(%s)", db.Name) }
