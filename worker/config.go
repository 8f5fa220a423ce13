package worker

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/producer"
)

// DefaultClientResendHorizon is how long idem's client keeps re-sending a pending
// intent with its key before it reports it expired (client.DefaultKeyLifetime).
const DefaultClientResendHorizon = 24 * time.Hour

// Config configures a Worker. Stream.Name and Stream.Subjects are required; the zero
// value of every other field means its default, and every component's own zero
// fields mean that component's defaults.
//
// The Config also says how many connections the worker's parts hold at once:
// NewPool sizes the pool from it, and New warns about a pool that is smaller.
type Config struct {
	// Schema is the Postgres schema of the idem_* tables (default "public"). It is
	// filled into every component below that leaves its own Schema empty.
	Schema string
	// NoMigrate skips applying idem's migrations at Start, for teams that run the
	// SQL (migrations.SQL) with their own tool. Start then fails if the schema is
	// missing.
	NoMigrate bool

	// Stream is the user's stream. Start creates it when absent (an existing one
	// is left as its operator tuned it), and its real MaxAge enters the lifetime
	// invariant: a configured MaxAge that differs from it is refused when it
	// breaks the invariant and warned about otherwise. Its Subjects bound what the
	// outbox accepts.
	Stream outbox.StreamConfig

	// Relay tunes the outbox relay; Schema and Stream are filled in.
	Relay outbox.RelayConfig
	// DisableRelay runs no relay in this worker (another process relays). It runs
	// no reconciler either: the reconciler works in the relay role.
	DisableRelay bool

	// Reconcile tunes the reconciler (package reconcile), which runs wherever the
	// relay runs; Schema and Stream are filled in, and Retention defaults to
	// Relay.Retention. With a reconciler the relay awaits proof
	// (outbox.RelayConfig.AwaitProof): a published row is kept until every
	// consumer that reads it has settled it.
	Reconcile reconcile.Config
	// DisableReconciler runs no reconciler here. Published rows then expire by
	// Relay.Retention alone unless Relay.AwaitProof is set (a reconciler runs in
	// another process), and the stream check at Start refuses settings that lose
	// messages (memory storage, discarding the oldest when full).
	DisableReconciler bool

	// Consumers to run: in-transaction and external handlers alike. Stream and
	// Schema are filled in where empty; Logger, TracerProvider and Observer are
	// added to.
	Consumers []consumer.Config

	// Ingress, when set, makes Ingress() return an HTTP Idempotency-Key middleware
	// built from it (Schema, Outbox, Logger and Observer filled in), and enters its
	// key lifetime into the lifetime invariant. Nil for a worker that takes no HTTP
	// requests.
	Ingress *producer.Config

	// Retention tunes the deletion of expired keys and published outbox rows.
	Retention RetentionConfig
	// DisableRetention runs no collector here (one per installation is enough).
	DisableRetention bool

	// ClientResendHorizon is how long clients keep re-sending a pending intent
	// with the same key (default DefaultClientResendHorizon). Request and inbox key
	// lifetimes must both exceed it.
	ClientResendHorizon time.Duration

	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// TracerProvider records the outbox's enqueue spans, the relay's publish spans
	// and the consumers' process spans, where they have none of their own
	// (default: the global provider, otel.GetTracerProvider).
	TracerProvider trace.TracerProvider
	// Observer is told every event of every component, after the worker's own
	// metrics (see RegisterMetrics).
	Observer idem.Observer
}

// RetentionConfig tunes the collector. The zero value means the defaults.
type RetentionConfig struct {
	// BatchSize is the most rows one DELETE removes (default 1000): small batches
	// hold row locks briefly and keep WAL bursts small.
	BatchSize int
	// Interval between collection rounds (default 1m).
	Interval time.Duration
	// Pause between batches of one round (default 0), to yield to the hot path.
	Pause time.Duration
	// DeadLetters is how long a dead letter is kept after it was filed (default
	// DefaultDeadLetterRetention); it is kept anyway until its replay horizon has
	// passed.
	DeadLetters time.Duration
	// Partitions tunes the partitions of idem_inbox and idem_outbox once they are
	// partitioned (partition.Convert, `worker partition`): each round creates them
	// ahead and drops the expired ones before deleting rows. Schema is the worker's;
	// KeyLifetime defaults to the longest of the worker's consumers'.
	Partitions partition.Config
}

func (c RetentionConfig) withDefaults() RetentionConfig {
	if c.BatchSize == 0 {
		c.BatchSize = 1000
	}
	if c.Interval == 0 {
		c.Interval = time.Minute
	}
	return c
}

func (c Config) validate() error {
	if err := pgschema.Validate(c.Schema); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	if err := c.Stream.Validate(); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	if c.ClientResendHorizon < 0 {
		return errors.New("worker: ClientResendHorizon must not be negative")
	}
	if c.Retention.BatchSize < 0 || c.Retention.Interval < 0 || c.Retention.Pause < 0 || c.Retention.DeadLetters < 0 {
		return errors.New("worker: Retention values must not be negative")
	}
	if err := c.Retention.Partitions.Validate(); err != nil {
		return fmt.Errorf("worker: Retention.Partitions: %w", err)
	}
	names := map[string]bool{}
	for _, cc := range c.Consumers {
		if names[cc.Name] {
			return fmt.Errorf("worker: two consumers are named %q", cc.Name)
		}
		names[cc.Name] = true
		if cc.Stream != "" && cc.Stream != c.Stream.Name {
			return fmt.Errorf("worker: consumer %s reads stream %s, not the worker's stream %s", cc.Name, cc.Stream, c.Stream.Name)
		}
		if cc.Schema != "" && pgschema.Name(cc.Schema) != pgschema.Name(c.Schema) {
			return fmt.Errorf("worker: consumer %s uses schema %s, not the worker's %s", cc.Name, cc.Schema, pgschema.Name(c.Schema))
		}
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.ClientResendHorizon == 0 {
		c.ClientResendHorizon = DefaultClientResendHorizon
	}
	c.Retention = c.Retention.withDefaults()
	return c
}
