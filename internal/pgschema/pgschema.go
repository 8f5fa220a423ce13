// Package pgschema places idem's tables in the Postgres schema a user chose.
//
// Every package writes its SQL against the plain table names (idem_outbox,
// idem_inbox, ...), so the SQL reads as it runs in the default schema. Qualify
// rewrites those names once, when a component is built, for any other schema; the
// hot path pays nothing. Migrations do not need it: they run with the schema as
// their search_path, so the DDL (index names included) lands there.
package pgschema

import (
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"
)

// Default is the schema used when none is configured.
const Default = "public"

// tables matches a reference to one of idem's tables: the whole identifier, not a
// prefix of a longer one (an index such as idem_outbox_unpublished), and not one
// already qualified.
var tables = regexp.MustCompile(`(^|[^.\w"])(idem_(?:requests|outbox|inbox|dead_letters|consumers|attempts|schema_migrations))\b`)

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
