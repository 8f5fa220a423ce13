package consumer

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/internal/natssubject"
)

// Defaults applied to zero fields of Config.
const (
	// defaultBatchSize is how many deliveries an in-transaction consumer processes
	// in one transaction.
	defaultBatchSize = 250
	// defaultConcurrency is how many batches an in-transaction consumer runs at
	// once: one commits while the next is being claimed.
	defaultConcurrency = 2
	// defaultExternalConcurrency is how many external effects run at once.
	defaultExternalConcurrency = 1
	// defaultAckWait is how long JetStream waits for an ack before redelivering.
	defaultAckWait = 30 * time.Second
	// DefaultMaxDeliver is how many failed attempts a message gets before it is
	// dead-lettered.
	DefaultMaxDeliver = 10
	// defaultLeaseFor is how long an external effect's claim outlives a worker that
	// stopped extending it.
	defaultLeaseFor = 30 * time.Second
	// defaultMaxBufferedBytes bounds the bytes fetched ahead of the handlers.
	defaultMaxBufferedBytes = 16 << 20
	// defaultMaxBatchBytes bounds the bytes of one batch.
	defaultMaxBatchBytes = 4 << 20
	// batchLinger is how long a batch that is not full waits for more messages
	// after its first one arrived: at a moderate rate, messages that arrive one by
	// one then share a transaction (and its commit) instead of each being one. It
	// is a small part of the latency from request to effect that idem aims at, and
	// a full batch never waits.
	batchLinger = 2 * time.Millisecond
)

