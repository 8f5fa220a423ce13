// Package registry is idem_consumers: the consumers an installation has, each
// registered by itself when it starts, and what each must settle. The reconciler
// reads it to know which consumers an intent waits for; the worker reads it for
// the lifetime invariant.
package registry

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/natssubject"
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/wire"
)

// Consumer is a consumer as it registered itself in idem_consumers when it started
// (consumer.Consumer.Run does): the messages it must settle.
type Consumer struct {
	Name string `json:"name"`
	// Stream and FilterSubject say which messages it reads.
	Stream        string `json:"stream"`
	FilterSubject string `json:"filter_subject"`
	// KeyLifetime is how long its inbox remembers a key: past it (less a margin and
	// the stream's MaxAge) a lost message is alerted, not re-driven.
	KeyLifetime time.Duration `json:"key_lifetime"`
	// PriorKeyLifetime is the shortest other lifetime a process of the consumer
	// settled with, up to KeyLifetimeSince (zero: none); see SettledLifetime.
	PriorKeyLifetime time.Duration `json:"prior_key_lifetime,omitempty"`
	KeyLifetimeSince *time.Time    `json:"key_lifetime_since,omitempty"`
	// Redelivery is its redelivery horizon (consumer.Config.RedeliveryHorizon), so
	// the lifetime invariant can be checked for every consumer of the installation;
	// zero when it registered without one.
	Redelivery time.Duration `json:"redelivery,omitempty"`
	// StartsAt is where its responsibility starts: nil for a consumer that
	// backfills what the stream holds (the default), else when it first
	// registered; it settles only intents written since.
	StartsAt *time.Time `json:"starts_at,omitempty"`
	// RegisteredAt is when it first registered; LastSeen when it last refreshed its
	// registration (about once a minute while it runs).
	RegisteredAt time.Time `json:"registered_at"`
	LastSeen     time.Time `json:"last_seen"`
}

// SettledLifetime is the key lifetime by which c's settlement of a row written at
// written must be judged: the shortest c's processes may have settled it under.
// A row written before a change of lifetime (or before the last sight of a process
// still running with another, during a redeploy) may have been settled under the
// prior one, and its inbox row expires by it whatever the lifetime registered
// now. The grace covers a process that settled a row after its last sighting and
// then stopped: a running consumer is seen at least every two SeenEvery.
func (c Consumer) SettledLifetime(written time.Time) time.Duration {
	if c.PriorKeyLifetime <= 0 || c.KeyLifetimeSince == nil || written.After(c.KeyLifetimeSince.Add(3*SeenEvery)) {
		return c.KeyLifetime
	}
	return min(c.KeyLifetime, c.PriorKeyLifetime)
}

// SeenEvery is how often a running consumer refreshes its registration (Seen);
// it checks every SeenEvery at least, so the refreshes are at most two apart.
const SeenEvery = time.Minute

// Reads reports whether c must settle a message published on subject into stream.
func (c Consumer) Reads(stream, subject string) bool {
	return c.Stream == stream && natssubject.Matches(c.FilterSubject, subject)
}

