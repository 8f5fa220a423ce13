package idemwatermill

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
)

// Config configures Middleware. The zero value of every optional field means its
// default. What the installation shares (the pool, the schema of idem's tables,
// the stream, the logger) is the *install.Installation's.
type Config struct {
	// Consumer names the consumer in idem_inbox (its consumer column). Keys are
	// unique per consumer: two handlers that must each see every message need two
	// names. Required.
	Consumer string
	// KeyLifetime is how long a claimed key is remembered (default
	// dedupe.DefaultLifetime). It must outlast every window in which the same
	// message can be delivered again (the broker's retention, the redelivery
	// horizon, the producer's re-send horizon); see dedupe.Lifetimes. Watermill's
	// broker is not idem's, so nothing checks this for you: run
	// dedupe.Lifetimes{...}.Check at start-up with your broker's numbers.
	KeyLifetime time.Duration
	// OutboxSubject, when set, routes the messages a handler returns through the
	// installation's outbox: they are written to idem_outbox on this subject inside
	// the message's transaction, so they commit with the claim and the handler's
	// writes (or not at all), and none is handed back to the router. idem's relay
	// publishes them.
	// Without it the router publishes returned messages itself after the commit,
	// where a failed publish loses them (see the package documentation). A
	// returned message without Idempotency-Key metadata gets one derived from the
	// consumer, the incoming key and its position (DerivedKey), in the incoming
	// message's scope. Metadata is mapped as by OutboxPublisher: Nats-Msg-Id is
	// dropped, so metadata copied from the incoming message does not carry its
	// Msg-Id onto the produced one. Must be a literal NATS subject (any subject:
	// the topology is yours), and lie under the installation's stream subjects:
	// the outbox refuses a message on any other subject with a permanent error,
	// instead of leaving it to the relay to retry forever.
	OutboxSubject string
}

func (c Config) validate() error {
	switch {
	case c.Consumer == "":
		return errors.New("idemwatermill: Config.Consumer is required")
	case c.KeyLifetime < 0:
		return errors.New("idemwatermill: Config.KeyLifetime must not be negative")
	}
	if c.OutboxSubject != "" {
		if err := idem.ValidateSubject(c.OutboxSubject); err != nil {
			return fmt.Errorf("idemwatermill: Config.OutboxSubject: %w", err)
		}
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.KeyLifetime == 0 {
		c.KeyLifetime = dedupe.DefaultLifetime
	}
	return c
}
