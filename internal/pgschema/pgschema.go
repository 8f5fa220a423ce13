// Package pgschema places idem's tables in the Postgres schema a user chose.
//
// Every package writes its SQL against the plain table names (idem_outbox,
// idem_inbox, ...), so the SQL reads as it runs in the default schema. Qualify
// rewrites those names once, when a component is built, for any other schema; the
// hot path pays nothing. Migrations do not need it: they run with the schema as
// their search_path, so the DDL (index names included) lands there.
package pgschema

import (
	"context"
	"errors"
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"
)

// Default is the schema used when none is configured.
const Default = "public"

// tables matches a reference to one of idem's tables: the whole identifier, not a
// prefix of a longer one (an index such as idem_outbox_unpublished), and not one
// already qualified.
var tables = regexp.MustCompile(`(^|[^.\w"])(idem_(?:requests|outbox_published|outbox|inbox|dead_letters|consumers|attempts|installation|schema_migrations))\b`)

var ident = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// Validate checks a schema name. Only lower-case unquoted identifiers are accepted,
// so that the name means the same quoted and unquoted, in SQL and in psql.
func Validate(schema string) error {
	if schema == "" || ident.MatchString(schema) {
		return nil
	}
	return fmt.Errorf("schema %q: want a lower-case identifier (a-z, 0-9, _; at most 63 bytes)", schema)
}

// Name returns schema, or Default when it is empty.
func Name(schema string) string {
	if schema == "" {
		return Default
	}
	return schema
}

// Qualify returns sql with every idem table qualified by schema. In the default
// schema it returns sql unchanged.
func Qualify(schema, sql string) string {
	schema = Name(schema)
	if schema == Default {
		return sql
	}
	q := pgx.Identifier{schema}.Sanitize()
	return tables.ReplaceAllString(sql, "${1}"+q+".${2}")
}

// Channel is the LISTEN/NOTIFY channel named base for schema: base itself in the
// default schema, base_schema otherwise, so two installations in one database do not
// wake each other.
func Channel(schema, base string) string {
	schema = Name(schema)
	if schema == Default {
		return base
	}
	return base + "_" + schema
}

// Row is what Partitioned needs from a pool, connection or transaction.
type Row interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// sqlRelkind is a table's relkind: 'p' partitioned, 'r' plain; no row if absent.
const sqlRelkind = `
SELECT c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname = $2`

// Partitioned reports whether table (unqualified, e.g. "idem_inbox") is a
// partitioned table in schema. A table that does not exist is not partitioned.
func Partitioned(ctx context.Context, q Row, schema, table string) (bool, error) {
	var kind string
	err := q.QueryRow(ctx, sqlRelkind, Name(schema), table).Scan(&kind)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("pgschema: is %s.%s partitioned: %w", Name(schema), table, err)
	}
	return kind == "p", nil
}
