package idemtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/natssubject"
	"github.com/idemkit/idem/wire"
)

// Timings the kit gives a Case's consumer where the user left them zero, so that a
// check runs in seconds: the crash-after-commit scenario waits one AckWait for the
// redelivery, the external takeover one LeaseFor more.
const (
	shortAckWait  = time.Second
	shortLeaseFor = time.Second
	shortBackoff  = 50 * time.Millisecond
)

// defaultTimeout bounds each wait of a check (Case.Timeout's default).
const defaultTimeout = 30 * time.Second

// defaultStream is the stream a check creates when Case.Stream.Name is empty.
const defaultStream = "IDEMTEST"

// Case is one handler to check: the user's consumer and one message of the kind it
// consumes.
type Case struct {
	// Consumer is the user's consumer: Name, Subject and exactly one of Handler,
	// BatchHandler and External. The check runs it in an installation of the
	// Env's schema on Stream, and shortens AckWait, Backoff and LeaseFor when they
	// are zero (to 1s, 50ms and 1s), so that a check runs in seconds. Its log goes to
	// Config.Logger.
	Consumer consumer.Config
	// Stream is the JetStream stream the check creates for its messages, and
	// deletes when it ends. Name defaults to "IDEMTEST", Subjects to
	// []string{Consumer.Subject}. It must not exist on the Env yet.
	Stream install.Stream
	// Message is what the producer would send: Subject (a literal subject the
	// consumer's filter matches) and Payload are required; Key defaults to a fresh
	// idem.NewKey() (it may be a scoped key, see idem.ScopedKey); Headers travel
	// with every copy, and must not set Idempotency-Key or Nats-Msg-Id, which the
	// kit sets as the relay would.
	Message idem.Message
	// Changed is the payload of the "same key, changed payload" scenario (default:
	// Payload with one byte appended). It must differ from Payload.
	Changed []byte
	// PayloadFor returns the payload sent under a fresh key: the two crash scenarios
	// each need a key whose effect has not happened yet. The default is
	// Message.Payload; set PayloadFor when the handler refuses one payload under two
	// keys (a unique order id inside the payload, say).
	PayloadFor func(key string) []byte
	// Effects counts the handler's effects for a scoped key: rows of the user's
	// table for an in-transaction handler, the downstream's executions (a fake's
	// count) for an External. A fake downstream sees the key the handler derived
	// with Effect.KeyFor, not the scoped key: KeyFor(key, purpose) is that key.
	// Required: this count is what the check asserts.
	Effects func(ctx context.Context, pool *pgxpool.Pool, key string) (int, error)
	// Timeout bounds each wait (default 30s). A wait that runs out fails its
	// scenario; the check does not hang.
	Timeout time.Duration
}

// KeyFor returns the key an External handler presents downstream for purpose when
// it performs the effect of scoped key key: what consumer.Effect.KeyFor returns on
// every attempt at that key. Case.Effects uses it to count a fake downstream's
// executions under the key the downstream saw.
func KeyFor(key, purpose string) string {
	// Effect.KeyFor itself, so the two cannot drift apart.
	e := &consumer.Effect{Delivery: &consumer.Delivery{Message: idem.Message{Key: key}}}
	return e.KeyFor(purpose)
}

// plan is a validated Case with its defaults filled in and its keys minted.
type plan struct {
	cfg consumer.Config
	// inst is the check's installation: the Env's tables, the Case's stream.
	inst     *install.Installation
	stream   install.Stream
	msg      idem.Message
	changed  []byte
	external bool
	timeout  time.Duration
	effects  func(ctx context.Context, pool *pgxpool.Pool, key string) (int, error)
	// keyBefore and keyAfter are the fresh keys of the crash scenarios (before
	// and after the commit, or the effect's outcome); payloads maps each key to
	// the payload sent under it.
	keyBefore, keyAfter string
	payloads            map[string][]byte
}

