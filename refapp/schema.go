package refapp

import (
	"context"
	_ "embed"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
)

// SchemaSQL creates the application's tables (payments, emails, ledger_entries);
// every statement is idempotent. `worker migrate --print` prints it after idem's.
//
//go:embed schema.sql
var SchemaSQL string

// Migrate creates the application's tables when they are absent.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if _, err := pool.Exec(ctx, SchemaSQL); err != nil {
		return fmt.Errorf("refapp: migrate: %w", err)
	}
	return nil
}
