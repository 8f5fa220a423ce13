// Package migrations holds idem's SQL schema (the idem_* tables and nothing else),
// embedded in the binary, and applies it.
//
// Apply is idempotent and safe to run from several workers at once: it takes a
// Postgres advisory lock, applies every file whose version is not yet recorded in
// idem_schema_migrations, and records it, each file in its own transaction. The
// tables go into Config.Schema (default public), created when absent.
//
// Teams that run their migrations with their own tool (goose, atlas, Flyway) take
// the same SQL from SQL (or `worker migrate --print`) and turn the worker's own
// migration off (worker.Config.NoMigrate, `--no-migrate`). The script records the
// versions it creates, so a later Apply finds nothing to do.
package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgschema"
)

//go:embed *.sql
var files embed.FS

// lockID is the advisory lock serialising concurrent migrators ("idem" in ASCII).
const lockID = 0x6964656d

// Config says where the schema goes. The zero value means the defaults.
type Config struct {
	// Schema is the Postgres schema holding the idem_* tables (default "public").
	// Every idem component of one installation must be given the same schema.
	Schema string
}

func (c Config) validate() error {
	if err := pgschema.Validate(c.Schema); err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	return nil
}

// Migration is one embedded schema file.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// All returns the embedded migrations in version order.
func All() ([]Migration, error) {
	entries, err := fs.ReadDir(files, ".")
	if err != nil {
		return nil, fmt.Errorf("migrations: read embedded files: %w", err)
	}
	var out []Migration
	for _, e := range entries {
		name := e.Name()
		num, _, ok := strings.Cut(name, "_")
		if !ok {
			return nil, fmt.Errorf("migrations: %s: name must be NNN_description.sql", name)
		}
		v, err := strconv.Atoi(num)
		if err != nil {
			return nil, fmt.Errorf("migrations: %s: bad version: %w", name, err)
		}
		body, err := files.ReadFile(name)
		if err != nil {
			return nil, fmt.Errorf("migrations: read %s: %w", name, err)
		}
		out = append(out, Migration{Version: v, Name: name, SQL: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Apply brings the schema up to date and returns the names of the files it applied
// (empty when the schema was already current).
func Apply(ctx context.Context, pool *pgxpool.Pool, cfg Config) ([]string, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	all, err := All()
	if err != nil {
		return nil, err
	}
	schema := pgschema.Name(cfg.Schema)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrations: acquire connection: %w", err)
	}
	defer conn.Release()

	if _, err := conn.Exec(ctx, sqlLock, lockID); err != nil {
		return nil, fmt.Errorf("migrations: advisory lock: %w", err)
	}
	// Unlock with a fresh context: the caller's may be cancelled by now.
	defer conn.Exec(context.WithoutCancel(ctx), sqlUnlock, lockID) //nolint:errcheck

	var applied []int32
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if err := setSearchPath(ctx, tx, schema); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, sqlCreateVersionTable); err != nil {
			return fmt.Errorf("create version table: %w", err)
		}
		rows, err := tx.Query(ctx, sqlApplied)
		if err != nil {
			return fmt.Errorf("read applied versions: %w", err)
		}
		applied, err = pgx.CollectRows(rows, pgx.RowTo[int32])
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("migrations: schema %s: %w", schema, err)
	}
	done := make(map[int]bool, len(applied))
	for _, v := range applied {
		done[int(v)] = true
	}

	var ran []string
	for _, m := range all {
		if done[m.Version] {
			continue
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if err := setSearchPath(ctx, tx, schema); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, sqlRecord, m.Version, m.Name)
			return err
		})
		if err != nil {
			return ran, fmt.Errorf("migrations: apply %s to schema %s: %w", m.Name, schema, err)
		}
		ran = append(ran, m.Name)
	}
	return ran, nil
}

// ErrNotMigrated is returned (wrapped) by Check when the schema lacks migrations.
var ErrNotMigrated = errors.New("migrations: schema not migrated")

// howToMigrate ends Check's error. Most readers embed the library and have no
// `worker` binary, so the library's calls come first.
const howToMigrate = "apply it with migrations.Apply (what a worker does at Start without NoMigrate), " +
	"or run the script migrations.SQL returns with your migration tool (the reference binary: `worker migrate`, or `worker migrate --print` for the script)"