// Expects reports whether c must settle a message on subject in stream whose
// outbox row was written at written: it reads the message, the message is for it
// (replayFor, the Idem-Replay-For header: a replay or a re-drive is for the
// consumers it names, and the others ack it without an effect), and the intent is
// within c's responsibility (written at or after StartsAt).
func (c Consumer) Expects(stream, subject, replayFor string, written time.Time) bool {
	return c.Reads(stream, subject) && wire.IsReplayFor(replayFor, c.Name) && (c.StartsAt == nil || !written.Before(*c.StartsAt))
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
	rs, err := db.Query(ctx, store.New(schema).Consumers.Registered)
	if err != nil {
		return nil, fmt.Errorf("registry: registered consumers: %w", err)
	}
	out, err := pgx.CollectRows(rs, func(row pgx.CollectableRow) (Consumer, error) {
		var c Consumer
		var lifetime, redelivery, prior float64
		err := row.Scan(&c.Name, &c.Stream, &c.FilterSubject, &lifetime, &redelivery, &c.RegisteredAt, &c.LastSeen, &c.StartsAt, &prior, &c.KeyLifetimeSince)
		c.KeyLifetime, c.PriorKeyLifetime = seconds(lifetime), seconds(prior)
		c.Redelivery = seconds(redelivery)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("registry: registered consumers: %w", err)
	}
	return out, nil
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// Expected returns the consumers that must settle a message on subject in stream
// whose outbox row was written at written (see Consumer.Expects).
func Expected(consumers []Consumer, stream, subject, replayFor string, written time.Time) []Consumer {
	var out []Consumer
	for _, c := range consumers {
		if c.Expects(stream, subject, replayFor, written) {
			out = append(out, c)
		}
	}
	return out
}

// Registration is what Register did.
type Registration struct {
	// Consumer is the entry as registered: a consumer registered before keeps its
	// StartsAt and RegisteredAt.
	Consumer
	// New says this was the name's first registration in the installation.
	New bool
}

// LikelyRenamedFrom lists, while c's name is not registered, the registered
// consumers of c's stream and filter whose inbox remembers a settlement: if c is
// one of them renamed, a c that backfills runs every intent they settled (and the
// stream still holds) again, under a name whose inbox is empty. How long they have
// been silent does not matter: a deploy that renames stops the old name seconds
// before it starts the new one. Empty for a registered name (a restart) and for a
// new name whose siblings have settled nothing yet (nothing to run twice).
func LikelyRenamedFrom(ctx context.Context, db Querier, schema string, c Consumer) ([]string, error) {
	rs, err := db.Query(ctx, store.New(schema).Consumers.LikelyRenamed, c.Stream, c.FilterSubject, c.Name)
	if err != nil {
		return nil, fmt.Errorf("registry: likely renamed %s: %w", c.Name, err)
	}
	names, err := pgx.CollectRows(rs, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("registry: likely renamed %s: %w", c.Name, err)
	}
	return names, nil
}

// stillRunningWithin: a consumer seen this recently is taken for one still
// running (a running one refreshes itself every minute), which Rename refuses.
const stillRunningWithin = 5 * time.Minute

// Register records c in the registry (or updates its entry): from now on every
// intent published on a subject c reads waits for c's settlement. When c is new to
// the installation, startNew makes it responsible only for intents written from
// now on (its StartsAt); otherwise it backfills, responsible for every intent still
// unproven. An existing entry keeps where it started. consumer.Consumer registers
// itself when it runs; a consumer built otherwise (the Watermill middleware, a
// hand-written one over the same inbox) calls Register before it takes its first
// message. LastSeen is set by the database.
func Register(ctx context.Context, db Querier, schema string, c Consumer, startNew bool) (Registration, error) {
	if err := ValidateName(c.Name); err != nil {
		return Registration{}, err
	}
	if err := natssubject.ValidateFilter(c.FilterSubject); err != nil {
		return Registration{}, fmt.Errorf("registry: register %s: %w", c.Name, err)
	}
	if c.Stream == "" || c.KeyLifetime <= 0 || c.Redelivery < 0 {
		return Registration{}, fmt.Errorf("registry: register %s: Stream and a positive KeyLifetime are required", c.Name)
	}
	r := Registration{Consumer: c}
	err := db.QueryRow(ctx, store.New(schema).Consumers.Register, c.Name, c.Stream, c.FilterSubject, c.KeyLifetime, c.Redelivery, startNew).
		Scan(&r.New, &r.RegisteredAt, &r.LastSeen, &r.StartsAt)
	if err != nil {
		return Registration{}, fmt.Errorf("registry: register %s: %w", c.Name, err)
	}
	return r, nil
}

// ValidateName checks a consumer's name: non-empty, and without a comma, which
// separates names in idem.HeaderReplayFor.
func ValidateName(name string) error {
	switch {
	case name == "":
		return errors.New("registry: a consumer needs a name")
	case strings.Contains(name, ","):
		return fmt.Errorf("registry: consumer name %q contains a comma, which separates names in %s", name, idem.HeaderReplayFor)
	}
	return nil
}

// Seen refreshes a registered consumer's LastSeen, from a process that settles
// with keyLifetime: one whose lifetime is not the registered one (an old process
// during a redeploy) keeps its settlements judged by the shorter of the two.
func Seen(ctx context.Context, db Execer, schema, name string, keyLifetime time.Duration) error {
	if _, err := db.Exec(ctx, store.New(schema).Consumers.Seen, name, keyLifetime); err != nil {
		return fmt.Errorf("registry: seen %s: %w", name, err)
	}
	return nil
}

// Forget removes a consumer from the registry, for one that was retired: until
// then every intent it reads waits for it, and is alerted once past its horizon. A
// consumer that still runs registers itself again when it restarts.
func Forget(ctx context.Context, db Execer, schema, name string) (bool, error) {
	tag, err := db.Exec(ctx, store.New(schema).Consumers.Forget, name)
	if err != nil {
		return false, fmt.Errorf("registry: forget consumer %s: %w", name, err)
	}
	return tag.RowsAffected() > 0, nil
}

// ErrStillRunning is wrapped by Rename's error when the consumer to rename was
// seen lately: a consumer must be stopped everywhere before it is renamed. It is
// consumer.ErrStillRunning too, so its text names no package: the error it is
// wrapped in says which consumer and what to do.
var ErrStillRunning = errors.New("still running")

// Beginner is what Rename needs of a pool or connection: its own transaction.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Rename gives a registered consumer a new name and keeps everything it knows: its
// inbox rows, attempts and dead letters move to the new name with its registry
// entry, so the renamed consumer folds what it settled under the old name. Stop
// every worker running the old name first (a consumer seen within the last five
// minutes is refused with ErrStillRunning unless force), then deploy the new name.
// The old name's JetStream durable consumer is not touched: delete it (the
// reference binary's `worker consumers rename` does); the new name's durable is
// created when it starts and reads what the stream holds, which the moved inbox
// folds. It fails if the new name is registered already.
func Rename(ctx context.Context, db Beginner, schema, from, to string, force bool) error {
	if err := ValidateName(to); err != nil {
		return err
	}
	if from == to {
		return fmt.Errorf("registry: rename %s: the new name is the old one", from)
	}
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		q := store.New(schema).Consumers
		var seenAgo float64
		err := tx.QueryRow(ctx, q.RenameLock, from).Scan(&seenAgo)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("registry: rename %s: no such registered consumer", from)
		}
		if err != nil {
			return fmt.Errorf("registry: rename %s: %w", from, err)
		}
		if ago := seconds(seenAgo); ago < stillRunningWithin && !force {
			return fmt.Errorf("%w: %s was seen %s ago; stop every worker that runs it, then rename it", ErrStillRunning, from, ago.Round(time.Second))
		}
		for _, sql := range []string{q.RenameConsumer, q.RenameInbox, q.RenameAttempts, q.RenameDeadLetters} {
			if _, err := tx.Exec(ctx, sql, from, to); err != nil {
				var pe *pgconn.PgError
				if errors.As(err, &pe) && pe.Code == "23505" {
					return fmt.Errorf("registry: rename %s to %s: %s is registered already", from, to, to)
				}
				return fmt.Errorf("registry: rename %s to %s: %w", from, to, err)
			}
		}
		return nil
	})
}
