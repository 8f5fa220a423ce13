package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgschema"
)

// Consumer is a consumer as it registered itself in idem_consumers when it started
// (consumer.Consumer.Run does): the messages it must settle.
type Consumer struct {
	Name string `json:"name"`
	// Stream and FilterSubject say which messages it reads.
	Stream        string `json:"stream"`
	FilterSubject string `json:"filter_subject"`
	// KeyLifetime is how long its inbox remembers a key: past it (less a margin) a
	// lost message is alerted, not re-driven.
	KeyLifetime time.Duration `json:"key_lifetime"`
	// LastSeen is when it last refreshed its registration (about once a minute
	// while it runs).
	LastSeen time.Time `json:"last_seen"`
}

// Reads reports whether c must settle a message published on subject into stream.
func (c Consumer) Reads(stream, subject string) bool {
	return c.Stream == stream && idem.SubjectMatches(c.FilterSubject, subject)
}

// Querier is what the read-only functions need of a pool, connection or
// transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Execer is what Forget needs of a pool, connection or transaction.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Registered lists the registered consumers of schema.
func Registered(ctx context.Context, db Querier, schema string) ([]Consumer, error) {
	rs, err := db.Query(ctx, pgschema.Qualify(schema, sqlRegistered))
	if err != nil {
		return nil, fmt.Errorf("reconcile: registered consumers: %w", err)
	}
	out, err := pgx.CollectRows(rs, func(row pgx.CollectableRow) (Consumer, error) {
		var c Consumer
		var lifetime float64
		err := row.Scan(&c.Name, &c.Stream, &c.FilterSubject, &lifetime, &c.LastSeen)
		c.KeyLifetime = time.Duration(lifetime * float64(time.Second))
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: registered consumers: %w", err)
	}
	return out, nil
}

// Expected returns the consumers that must settle a message on subject in stream:
// every consumer that reads it, or, for a dead-letter replay (replayFor, the
// Idem-Replay-For header), only the consumer it is for, since the others ack it
// without an effect.
func Expected(consumers []Consumer, stream, subject, replayFor string) []Consumer {
	var out []Consumer
	for _, c := range consumers {
		if c.Reads(stream, subject) && (replayFor == "" || c.Name == replayFor) {
			out = append(out, c)
		}
	}
	return out
}

// Register records c in the registry (or updates its entry): from now on every
// intent published on a subject c reads waits for c's settlement. consumer.Consumer
// registers itself when it runs; a consumer built otherwise (the Watermill
// middleware, a hand-written one over the same inbox) calls Register before it takes
// its first message. LastSeen is set by the database.
func Register(ctx context.Context, db Execer, schema string, c Consumer) error {
	if err := idem.ValidateFilter(c.FilterSubject); err != nil {
		return fmt.Errorf("reconcile: register %s: %w", c.Name, err)
	}
	if c.Name == "" || c.Stream == "" || c.KeyLifetime <= 0 {
		return fmt.Errorf("reconcile: register: Name, Stream and a positive KeyLifetime are required")
	}
	if _, err := db.Exec(ctx, pgschema.Qualify(schema, sqlRegister), c.Name, c.Stream, c.FilterSubject, c.KeyLifetime); err != nil {
		return fmt.Errorf("reconcile: register %s: %w", c.Name, err)
	}
	return nil
}

// Seen refreshes a registered consumer's LastSeen.
func Seen(ctx context.Context, db Execer, schema, name string) error {
	if _, err := db.Exec(ctx, pgschema.Qualify(schema, sqlSeen), name); err != nil {
		return fmt.Errorf("reconcile: seen %s: %w", name, err)
	}
	return nil
}

// Forget removes a consumer from the registry, for one that was retired: until
// then every intent it reads waits for it, and is alerted once past its horizon. A
// consumer that still runs registers itself again when it restarts.
func Forget(ctx context.Context, db Execer, schema, name string) (bool, error) {
	tag, err := db.Exec(ctx, pgschema.Qualify(schema, sqlForget), name)
	if err != nil {
		return false, fmt.Errorf("reconcile: forget consumer %s: %w", name, err)
	}
	return tag.RowsAffected() > 0, nil
}
