package refapp

import (
	"context"
	_ "embed"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// SchemaSQL creates the application's tables (payments, emails, ledger_entries);
// every statement is idempotent. `worker migrate --print` prints it after idem's.
//
//go:embed schema.sql
var SchemaSQL string

// Migrate creates the application's tables when they are absent.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	// CREATE TABLE IF NOT EXISTS is not safe against itself: two workers starting
	// at once on a fresh database both try to create the table (and its row type),
	// and one fails. A transaction-scoped advisory lock serialises them.
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, migrateLock); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, SchemaSQL)
		return err
	})
	if err != nil {
		return fmt.Errorf("refapp: migrate: %w", err)
	}
	return nil
}

// migrateLock is the advisory lock of Migrate ("refapp" in ASCII), apart from
// idem's own migrations' lock.
const migrateLock = 0x726566617070