// newPlan validates c against env and fills in the defaults. Every error names the
// Case field at fault.
func newPlan(env *Env, c Case) (*plan, error) {
	switch {
	case env == nil:
		return nil, errors.New("idemtest: nil Env (use Start or New)")
	case env.JS == nil:
		return nil, errors.New("idemtest: the Env has no broker: set Config.NATSURL to a JetStream server of its own (github.com/idemkit/idem/embeddednats starts one in the test process)")
	case c.Effects == nil:
		return nil, errors.New("idemtest: Case.Effects is required: the check asserts the count of effects it returns for a key")
	case c.Message.Subject == "":
		return nil, errors.New("idemtest: Case.Message.Subject is required")
	case len(c.Message.Payload) == 0:
		return nil, errors.New("idemtest: Case.Message.Payload is required (the changed-payload scenario needs one to change)")
	case c.Changed != nil && bytes.Equal(c.Changed, c.Message.Payload):
		return nil, errors.New("idemtest: Case.Changed equals Case.Message.Payload; it must differ, or be nil for the default")
	case c.Timeout < 0:
		return nil, errors.New("idemtest: Case.Timeout must not be negative")
	}
	if err := idem.ValidateSubject(c.Message.Subject); err != nil {
		return nil, fmt.Errorf("idemtest: Case.Message.Subject: %w", err)
	}
	for name, v := range c.Message.Headers {
		if name == idem.HeaderKey || name == idem.HeaderMsgID {
			return nil, fmt.Errorf("idemtest: Case.Message.Headers: %s is set by the kit, as the relay sets it; do not set it", name)
		}
		if err := wire.ValidateHeader(name, v); err != nil {
			return nil, fmt.Errorf("idemtest: Case.Message.Headers: %w", err)
		}
	}

	p := &plan{msg: c.Message, changed: c.Changed, effects: c.Effects, timeout: c.Timeout, external: c.Consumer.External != nil}
	if p.timeout == 0 {
		p.timeout = defaultTimeout
	}
	if p.changed == nil {
		p.changed = append(bytes.Clone(c.Message.Payload), '!')
	}
	scope := ""
	if p.msg.Key == "" {
		p.msg.Key = string(idem.NewKey())
	} else {
		var err error
		if scope, _, err = idem.ParseScopedKey(p.msg.Key); err != nil {
			return nil, fmt.Errorf("idemtest: Case.Message.Key: %w", err)
		}
	}
	// The fresh keys keep the user's scope: a handler may read it.
	p.keyBefore = idem.ScopedKey(scope, idem.NewKey())
	p.keyAfter = idem.ScopedKey(scope, idem.NewKey())
	p.payloads = map[string][]byte{p.msg.Key: p.msg.Payload}
	for _, k := range []string{p.keyBefore, p.keyAfter} {
		p.payloads[k] = p.msg.Payload
		if c.PayloadFor != nil {
			if p.payloads[k] = c.PayloadFor(k); len(p.payloads[k]) == 0 {
				return nil, errors.New("idemtest: Case.PayloadFor returned an empty payload")
			}
		}
	}

	if err := p.fillConsumer(env, c); err != nil {
		return nil, err
	}
	if err := p.fillStream(env, c.Stream); err != nil {
		return nil, err
	}
	return p, nil
}

func (p *plan) fillConsumer(env *Env, c Case) error {
	cfg := c.Consumer
	if cfg.AckWait == 0 {
		cfg.AckWait = shortAckWait
	}
	if cfg.Backoff == nil {
		cfg.Backoff = func(int) time.Duration { return shortBackoff }
	}
	if cfg.LeaseFor == 0 {
		cfg.LeaseFor = shortLeaseFor
	}
	// consumer.New validates the rest (Name, Subject, one handler, sizes) without
	// touching the broker; any stream will do for that, so the Case's own, which
	// defaults from the consumer's Subject, is checked after it.
	probe, err := env.installation(install.Stream{Name: defaultStream, Subjects: []string{">"}})
	if err != nil {
		return fmt.Errorf("idemtest: %w", err)
	}
	if _, err := consumer.New(probe, cfg); err != nil {
		return fmt.Errorf("idemtest: Case.Consumer: %w", err)
	}
	if !natssubject.Matches(cfg.Subject, p.msg.Subject) {
		return fmt.Errorf("idemtest: Case.Message.Subject %q is not matched by Case.Consumer.Subject %q: the consumer would never see it",
			p.msg.Subject, cfg.Subject)
	}
	p.cfg = cfg
	return nil
}

func (p *plan) fillStream(env *Env, s install.Stream) error {
	if s.Name == "" {
		s.Name = defaultStream
	}
	if len(s.Subjects) == 0 {
		s.Subjects = []string{p.cfg.Subject}
	}
	inst, err := env.installation(s)
	if err != nil {
		return fmt.Errorf("idemtest: Case.Stream: %w", err)
	}
	if !natssubject.Under(s.Subjects, p.msg.Subject) {
		return fmt.Errorf("idemtest: Case.Message.Subject %q is outside Case.Stream.Subjects %q", p.msg.Subject, s.Subjects)
	}
	p.stream, p.inst = s, inst
	return nil
}
