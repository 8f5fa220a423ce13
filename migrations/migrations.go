// Package migrations holds idem's SQL schema, embedded in the binary, and applies it.
//
// Apply is idempotent and safe to run from several workers at once: it takes a
// Postgres advisory lock, applies every file whose version is not yet recorded in
// idem_schema_migrations, and records it, each file in its own transaction.
package migrations

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed *.sql
var files embed.FS

// lockID is the advisory lock serialising concurrent migrators ("idem" in ASCII).
const lockID = 0x6964656d

const (
	sqlCreateTable = `CREATE TABLE IF NOT EXISTS idem_schema_migrations (
		version    int PRIMARY KEY,
		name       text NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`
	sqlLock    = `SELECT pg_advisory_lock($1)`
	sqlUnlock  = `SELECT pg_advisory_unlock($1)`
	sqlApplied = `SELECT version FROM idem_schema_migrations`
	sqlRecord  = `INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)`
)

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

// Apply brings the database schema up to date and returns the names of the files it
// applied (empty when the schema was already current).
func Apply(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	all, err := All()
	if err != nil {
		return nil, err
	}
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

	if _, err := conn.Exec(ctx, sqlCreateTable); err != nil {
		return nil, fmt.Errorf("migrations: create version table: %w", err)
	}
	rows, err := conn.Query(ctx, sqlApplied)
	if err != nil {
		return nil, fmt.Errorf("migrations: read applied versions: %w", err)
	}
	applied, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("migrations: read applied versions: %w", err)
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
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, sqlRecord, m.Version, m.Name)
			return err
		})
		if err != nil {
			return ran, fmt.Errorf("migrations: apply %s: %w", m.Name, err)
		}
		ran = append(ran, m.Name)
	}
	return ran, nil
}
