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
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
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
	if _, err := c.Exec(ctx, "DROP DATABASE IF EXISTS "+db.Name+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop %s: %w", db.Name, err)
	}
	return nil
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
