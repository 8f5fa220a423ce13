package ops

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
)

// EffectsFunc reads what an application did for one key: its own rows (a payment,
// a ledger entry, a shipment) and what about them deserves an operator's
// attention. It runs inside Inspect's read-only snapshot, on tx, so its rows agree
// with idem's. scope and key are as the client sent them; past the ingress the
// application's consumers see idem.ScopedKey(scope, key).
type EffectsFunc func(ctx context.Context, tx pgx.Tx, scope string, key idem.Key) (Effects, error)

// Effects is an application's view of one key.
type Effects struct {
	// Tables are the application's rows for the key, one entry per table read
	// (with or without rows).
	Tables []EffectTable `json:"tables"`
	// Attention are application-level warnings, such as "DOUBLE EFFECT: 2 ledger
	// entries for one key".
	Attention []string `json:"attention"`
}

// rows counts the rows of every table.
func (e Effects) rows() int {
	n := 0
	for _, t := range e.Tables {
		n += len(t.Rows)
	}
	return n
}

// normalized returns e with every list non-nil, so JSON shows [] rather than null.
func (e Effects) normalized() Effects {
	out := Effects{Tables: make([]EffectTable, len(e.Tables)), Attention: e.Attention}
	if out.Attention == nil {
		out.Attention = []string{}
	}
	for i, t := range e.Tables {
		if t.Columns == nil {
			t.Columns = []string{}
		}
		if t.Rows == nil {
			t.Rows = [][]string{}
		}
		out.Tables[i] = t
	}
	return out
}

// EffectTable is some rows of one application table, as text: generic enough for a
// terminal, JSON and a web page alike.
type EffectTable struct {
	Name    string     `json:"name"`
	Columns []string   `json:"columns"`
	Rows    [][]string `json:"rows"` // each row has one value per column
}

// Null is how QueryTable shows SQL NULL.
const Null = "NULL"

// QueryTable runs sql on tx and returns its rows as an EffectTable called name: the
// column names of the result, and every value as Postgres writes it as text
// (timestamps in the session's time zone, bytea as \x hex, NULL as Null). It is the
// usual body of an EffectsFunc:
//
//	t, err := ops.QueryTable(ctx, tx, "orders", `SELECT id, total, created_at FROM orders WHERE idempotency_key = $1 ORDER BY id`, scopedKey)
func QueryTable(ctx context.Context, tx pgx.Tx, name, sql string, args ...any) (EffectTable, error) {
	// Text results: Postgres renders every type (numeric, uuid, jsonb, arrays)
	// itself, so no Go type needs to be known here.
	rows, err := tx.Query(ctx, sql, append([]any{pgx.QueryResultFormats{pgx.TextFormatCode}}, args...)...)
	if err != nil {
		return EffectTable{}, fmt.Errorf("ops: %s: %w", name, err)
	}
	defer rows.Close()
	t := EffectTable{Name: name, Columns: []string{}, Rows: [][]string{}}
	for _, fd := range rows.FieldDescriptions() {
		t.Columns = append(t.Columns, fd.Name)
	}
	for rows.Next() {
		raw := rows.RawValues()
		row := make([]string, len(raw))
		for i, v := range raw {
			if v == nil {
				row[i] = Null
			} else {
				row[i] = string(v)
			}
		}
		t.Rows = append(t.Rows, row)
	}
	if err := rows.Err(); err != nil {
		return EffectTable{}, fmt.Errorf("ops: %s: %w", name, err)
	}
	return t, nil
}