// Check reports whether every embedded migration has been applied to the schema,
// without changing anything: what a worker started with NoMigrate verifies, so that
// a missing migration is a clear error at start rather than failed statements later.
func Check(ctx context.Context, db *pgxpool.Pool, cfg Config) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	all, err := All()
	if err != nil {
		return err
	}
	schema := pgschema.Name(cfg.Schema)
	var applied []int32
	rows, err := db.Query(ctx, pgschema.Qualify(schema, sqlApplied))
	if err == nil {
		applied, err = pgx.CollectRows(rows, pgx.RowTo[int32])
	}
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
			return fmt.Errorf("%w: schema %s has no idem_schema_migrations table: %s", ErrNotMigrated, schema, howToMigrate)
		}
		return fmt.Errorf("migrations: check schema %s: %w", schema, err)
	}
	done := make(map[int]bool, len(applied))
	for _, v := range applied {
		done[int(v)] = true
	}
	var missing []string
	for _, m := range all {
		if !done[m.Version] {
			missing = append(missing, m.Name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: schema %s lacks %s: %s", ErrNotMigrated, schema, strings.Join(missing, ", "), howToMigrate)
	}
	return nil
}

// Versions returns the newest migration applied to the schema and the newest this
// build embeds. During a rolling upgrade the old release's processes keep running
// on the new schema; what must not run old logic past a migration (the
// reconciler, whose re-drives a newer release may address differently) compares
// the two and stands down when applied is the greater.
func Versions(ctx context.Context, db *pgxpool.Pool, cfg Config) (applied, known int, err error) {
	if err := cfg.validate(); err != nil {
		return 0, 0, err
	}
	all, err := All()
	if err != nil {
		return 0, 0, err
	}
	schema := pgschema.Name(cfg.Schema)
	if err := db.QueryRow(ctx, pgschema.Qualify(schema, sqlNewest)).Scan(&applied); err != nil {
		return 0, 0, fmt.Errorf("migrations: versions of schema %s: %w", schema, err)
	}
	return applied, all[len(all)-1].Version, nil
}

// setSearchPath creates the schema when needed and makes it the only one searched
// for the rest of the transaction, so the DDL (tables, indexes) lands there.
func setSearchPath(ctx context.Context, tx pgx.Tx, schema string) error {
	if schema != pgschema.Default {
		if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize()); err != nil {
			return fmt.Errorf("create schema: %w", err)
		}
	}
	if _, err := tx.Exec(ctx, sqlSearchPath, schema); err != nil {
		return fmt.Errorf("set search_path: %w", err)
	}
	return nil
}

// SQL returns the whole schema as one script for other migration tools: it creates
// the schema, the tables and the version table, and records every version, so that a
// later Apply (a worker started without NoMigrate) has nothing left to do. Every
// statement is idempotent.
func SQL(cfg Config) (string, error) {
	if err := cfg.validate(); err != nil {
		return "", err
	}
	all, err := All()
	if err != nil {
		return "", err
	}
	schema := pgschema.Name(cfg.Schema)
	ident := pgx.Identifier{schema}.Sanitize()
	var b strings.Builder
	fmt.Fprintf(&b, "-- idem schema (%d migrations), for schema %s.\nBEGIN;\n", len(all), schema)
	if schema != pgschema.Default {
		fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n", ident)
	}
	fmt.Fprintf(&b, "SET LOCAL search_path TO %s;\n%s;\n", ident, sqlCreateVersionTable)
	for _, m := range all {
		fmt.Fprintf(&b, "\n-- %s\n%s\n", m.Name, strings.TrimSpace(m.SQL))
		fmt.Fprintf(&b, "INSERT INTO idem_schema_migrations (version, name) VALUES (%d, '%s') ON CONFLICT DO NOTHING;\n", m.Version, m.Name)
	}
	b.WriteString("COMMIT;\n")
	return b.String(), nil
}

const (
	sqlCreateVersionTable = `CREATE TABLE IF NOT EXISTS idem_schema_migrations (
	version    int PRIMARY KEY,
	name       text NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now())`
	sqlLock       = `SELECT pg_advisory_lock($1)`
	sqlUnlock     = `SELECT pg_advisory_unlock($1)`
	sqlSearchPath = `SELECT set_config('search_path', quote_ident($1), true)`
	sqlApplied    = `SELECT version FROM idem_schema_migrations`
	sqlNewest     = `SELECT COALESCE(max(version), 0) FROM idem_schema_migrations`
	sqlRecord     = `INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)`
)
