package idemwatermill

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/outbox"
)

// Config configures Middleware. The zero value of every optional field means its
// default.
type Config struct {
	// Consumer names the consumer in idem_inbox (its consumer column). Keys are
	// unique per consumer: two handlers that must each see every message need two
	// names. Required.
	Consumer string
	// Schema is the Postgres schema holding idem's tables (default "public"): the
	// middleware claims keys in its idem_inbox and, with OutboxSubject and no
	// Outbox, writes produced messages into its idem_outbox. Every idem component
	// of one installation must name the same schema.
	Schema string
	// KeyLifetime is how long a claimed key is remembered (default
	// dedupe.DefaultLifetime). It must outlast every window in which the same
	// message can be delivered again (the broker's retention, the redelivery
	// horizon, the producer's re-send horizon); see dedupe.Lifetimes. Watermill's
	// broker is not idem's, so nothing checks this for you: run
	// dedupe.Lifetimes{...}.Check at start-up with your broker's numbers.
	KeyLifetime time.Duration
	// OutboxSubject, when set, routes the messages a handler returns through idem's
	// outbox: they are written to idem_outbox on this subject inside the message's
	// transaction, so they commit with the claim and the handler's writes (or not
	// at all), and none is handed back to the router. idem's relay publishes them.
	// Without it the router publishes returned messages itself after the commit,
	// where a failed publish loses them (see the package documentation). A
	// returned message without Idempotency-Key metadata gets one derived from the
	// consumer, the incoming key and its position (DerivedKey), in the incoming
	// message's scope. Metadata is mapped as by OutboxPublisher: Nats-Msg-Id is
	// dropped, so metadata copied from the incoming message does not carry its
	// Msg-Id onto the produced one. Must be a literal NATS subject (any subject:
	// the topology is yours), and lie under Outbox's stream subjects.
	OutboxSubject string
	// Outbox is the outbox OutboxSubject writes through. Pass the one the rest of
	// the service uses (outbox.New with your stream's Subjects), so a subject no
	// stream stores is refused at the handler instead of being retried by the relay
	// forever; it must be of the same Schema. Nil means one built from Schema that
	// accepts any literal subject. Only meaningful with OutboxSubject.
	Outbox *outbox.Outbox
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

func (c Config) validate() error {
	switch {
	case c.Consumer == "":
		return errors.New("idemwatermill: Config.Consumer is required")
	case c.KeyLifetime < 0:
		return errors.New("idemwatermill: Config.KeyLifetime must not be negative")
	case c.Outbox != nil && c.OutboxSubject == "":
		// An outbox nobody writes to is a wiring mistake: the handler's messages
		// would go to the router, not where the caller meant them to go.
		return errors.New("idemwatermill: Config.Outbox is set but Config.OutboxSubject is empty")
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
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}
