package worker

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/producer"
)

// defaultClientResendHorizon is how long idem's client keeps re-sending a pending
// intent with its key before it reports it expired (client.DefaultKeyLifetime).
const defaultClientResendHorizon = 24 * time.Hour

// Config says what a Worker runs and tunes it. What the installation shares (the
// pool, the stream, the schema, the logger, the tracer, the observer) is the
// Installation's; every field here is a knob of one part, and the zero value of
// every field means its default.
//
// The Config also says how many connections the worker's parts hold at once:
// NewPool sizes the pool from it, and New warns about a pool that is smaller.
type Config struct {
	// NoMigrate skips applying idem's migrations at Start, for teams that run the
	// SQL (migrations.SQL) with their own tool. Start then fails if the schema is
	// missing.
	NoMigrate bool

	// Consumers to run: in-transaction and external handlers alike.
	Consumers []consumer.Config

	// Ingress, when set, makes Ingress() return an HTTP Idempotency-Key middleware
	// built from it, and enters its key lifetime into the lifetime invariant. Its
	// MaxBodyBytes defaults to what the broker can carry, and its MaxInFlight to
	// the pool's connections the other parts leave. Nil for a worker that takes no
	// HTTP requests.
	Ingress *producer.Config

	// Relay tunes the outbox relay.
	Relay RelayConfig
	// DisableRelay runs no relay in this worker (another process relays). It runs
	// no reconciler either: the reconciler works in the relay role.
	DisableRelay bool

	// Reconcile tunes the reconciler, which runs wherever the relay runs and proves
	// every published intent settled by every consumer that reads it: a published
	// outbox row is kept until then.
	Reconcile ReconcileConfig
	// DisableReconciler runs no reconciler here. The rows this worker's relay
	// publishes then expire after Retention.Published, and the stream check at
	// Start refuses settings that lose messages (memory storage, discarding the
	// oldest when full).
	DisableReconciler bool

	// Retention tunes the deletion of expired keys, published outbox rows and dead
	// letters.
	Retention RetentionConfig
	// DisableRetention runs no collector here (one per installation is enough).
	DisableRetention bool

	// ClientResendHorizon is how long clients keep re-sending a pending intent
	// with the same key (default 24h, client.DefaultKeyLifetime). Request and inbox key
	// lifetimes must both exceed it.
	ClientResendHorizon time.Duration
}

// RelayConfig tunes the outbox relay. The zero value means the defaults.
type RelayConfig struct {
	// Mode chooses the relay: "log" reads committed outbox rows from a logical
	// replication slot, and never rewrites them; "poll" claims pending rows
	// (SELECT ... FOR UPDATE SKIP LOCKED) and marks them published. The default,
	// "", runs the log relay where it can (wal_level = logical, a role that may
	// replicate, PostgreSQL 14 or later, no OrderedSubjects or AtomicPublish) and
	// the polling relay elsewhere; the worker says at start which one runs and
	// why. "log" refuses to start where the log relay cannot run. Every worker of
	// an installation should be given the same Mode: the relay of the one that
	// started last decides which relay new rows belong to. See docs/OPERATIONS.md,
	// "The relay".
	Mode string
	// MaxSlotLag is how much WAL (bytes) the log relay's slot may hold before the
	// worker running it is unready (default 1 GiB): the relay is that far behind
	// the outbox. Bound what Postgres keeps for a slot with max_slot_wal_keep_size.
	MaxSlotLag int64
	// BatchSize is the most rows claimed and published per transaction (default
	// 500).
	BatchSize int
	// PublishTimeout bounds the wait for every PubAck of a batch (default 10s). A
	// PubAck that does not come is a failed publish, so the relay never waits
	// longer than this for the broker, nor does its shutdown.
	PublishTimeout time.Duration
	// MaxAttempts is how many failed publishes a row gets, while the broker is
	// otherwise up, before it is dead-lettered under outbox.RelayConsumer (default
	// 10). A row the broker can never take (larger than max_payload) is
	// dead-lettered at once.
	MaxAttempts int
	// OrderedSubjects are subject filters (e.g. "orders.events.*") whose subjects
	// are each relayed in order: a row is published only after every earlier row
	// of its subject was published or dead-lettered, so a failing row blocks its
	// subject (only its subject) through its backoff. Pair with outbox.Partition
	// and an ordered consumer per subject (consumer.Partitioned); see
	// docs/ORDERING.md. Every relay of one installation must be given the same.
	OrderedSubjects []string
	// AtomicPublish publishes each batch as one JetStream atomic batch: one PubAck,
	// and one fsync, per batch instead of per message. It needs nats-server 2.12
	// or later and a stream that allows it (install.Stream.AllowAtomicPublish);
	// BatchSize may then not exceed 1000. Default off.
	AtomicPublish bool
}

