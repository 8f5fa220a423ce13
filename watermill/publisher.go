package idemwatermill

import (
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/outbox"
)

// OutboxPublisher is a Watermill message.Publisher that writes messages into idem's
// outbox (idem_outbox) inside one transaction. The rows exist if and only if that
// transaction commits, together with the caller's business rows; idem's relay then
// publishes them to JetStream with a Nats-Msg-Id derived from subject and key.
//
// Mapping of a Watermill message onto an outbox row:
//
//   - topic: the JetStream subject. It must be a literal subject under "idem."
//     (tokens separated by dots, no empty token, no wildcard or whitespace), e.g.
//     "idem.payments.charge". Topics are not rewritten.
//   - metadata "Idempotency-Key": the key. Required; the message UUID is not used
//     in its place. Metadata "Idempotency-Scope", when set, is joined to it
//     (idem.ScopedKey), so two tenants' equal keys stay apart.
//   - payload: the payload (a nil payload is stored as empty).
//   - every other metadata entry: a header. An explicit "Nats-Msg-Id" replaces the
//     derived one, as for outbox.Enqueue.
//
// An OutboxPublisher is bound to its transaction and is safe for concurrent use
// (calls are serialised, as the transaction requires). It never commits or rolls
// back the transaction: its owner does.
type OutboxPublisher struct {
	mu     sync.Mutex
	tx     pgx.Tx
	closed bool
}

var _ message.Publisher = (*OutboxPublisher)(nil)

// NewOutboxPublisher returns a publisher writing into the outbox inside tx. In a
// handler run by Middleware, pass the transaction from TxFromContext.
func NewOutboxPublisher(tx pgx.Tx) *OutboxPublisher {
	return &OutboxPublisher{tx: tx}
}

// Publish writes msgs into the outbox under topic, in one statement: either all of
// them are written or none. The statement runs under the context of the first
// message. After an error the transaction is aborted (Postgres refuses further
// statements in it), so the owner must roll it back.
func (p *OutboxPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.closed:
		return errors.New("idemwatermill: publish: publisher is closed")
	case p.tx == nil:
		return errors.New("idemwatermill: publish: nil transaction")
	}
	if len(msgs) == 0 {
		return nil
	}
	if err := checkSubject(topic); err != nil {
		return fmt.Errorf("idemwatermill: publish: %w", err)
	}
	out := make([]idem.Message, len(msgs))
	for i, m := range msgs {
		im, err := toIdem(topic, m)
		if err != nil {
			return fmt.Errorf("idemwatermill: publish message %d (%s): %w", i, m.UUID, err)
		}
		out[i] = im
	}
	if err := outbox.EnqueueBatch(msgs[0].Context(), p.tx, out); err != nil {
		return fmt.Errorf("idemwatermill: publish: %w", err)
	}
	return nil
}

// Close makes further Publish calls fail. It does not touch the transaction.
func (p *OutboxPublisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	return nil
}

// toIdem maps one Watermill message onto an outbox message.
func toIdem(subject string, m *message.Message) (idem.Message, error) {
	key, err := keyOf(m.Metadata)
	if err != nil {
		return idem.Message{}, err
	}
	headers := make(map[string]string, len(m.Metadata))
	for k, v := range m.Metadata {
		if k == idem.HeaderKey || k == idem.HeaderScope {
			continue // carried by the key itself
		}
		if err := checkHeader(k, v); err != nil {
			return idem.Message{}, err
		}
		headers[k] = v
	}
	payload := []byte(m.Payload)
	if payload == nil {
		payload = []byte{}
	}
	return idem.Message{Key: key, Subject: subject, Headers: headers, Payload: payload}, nil
}

// checkSubject accepts a literal NATS subject under "idem.".
func checkSubject(s string) error {
	if !strings.HasPrefix(s, "idem.") {
		return fmt.Errorf("topic %q is not under %q: the topic is the JetStream subject (e.g. %s)", s, "idem.", idem.SubjectCharge)
	}
	for _, tok := range strings.Split(s, ".") {
		if tok == "" || tok == "*" || tok == ">" || strings.ContainsAny(tok, " \t\r\n*>") {
			return fmt.Errorf("topic %q is not a literal subject (empty token, wildcard or whitespace)", s)
		}
	}
	return nil
}

// checkHeader rejects metadata that cannot travel as a NATS header.
func checkHeader(name, value string) error {
	if name == "" {
		return errors.New("metadata with an empty name cannot be a header")
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c > '~' || c == ':' {
			return fmt.Errorf("metadata name %q cannot be a header: byte %d is %q", name, i, c)
		}
	}
	if strings.ContainsAny(value, "\r\n") {
		return fmt.Errorf("metadata %q cannot be a header: its value contains a line break", name)
	}
	return nil
}