// Config configures a Consumer. Name, Subject and exactly one handler are
// required; the zero value of every other field means its default.
type Config struct {
	// Name is the durable JetStream consumer and the inbox's consumer column. Two
	// workers of one installation with the same Name share the work; two names each
	// see every message. A durable belongs to one installation (database and
	// schema): another installation with the same Name on the same stream is
	// refused (ErrForeignDurable). No comma.
	Name string
	// Subject is the filter subject, e.g. "orders.created" or "orders.>".
	Subject string

	// Handler or BatchHandler runs an effect inside the inbox transaction; External
	// performs one that cannot join a transaction (an email, a provider call), under
	// a lease. Set exactly one of the three.
	Handler      Handler
	BatchHandler BatchHandler
	External     ExternalHandler

	// BatchSize is the most deliveries processed in one transaction (default
	// defaultBatchSize). A batch that is not full waits up to 2ms after its
	// first message arrived for more to share its transaction; a full one goes at
	// once. External effects are always performed one at a time.
	BatchSize int
	// Concurrency is how many batches (or external effects) run at once (default
	// 2, or 1 for External: one commits while the next is being claimed).
	Concurrency int
	// AckWait is how long JetStream waits for an ack before redelivering (default
	// 30s). Work in progress is kept alive with in-progress heartbeats.
	AckWait time.Duration
	// MaxDeliver is how many failed attempts a message gets before it is
	// dead-lettered (default DefaultMaxDeliver).
	MaxDeliver int
	// Backoff is the redelivery delay after the n-th failed attempt (default
	// DefaultBackoff).
	Backoff func(attempt int) time.Duration
	// KeyLifetime is how long inbox keys are remembered (default
	// dedupe.DefaultLifetime). It must outlast RedeliveryHorizon, the stream's
	// MaxAge and the clients' re-send horizon; the worker package checks it.
	KeyLifetime time.Duration
	// LeaseFor, for External, is how long a claim outlives a worker that stops
	// extending it (default 30s). It is extended every third of
	// min(LeaseFor, AckWait) while the effect runs, so it bounds how long a crashed
	// worker delays the retry, not how long the effect may take.
	LeaseFor time.Duration
	// MaxBufferedBytes bounds the payload and header bytes fetched ahead of the
	// handlers: the pull requests ask for at most this much, and the consumer's
	// own queue holds at most this much (default 16 MiB; raised to the broker's
	// max_payload if smaller, or a single message could never be fetched).
	MaxBufferedBytes int64
	// CheckInterval is how often the consumer checks that its durable consumer
	// still exists, and recreates it if an operator (or a lost stream) deleted it,
	// and that no copy of its database has bound it since (default 5s).
	CheckInterval time.Duration
	// MaxBatchBytes bounds the bytes of one batch (default 4 MiB; a single bigger
	// message is still taken alone). With MaxBufferedBytes it bounds the memory a
	// consumer holds by bytes, not only by message counts:
	// 2*MaxBufferedBytes + Concurrency*MaxBatchBytes.
	MaxBatchBytes int64

	// Start says where a consumer new to the installation starts. StartBackfill
	// reads everything the stream holds, and is responsible for every intent not
	// yet proven settled, so a first deploy that starts producers before consumers
	// loses nothing. StartNew reads only what is published after it first
	// registered, and the reconciler expects it to settle only intents written
	// since. StartDefault (the zero value) backfills, unless the consumer looks
	// like a rename: a new name (no durable consumer, not registered) with the
	// stream and filter of a registered consumer that has settled messages. Then
	// Register and Run (and so worker.Worker.Start) refuse it with ErrLikelyRenamed, since backfilling would run what the
	// old name settled again under a name whose inbox is empty. Rename the old
	// consumer (Rename; worker consumers rename OLD NEW) so the new name keeps its
	// inbox, Forget a retired one, or set Start explicitly for a second consumer
	// of the same messages. A consumer registered before keeps where it started
	// and is never refused: the setting matters only the first time a name runs
	// in an installation.
	Start StartPolicy

	// Ordered processes deliveries strictly in stream order, one at a time: the
	// durable consumer gets MaxAckPending 1 (otherwise max(1000,
	// 4*BatchSize*Concurrency)), so JetStream hands out the next
	// message only once this one is acked or, as a dead letter, terminated, and
	// Concurrency and BatchSize are 1. A message that fails is retried (after
	// Backoff) before anything behind it, and a poison message blocks the
	// consumer until it is dead-lettered (MaxDeliver, or a Permanent error). Use
	// one ordered consumer per partition subject (Partitioned); see
	// docs/ORDERING.md. Setting BatchSize or Concurrency above 1 with Ordered is
	// an error. Off by default.
	Ordered bool

	// linger is how long a batch waits for more messages after its first one
	// arrived (0: batchLinger; negative: not at all, a batch is whatever is
	// buffered); tests set it to gather a batch.
	linger time.Duration
	// maxAckPending bounds messages delivered and not yet acked.
	maxAckPending int
}

// StartPolicy is where a consumer new to the installation starts; see
// Config.Start.
type StartPolicy int

const (
	// StartDefault backfills, like StartBackfill, but refuses a likely rename
	// (ErrLikelyRenamed); see Config.Start.
	StartDefault StartPolicy = iota
	// StartBackfill reads what the stream holds, even beside a registered
	// consumer of the same stream and filter.
	StartBackfill
	// StartNew reads what is published after the consumer first registered.
	StartNew
)

