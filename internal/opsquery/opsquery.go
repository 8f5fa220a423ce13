// Package opsquery reads what the worker's operator commands show: the whole life
// of one idempotency key (Inspect), and counts and lags across the tables and the
// JetStream stream (ReadStats, ReadJetStream).
//
// It only reads. Each function runs in one read-only REPEATABLE READ transaction,
// so what it returns is one snapshot: a row that moves from the outbox to an inbox
// while the command runs is shown on one side of the move, never both or neither.
package opsquery

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
)

// DB is what opsquery needs of a database handle: *pgxpool.Pool and *pgx.Conn
// both qualify.
type DB interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// snapshot runs f in a read-only, repeatable-read transaction.
func snapshot(ctx context.Context, db DB, f func(pgx.Tx) error) error {
	return pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, f)
}

// Bytes is a bytea column shown to people and to JSON: as text when it is UTF-8
// (payloads and responses are JSON bodies), otherwise as "base64:" and the
// base64 encoding. Text that itself starts with "base64:" is encoded too, so the
// form is never ambiguous and UnmarshalJSON restores the exact bytes.
type Bytes []byte

const base64Prefix = "base64:"

// String returns the text, or "base64:..." for binary data.
func (b Bytes) String() string {
	if utf8.Valid(b) && !strings.HasPrefix(string(b), base64Prefix) {
		return string(b)
	}
	return base64Prefix + base64.StdEncoding.EncodeToString(b)
}

// MarshalJSON implements json.Marshaler.
func (b Bytes) MarshalJSON() ([]byte, error) {
	if b == nil {
		return []byte("null"), nil
	}
	return json.Marshal(b.String())
}

// UnmarshalJSON implements json.Unmarshaler, reversing MarshalJSON.
func (b *Bytes) UnmarshalJSON(data []byte) error {
	if string(data) == "null" {
		*b = nil
		return nil
	}
	var s string
	if err := json.Unmarshal(data, &s); err != nil {
		return err
	}
	enc, ok := strings.CutPrefix(s, base64Prefix)
	if !ok {
		*b = Bytes(s)
		return nil
	}
	raw, err := base64.StdEncoding.DecodeString(enc)
	if err != nil {
		return fmt.Errorf("opsquery: %w", err)
	}
	*b = raw
	return nil
}

// queryAll runs sql and collects every row with scan.
func queryAll[T any](ctx context.Context, tx pgx.Tx, what, sql string, scan func(pgx.CollectableRow) (T, error), args ...any) ([]T, error) {
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("opsquery: %s: %w", what, err)
	}
	out, err := pgx.CollectRows(rows, scan)
	if err != nil {
		return nil, fmt.Errorf("opsquery: %s: %w", what, err)
	}
	if out == nil {
		out = []T{} // JSON shows an empty list, not null
	}
	return out, nil
}

// age is how long before asOf t was, never negative (clocks of different hosts).
func age(asOf, t time.Time) time.Duration {
	return max(asOf.Sub(t), 0)
}
