package partition

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgschema"
)

// ConvertReport says what Convert did to each table.
type ConvertReport struct {
	// Converted are the tables that were plain and are now partitioned.
	Converted []Table `json:"converted"`
	// Already are the tables that were partitioned before.
	Already []Table `json:"already_partitioned"`
}

// Convert turns idem_inbox and idem_outbox into partitioned tables, in place and
// idempotently; then Maintain creates their ranged partitions.
//
// Each table is converted in one transaction: the plain table is renamed to
// <table>_default, a partitioned table with the same columns, defaults and index
// names takes its name, and the old table is attached as its DEFAULT partition.
// No row is copied. The old primary key gives way to the partitioned one, which
// adds the partition key (a partitioned table's unique indexes must contain it);
// the advisory-lock claim of package dedupe keeps each delivery unique across
// partitions instead. The conversion holds an ACCESS EXCLUSIVE lock on the table
// for as long as Postgres takes to build the partitioned primary key's index on
// the existing rows (a few seconds per million rows here), so convert an existing
// installation in a quiet moment; an empty one converts at once.
//
// The tables must exist: run the migrations first.
func Convert(ctx context.Context, pool *pgxpool.Pool, cfg Config) (ConvertReport, error) {
	if err := cfg.Validate(); err != nil {
		return ConvertReport{}, err
	}
	cfg = cfg.withDefaults()
	var r ConvertReport
	for _, t := range Tables() {
		done, err := convertTable(ctx, pool, cfg.Schema, t)
		if err != nil {
			return r, err
		}
		if done {
			r.Converted = append(r.Converted, t)
		} else {
			r.Already = append(r.Already, t)
		}
	}
	return r, nil
}

// convertTable converts t, and reports false if it was partitioned already.
func convertTable(ctx context.Context, pool *pgxpool.Pool, schema string, t Table) (bool, error) {
	converted := false
	err := inTx(ctx, pool, 0, func(tx pgx.Tx) error {
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, ident(schema, string(t))).Scan(&exists); err != nil {
			return err
		}
		if !exists {
			return errors.New("no such table: run the migrations first")
		}
		partitioned, err := pgschema.Partitioned(ctx, tx, schema, string(t))
		if err != nil || partitioned {
			return err
		}
		table, def := ident(schema, string(t)), ident(schema, defaultName(t))
		s := t.spec()
		if _, err := tx.Exec(ctx, sqlf(sqlConvertLock, table)); err != nil {
			return err
		}
		// The secondary indexes, read before the rename so their definitions name
		// the table the partitioned one will be.
		rows, err := tx.Query(ctx, sqlIndexes, schema, string(t))
		if err != nil {
			return err
		}
		type index struct{ name, def string }
		indexes, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (index, error) {
			var i index
			return i, r.Scan(&i.name, &i.def)
		})
		if err != nil {
			return err
		}
		var pkey string
		var pkCols []string
		if err := tx.QueryRow(ctx, sqlPrimaryKey, table).Scan(&pkey, &pkCols); err != nil {
			return fmt.Errorf("primary key: %w", err)
		}
		s.primaryKey = primaryKeyWith(pkCols, s.key)
		var seq *string
		if t == Outbox {
			if err := tx.QueryRow(ctx, sqlOwnSequence, table).Scan(&seq); err != nil {
				return err
			}
		}
		steps := []string{
			sqlf(sqlConvertRename, table, def, s.key, s.primaryKey, defaultName(t)),
			sqlf(sqlDropConstraint, def, pgx.Identifier{pkey}.Sanitize()),
		}
		for _, i := range indexes {
			steps = append(steps, sqlf(sqlRenameIndex, ident(schema, i.name), pgx.Identifier{indexAside(i.name)}.Sanitize()))
		}
		steps = append(steps,
			sqlf(sqlConvertCreate, table, def, s.key),
			sqlf(sqlConvertPK, table, def, s.key, s.primaryKey),
		)
		for _, i := range indexes {
			steps = append(steps, i.def)
		}
		if t == Outbox {
			steps = append(steps, sqlf(sqlOutboxUnexpired, table))
			if seq != nil {
				steps = append(steps, sqlf(sqlSequenceOwnedBy, *seq, table))
			}
		}
		steps = append(steps, sqlf(sqlConvertAttach, table, def))
		for _, sql := range steps {
			if _, err := tx.Exec(ctx, sql); err != nil {
				return fmt.Errorf("%s: %w", sql, err)
			}
		}
		converted = true
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("partition: convert %s.%s: %w", schema, t, err)
	}
	return converted, nil
}

// primaryKeyWith is the partitioned table's primary key: the plain table's
// columns, then the partition key, which every unique index of a partitioned
// table must hold.
func primaryKeyWith(cols []string, key string) string {
	var b strings.Builder
	for _, c := range cols {
		if c == key {
			continue
		}
		b.WriteString(pgx.Identifier{c}.Sanitize())
		b.WriteString(", ")
	}
	b.WriteString(key)
	return b.String()
}

// indexAside is the name an index of the old table takes once it belongs to the
// default partition: its own with "_d", within Postgres's 63 bytes.
func indexAside(name string) string {
	const suffix = "_d"
	if len(name)+len(suffix) > 63 {
		name = name[:63-len(suffix)]
	}
	return name + suffix
}
