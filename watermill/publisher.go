package idemwatermill

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/wire"
)

// OutboxPublisher is a Watermill message.Publisher that writes messages into idem's
// outbox (idem_outbox) through an *outbox.Outbox, inside one transaction. The rows
// exist if and only if that transaction commits, together with the caller's
// business rows; idem's relay then publishes them to JetStream with a Nats-Msg-Id
// derived from subject and key.
//
// Mapping of a Watermill message onto an outbox message:
//
//   - topic: the JetStream subject, as is. It must be a literal NATS subject
//     (idem.ValidateSubject: dot-separated tokens, none empty, no wildcard or
//     whitespace), e.g. "orders.created", and lie under the stream subjects of
//     the Outbox's installation. The subjects are yours; nothing is prefixed.
//   - metadata "Idempotency-Key": the key. Required; the message UUID is not used
//     in its place. It may be a scoped key (as idem's relay stamps it on the
//     messages a Watermill subscriber receives); metadata "Idempotency-Scope",
//     when set, is joined to a bare key (idem.ScopedKey), so two tenants' equal
//     keys stay apart.
//   - payload: the payload (a nil payload is stored as empty).
//   - metadata "Nats-Msg-Id": dropped. The relay derives the Msg-Id from subject
//     and key (idem.MsgID); a Msg-Id copied from an incoming message would make the
//     broker fold the new message into that one inside its duplicate window, and
//     the outbox refuses a caller-set Msg-Id. Handlers that copy the incoming
//     metadata onto their messages (trace ids, correlation ids) need not filter it.
//   - every other metadata entry: a header (wire.ValidateHeader).
//
// A message that cannot be mapped, or that the outbox refuses before writing (a
// subject outside the stream's subjects), is refused with a permanent error (see
// IsPermanent) and nothing of the call is written; the transaction stays usable.
//
// An OutboxPublisher is bound to its transaction and is safe for concurrent use
// (calls are serialised, as the transaction requires). It never commits or rolls
// back the transaction: its owner does.
type OutboxPublisher struct {
	mu     sync.Mutex
	ob     *outbox.Outbox
	tx     pgx.Tx
	closed bool
}

var _ message.Publisher = (*OutboxPublisher)(nil)

// NewOutboxPublisher returns a publisher writing into ob inside tx. ob (outbox.New
// of the service's installation) carries the schema of idem's tables and the
// stream subjects that topics must lie under. In a handler run by Middleware, pass
// the transaction from TxFromContext.
func NewOutboxPublisher(ob *outbox.Outbox, tx pgx.Tx) *OutboxPublisher {
	return &OutboxPublisher{ob: ob, tx: tx}
}

// Publish writes msgs into the outbox under topic, in one statement: either all of
// them are written or none. The statement runs under the context of the first
// message. After an error from the statement the transaction is aborted (Postgres
// refuses further statements in it), so the owner must roll it back; a refusal
// (a permanent error) runs no statement.
func (p *OutboxPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.closed:
		return errors.New("idemwatermill: publish: publisher is closed")
	case p.ob == nil:
		return errors.New("idemwatermill: publish: nil outbox")
	case p.tx == nil:
		return errors.New("idemwatermill: publish: nil transaction")
	}
	if len(msgs) == 0 {
		return nil
	}
	if err := enqueue(msgs[0].Context(), p.ob, p.tx, topic, msgs); err != nil {
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

// enqueue maps msgs onto outbox messages under subject and writes them in one
// statement. Refusals are permanent; a failed statement is not.
func enqueue(ctx context.Context, ob *outbox.Outbox, tx pgx.Tx, subject string, msgs []*message.Message) error {
	if err := idem.ValidateSubject(subject); err != nil {
		return Permanent(fmt.Errorf("topic: %w", err))
	}
	out := make([]idem.Message, len(msgs))
	for i, m := range msgs {
		im, err := toIdem(subject, m)
		if err != nil {
			return fmt.Errorf("message %d (%s): %w", i, m.UUID, Permanent(err))
		}
		out[i] = im
	}
	if err := ob.Enqueue(ctx, tx, out...); err != nil {
		if errors.Is(err, idem.ErrBadSubject) {
			// Outside the stream's subjects: refused before any statement, and no
			// retry can change that.
			return Permanent(err)
		}
		return err
	}
	return nil
}

// dropped reports whether a metadata key never becomes a header: the key and scope
// travel in the key itself, and the relay sets the Msg-Id and the enqueue time (a
// handler that copies a consumed message's metadata would otherwise carry them);
// the broker's Nats- headers are instructions to the stream, never forwarded.
func dropped(name string) bool {
	return name == idem.HeaderScope || wire.IsRelayHeader(name) || wire.ReservedByBroker(name)
}

// toIdem maps one Watermill message onto an outbox message.
func toIdem(subject string, m *message.Message) (idem.Message, error) {
	key, err := keyOf(m.Metadata)
	if err != nil {
		return idem.Message{}, err
	}
	headers := make(map[string]string, len(m.Metadata))
	for k, v := range m.Metadata {
		if dropped(k) {
			continue
		}
		if err := wire.ValidateHeader(k, v); err != nil {
			return idem.Message{}, fmt.Errorf("metadata: %w", err)
		}
		headers[k] = v
	}
	payload := []byte(m.Payload)
	if payload == nil {
		payload = []byte{}
	}
	return idem.Message{Key: key, Subject: subject, Headers: headers, Payload: payload}, nil
}
