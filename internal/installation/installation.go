// Package installation names an installation of idem: the database cluster, the
// database and the schema that hold its tables. A JetStream durable consumer
// belongs to one installation (its inbox is there), and the name is what the
// durable records in its metadata.
package installation

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgschema"
)

// MetadataKey is the durable consumer's metadata entry that names the installation
// it belongs to.
const MetadataKey = "idem.installation"

// Row is what Of needs of a pool, connection or transaction.
type Row interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Of names the installation whose tables are in schema of db's database:
// "<cluster's system identifier>/<database>/<schema>". A copy of the database in
// another cluster, another database of the same cluster, and another schema of the
// same database are each another installation.
func Of(ctx context.Context, db Row, schema string) (string, error) {
	var cluster, database string
	if err := db.QueryRow(ctx, sqlOf).Scan(&cluster, &database); err != nil {
		return "", fmt.Errorf("installation: %w", err)
	}
	return cluster + "/" + database + "/" + pgschema.Name(schema), nil
}

const sqlOf = `SELECT system_identifier::text, current_database()::text FROM pg_control_system()`