func (c Config) validate() error {
	handlers := 0
	for _, set := range []bool{c.Handler != nil, c.BatchHandler != nil, c.External != nil} {
		if set {
			handlers++
		}
	}
	switch {
	case c.Name == "":
		return errors.New("consumer: Name is required")
	case strings.Contains(c.Name, ","):
		return fmt.Errorf("consumer %s: Name must not contain a comma (it separates names in %s)", c.Name, idem.HeaderReplayFor)
	case c.Start < StartDefault || c.Start > StartNew:
		return fmt.Errorf("consumer %s: unknown Start %d", c.Name, c.Start)
	case c.Subject == "":
		return fmt.Errorf("consumer %s: Subject is required", c.Name)
	case handlers != 1:
		return fmt.Errorf("consumer %s: set exactly one of Handler, BatchHandler and External", c.Name)
	case c.BatchSize < 0, c.Concurrency < 0, c.MaxDeliver < 0, c.MaxBufferedBytes < 0, c.MaxBatchBytes < 0:
		return fmt.Errorf("consumer %s: sizes must not be negative", c.Name)
	case c.AckWait < 0, c.KeyLifetime < 0, c.LeaseFor < 0, c.CheckInterval < 0:
		return fmt.Errorf("consumer %s: durations must not be negative", c.Name)
	case c.Ordered && (c.BatchSize > 1 || c.Concurrency > 1):
		return fmt.Errorf("consumer %s: an Ordered consumer takes one message at a time; BatchSize and Concurrency must be 0 or 1", c.Name)
	case c.External != nil && c.BatchSize > 1:
		return fmt.Errorf("consumer %s: an External handler performs one effect at a time; BatchSize must be 0 or 1", c.Name)
	}
	if err := natssubject.ValidateFilter(c.Subject); err != nil {
		return fmt.Errorf("consumer %s: Subject: %w", c.Name, err)
	}
	return nil
}

// WithDefaults returns c with every zero field replaced by its default. The worker
// uses it to read the numbers the lifetime invariant compares.
func (c Config) WithDefaults() Config {
	external := c.External != nil
	if c.Ordered {
		// One message outstanding on the broker, one worker: nothing can overtake.
		c.BatchSize, c.Concurrency, c.maxAckPending = 1, 1, 1
	}
	switch {
	case external:
		c.BatchSize = 1
	case c.BatchSize == 0:
		c.BatchSize = defaultBatchSize
	}
	if c.Concurrency == 0 {
		c.Concurrency = defaultConcurrency
		if external {
			c.Concurrency = defaultExternalConcurrency
		}
	}
	if c.AckWait == 0 {
		c.AckWait = defaultAckWait
	}
	if c.MaxDeliver == 0 {
		c.MaxDeliver = DefaultMaxDeliver
	}
	if c.Backoff == nil {
		c.Backoff = DefaultBackoff
	}
	if c.KeyLifetime == 0 {
		c.KeyLifetime = dedupe.DefaultLifetime
	}
	if c.LeaseFor == 0 {
		c.LeaseFor = defaultLeaseFor
	}
	if c.linger == 0 {
		c.linger = batchLinger
	}
	if c.maxAckPending == 0 {
		c.maxAckPending = max(1000, 4*c.BatchSize*c.Concurrency)
	}
	if c.MaxBufferedBytes == 0 {
		c.MaxBufferedBytes = defaultMaxBufferedBytes
	}
	if c.MaxBatchBytes == 0 {
		c.MaxBatchBytes = defaultMaxBatchBytes
	}
	if c.CheckInterval == 0 {
		c.CheckInterval = 5 * time.Second
	}
	return c
}

// DefaultBackoff waits 1s after the first failed attempt, doubling to at most 1m.
func DefaultBackoff(attempt int) time.Duration {
	d := time.Second
	for i := 1; i < attempt && d < time.Minute; i++ {
		d *= 2
	}
	return min(d, time.Minute)
}

// RedeliveryHorizon is the longest time over which one message can still be
// delivered again: for every attempt up to MaxDeliver, its ack wait (for an external
// effect, the longer of the ack wait and the lease: a crashed worker's message comes
// back after AckWait but is performed again only once its lease ends) plus its
// backoff. The inbox must remember a key for longer than this. Defaults apply to
// zero fields.
func (c Config) RedeliveryHorizon() time.Duration {
	c = c.WithDefaults()
	wait := c.AckWait
	if c.External != nil {
		wait = max(c.AckWait, c.LeaseFor)
	}
	total := time.Duration(0)
	for n := 1; n <= c.MaxDeliver; n++ {
		total += wait + c.Backoff(n)
	}
	return total
}
