// Package installation names an installation of idem: the tables of one schema of
// one database, wherever that database lives. Its name is a random token, made by
// the migration that creates idem_installation, so that a rename, pg_upgrade or a
// dump and restore keep it. A JetStream durable consumer belongs to one
// installation (its inbox is there) and records the token in its metadata, with
// the epoch of its last binding: a physical copy of the database carries the
// token too, and the epoch is what tells it from the original.
package installation

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/internal/pgschema"
)

// The durable consumer's metadata entries.
const (
	// MetadataKey names the installation the old way, by cluster, database and
	// schema (Of). Still written, for the workers of a rolling upgrade; read only
	// to adopt a durable bound before tokens.
	MetadataKey = "idem.installation"
	// TokenKey is the installation's token (State.Token).
	TokenKey = "idem.token"
	// EpochKey is the epoch of the durable's last binding (State.Epoch).
	EpochKey = "idem.epoch"
	// BindingKey names the durable's last binding (State.Binding): two databases
	// that bound at the same epoch (a copy and its original, at once) differ here.
	BindingKey = "idem.binding"
)

// Row is what the functions here need of a pool, connection or transaction.
type Row interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Of names the installation whose tables are in schema of db's database the old
// way: "<cluster's system identifier>/<database>/<schema>". A physical copy of
// the database carries it, and a rename or pg_upgrade changes it: it identifies
// nothing by itself any more, and serves to adopt durables recorded with it and in
// messages.
func Of(ctx context.Context, db Row, schema string) (string, error) {
	var cluster, database string
	if err := db.QueryRow(ctx, sqlOf).Scan(&cluster, &database); err != nil {
		return "", fmt.Errorf("installation: %w", err)
	}
	return cluster + "/" + database + "/" + pgschema.Name(schema), nil
}

const sqlOf = `SELECT system_identifier::text, current_database()::text FROM pg_control_system()`

// State is the installation's row: its token, and the epoch and name of its last
// binding. The name is random, made by each binding; it is "" before the first
// and after an adoption.
type State struct {
	Token   string
	Epoch   int64
	Binding string
}

// Load reads the installation's row.
func Load(ctx context.Context, db Row, schema string) (State, error) {
	var s State
	err := db.QueryRow(ctx, pgschema.Qualify(schema, sqlLoad)).Scan(&s.Token, &s.Epoch, &s.Binding)
	return s, wrap("load", err)
}

// Bump starts a binding: it adds one to the epoch, names the binding and returns
// the row, unless the durable that recorded r was bound since by another database
// (Ahead), when it changes nothing and returns ok false. One statement, so that
// concurrent binders of one database each get an epoch of their own, and none is
// ever behind what another wrote. A durable not bound yet is the zero Recorded.
func Bump(ctx context.Context, db Row, schema string, r Recorded) (s State, ok bool, err error) {
	err = db.QueryRow(ctx, pgschema.Qualify(schema, sqlBump), r.Epoch, r.Binding).Scan(&s.Token, &s.Epoch, &s.Binding)
	if errors.Is(err, pgx.ErrNoRows) {
		return s, false, nil
	}
	return s, err == nil, wrap("bump the epoch", err)
}

// Adopt gives the installation token, and an epoch of at least epoch: this
// database then binds the durables of the installation it replaces (a move to
// another database whose token differs, or the original taking back its durables
// from a retired copy). It returns the new row.
func Adopt(ctx context.Context, db Row, schema, token string, epoch int64) (State, error) {
	var s State
	err := db.QueryRow(ctx, pgschema.Qualify(schema, sqlAdopt), token, epoch).Scan(&s.Token, &s.Epoch, &s.Binding)
	return s, wrap("adopt", err)
}

// Recorded is what a durable consumer's metadata says of its installation.
type Recorded struct {
	Token   string // "" for a durable bound before tokens
	Epoch   int64
	Binding string // "" for a durable bound before bindings were named
	ID      string // the old-style name (Of), "" when absent
}

// FromMetadata reads a durable consumer's metadata. An epoch that does not parse
// reads as 0: the durable then orders nothing, and the binding restamps it.
func FromMetadata(md map[string]string) Recorded {
	epoch, _ := strconv.ParseInt(md[EpochKey], 10, 64)
	return Recorded{Token: md[TokenKey], Epoch: epoch, Binding: md[BindingKey], ID: md[MetadataKey]}
}

// Metadata is the metadata recording a binding: s, and the old-style id.
func Metadata(s State, id string) map[string]string {
	return map[string]string{TokenKey: s.Token, EpochKey: strconv.FormatInt(s.Epoch, 10), BindingKey: s.Binding, MetadataKey: id}
}

// Ahead reports whether the durable that recorded r (of s's token) was bound by
// another database since this one, whose row is s, last bound it: r's epoch is
// ahead of s's, or the same epoch was reached by another binding (a copy and its
// original binding at once, each from the epoch they share). The binders of one
// database share its row, so they are never ahead of each other.
func Ahead(s State, r Recorded) bool {
	return r.Epoch > s.Epoch || r.Epoch == s.Epoch && r.Binding != "" && s.Binding != "" && r.Binding != s.Binding
}

// Owns reports whether a durable that recorded r is this installation's, whose
// row is s: the same token, and not bound since by another database (Ahead). A durable recorded
// before tokens is its own when it names id.
func Owns(s State, id string, r Recorded) bool {
	if r.Token == "" {
		return r.ID == "" || r.ID == id
	}
	return r.Token == s.Token && !Ahead(s, r)
}

func wrap(what string, err error) error {
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &pgErr) && pgErr.Code == "42P01":
		return fmt.Errorf("installation: %s: idem_installation does not exist: apply idem's migrations (worker migrate, or migrations.Apply): %w", what, err)
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("installation: %s: idem_installation has no row: apply idem's migrations again (worker migrate), which makes it", what)
	}
	return fmt.Errorf("installation: %s: %w", what, err)
}

const (
	sqlLoad = `SELECT token::text, epoch, COALESCE(bound_by::text, '') FROM idem_installation`
	// Ahead, negated, in SQL: $1 and $2 are the durable's epoch and binding.
	sqlBump = `
UPDATE idem_installation SET epoch = epoch + 1, bound_by = gen_random_uuid()
WHERE epoch > $1 OR epoch = $1 AND ($2 = '' OR bound_by IS NULL OR bound_by::text = $2)
RETURNING token::text, epoch, bound_by::text`
	// An adopted installation has not bound the durable yet: its next binding
	// goes on from the durable's epoch.
	sqlAdopt = `
UPDATE idem_installation SET token = $1::uuid, epoch = greatest(epoch, $2::bigint), bound_by = NULL, adopted_at = now()
RETURNING token::text, epoch, COALESCE(bound_by::text, '')`
)