// ReconcileConfig tunes the reconciler. The zero value means the defaults.
type ReconcileConfig struct {
	// After is how long after its publish an unsettled intent is looked for in
	// the stream (default 5m): until then it is simply in flight.
	After time.Duration
	// UnroutedHorizon is how long an intent no registered consumer reads is waited
	// for (a consumer may be deployed late) before it is dead-lettered under
	// outbox.RelayConsumer (default 72h).
	UnroutedHorizon time.Duration
	// Trusted are subject filters whose intents are complete once published: for
	// subjects read by consumers whose inbox lives in another database (see
	// docs/ARCHITECTURE.md, "Consumers in other databases"), which the reconciler
	// cannot see.
	Trusted []string
}

// RetentionConfig tunes the collector. The zero value means the defaults.
type RetentionConfig struct {
	// BatchSize is the most rows one DELETE removes (default 1000): small batches
	// hold row locks briefly and keep WAL bursts small.
	BatchSize int
	// Interval between collection rounds (default 1m).
	Interval time.Duration
	// DeadLetters is how long a dead letter is kept after it was filed (default
	// 30 days); it is kept anyway until its replay horizon has
	// passed.
	DeadLetters time.Duration
	// Published is how long a published outbox row is kept when no reconciler
	// proves it (DisableReconciler), and how long a proven one is kept as
	// evidence (default 72h).
	Published time.Duration
	// PartitionsAhead is the slack of partitions of idem_inbox and idem_outbox
	// made ready beyond the furthest bound a row can need, once the tables are
	// partitioned (`worker partition`; default 2 days).
	PartitionsAhead time.Duration
}

func (c RetentionConfig) withDefaults() RetentionConfig {
	if c.BatchSize == 0 {
		c.BatchSize = 1000
	}
	if c.Interval == 0 {
		c.Interval = time.Minute
	}
	if c.Published == 0 {
		c.Published = 72 * time.Hour
	}
	return c
}

func (c Config) validate() error {
	if c.ClientResendHorizon < 0 {
		return errors.New("worker: ClientResendHorizon must not be negative")
	}
	r := c.Retention
	if r.BatchSize < 0 || r.Interval < 0 || r.DeadLetters < 0 || r.Published < 0 || r.PartitionsAhead < 0 {
		return errors.New("worker: Retention values must not be negative")
	}
	if err := c.Relay.config(c).Validate(); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	switch c.Relay.Mode {
	case relayAuto, relayPoll:
	case relayLog:
		if len(c.Relay.OrderedSubjects) > 0 || c.Relay.AtomicPublish {
			return errors.New(`worker: Relay.Mode "log" publishes message by message in commit order; OrderedSubjects and AtomicPublish need Mode "poll" (or the default)`)
		}
	default:
		return fmt.Errorf(`worker: Relay.Mode %q: want "log", "poll" or "" (the log relay where it can run)`, c.Relay.Mode)
	}
	if c.Relay.MaxSlotLag < 0 {
		return errors.New("worker: Relay.MaxSlotLag must not be negative")
	}
	if err := c.Reconcile.config(c).Validate(); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	names := map[string]bool{}
	for _, cc := range c.Consumers {
		if names[cc.Name] {
			return fmt.Errorf("worker: two consumers are named %q", cc.Name)
		}
		names[cc.Name] = true
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.ClientResendHorizon == 0 {
		c.ClientResendHorizon = defaultClientResendHorizon
	}
	c.Retention = c.Retention.withDefaults()
	if c.Relay.MaxSlotLag == 0 {
		c.Relay.MaxSlotLag = defaultMaxSlotLag
	}
	return c
}

// Relay modes (RelayConfig.Mode).
const (
	relayAuto = ""
	relayLog  = "log"
	relayPoll = "poll"
)

// defaultMaxSlotLag is RelayConfig.MaxSlotLag's default.
const defaultMaxSlotLag = 1 << 30

// config is the relay's configuration in worker c.
func (r RelayConfig) config(c Config) relay.Config {
	return relay.Config{
		BatchSize: r.BatchSize, PublishTimeout: r.PublishTimeout, MaxAttempts: r.MaxAttempts,
		OrderedSubjects: r.OrderedSubjects, AtomicPublish: r.AtomicPublish,
		Retention: c.Retention.withDefaults().Published, AwaitProof: !c.DisableReconciler,
	}
}

// config is the reconciler's configuration in worker c.
func (r ReconcileConfig) config(c Config) reconcile.Config {
	return reconcile.Config{
		After: r.After, UnroutedHorizon: r.UnroutedHorizon, Trusted: r.Trusted,
		Retention: c.Retention.withDefaults().Published,
	}
}

// partitions is the partitioner's configuration: the installation's schema, and
// a key lifetime no shorter than the longest of this worker's consumers'.
func (c RetentionConfig) partitions(schema string, keyLifetime time.Duration) partition.Config {
	return partition.Config{Schema: schema, Ahead: c.PartitionsAhead, KeyLifetime: keyLifetime}
}
