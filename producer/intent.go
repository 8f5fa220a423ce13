package producer

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/outbox"
)

// Intent is what a handler wrapped by Middleware receives about its request: the
// transaction every write must go through, and the intent's name.
type Intent struct {
	// Tx is the request's transaction. It commits with the stored response, or not
	// at all. Do not commit or roll it back, and do not use it after the handler
	// returns.
	Tx pgx.Tx
	// Scope is the request's Idempotency-Scope ("" for none).
	Scope string
	// Key is the request's Idempotency-Key as the client sent it, without its
	// scope. What the outbox carries and a consumer's Delivery.Key holds is
	// ScopedKey: store that in a row a consumer's effect must match.
	Key idem.Key

	outbox *outbox.Outbox
	batch  *pgx.Batch // the outbox INSERTs, sent with the stored response
}

// ScopedKey is idem.ScopedKey(Scope, Key): the identity carried past the ingress,
// so two tenants' identical keys stay two intents.
func (i *Intent) ScopedKey() string { return idem.ScopedKey(i.Scope, i.Key) }

// Enqueue writes a message of this intent into the outbox, inside the request's
// transaction, stamped with the scoped key: it exists if and only if the request's
// business rows and stored response commit. headers may be nil.
//
// The message is checked at once (outbox.ErrTooLarge, a subject outside the
// stream, a bad header: nothing is written), and its INSERT is sent with the
// stored response after the handler returns, in the same round trip: so the
// handler's own queries in Tx do not see the row. The relay is woken after the
// commit.
func (i *Intent) Enqueue(ctx context.Context, subject string, payload []byte, headers map[string]string) error {
	return i.EnqueueMessage(ctx, idem.Message{Subject: subject, Payload: payload, Headers: headers})
}

// EnqueueMessage is Enqueue for a message with a name: an intent that sends several
// messages on one subject names each (m.Name), or every consumer of the subject
// takes the second for the first. m.Key is set to the intent's scoped key.
func (i *Intent) EnqueueMessage(ctx context.Context, m idem.Message) error {
	if i.outbox == nil || i.batch == nil {
		return errors.New("producer: intent: not built by Middleware")
	}
	m.Key = i.ScopedKey()
	return i.outbox.AddToBatch(ctx, i.batch, m)
}

type intentKey struct{}

func withIntent(ctx context.Context, in *Intent) context.Context {
	return context.WithValue(ctx, intentKey{}, in)
}

// IntentFrom returns the request's Intent inside a handler wrapped by Middleware;
// ok is false outside it. A handler that finds none must not write: outside the
// middleware's transaction nothing guarantees once.
func IntentFrom(ctx context.Context) (in *Intent, ok bool) {
	in, ok = ctx.Value(intentKey{}).(*Intent)
	return in, ok && in != nil
}
