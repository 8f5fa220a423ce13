package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
)

// Delivery is one message as the consumer hands it to a handler. Its Key is the
// intent's scoped key (idem.ScopedKey: what producer.Intent.ScopedKey returns at
// the ingress, not Intent.Key, the client's key without its scope).
type Delivery struct {
	idem.Message
	// Deliveries is how many times JetStream has delivered this message (1 on the
	// first delivery).
	Deliveries int
	// StreamSeq is the message's sequence in the stream.
	StreamSeq uint64
	// EnqueuedAt is when the message's outbox row was written (the relay's
	// idem.HeaderEnqueuedAt), by the database's clock; zero when the message did
	// not come through an idem relay.
	EnqueuedAt time.Time

	raw  jetstream.Msg
	ctx  context.Context // carries the producer's trace and this delivery's span
	span trace.Span
}

// Context returns a context carrying this delivery's tracing span, a child of the
// producer's trace when the message carried a traceparent header. Handlers of a
// batch use it to attribute their own spans to the right intent.
func (d *Delivery) Context() context.Context {
	if d.ctx == nil {
		return context.Background()
	}
	return d.ctx
}

// Handler runs the effect of one message inside the inbox transaction. Everything it
// writes through tx commits together with the inbox claim, or not at all. The
// returned result is stored as the key's first result.
//
// Returning an error rolls back the message's claim and writes; the message is
// redelivered after a delay, up to MaxDeliver attempts, then dead-lettered. Wrap the
// error with Permanent when retrying cannot help (a payload that does not decode).
type Handler interface {
	Handle(ctx context.Context, tx pgx.Tx, d *Delivery) (result []byte, err error)
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, tx pgx.Tx, d *Delivery) ([]byte, error)

// Handle calls f.
func (f HandlerFunc) Handle(ctx context.Context, tx pgx.Tx, d *Delivery) ([]byte, error) {
	return f(ctx, tx, d)
}

// BatchHandler runs the effects of many new messages in one call, so that a handler
// can write them with one statement. It must return one result per delivery, in
// order. If it returns an error the consumer cannot tell which message failed: it
// rolls back and runs each message of the batch alone, so BatchHandler must also
// handle batches of one.
type BatchHandler interface {
	HandleBatch(ctx context.Context, tx pgx.Tx, ds []*Delivery) (results [][]byte, err error)
}

// permanentError marks an error that no retry can fix.
type permanentError struct{ err error }

func (e permanentError) Error() string { return "permanent: " + e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// Permanent wraps err so the consumer dead-letters the message at once instead of
// retrying it.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err}
}

// IsPermanent reports whether err was wrapped with Permanent.
func IsPermanent(err error) bool {
	var p permanentError
	return errors.As(err, &p)
}

// singleAsBatch runs a Handler over a batch; it stops at the first failure and says
// which delivery failed.
type singleAsBatch struct{ h Handler }

type failedAt struct {
	index int
	err   error
}

func (e failedAt) Error() string { return fmt.Sprintf("delivery %d: %v", e.index, e.err) }
func (e failedAt) Unwrap() error { return e.err }

func (s singleAsBatch) HandleBatch(ctx context.Context, tx pgx.Tx, ds []*Delivery) ([][]byte, error) {
	out := make([][]byte, len(ds))
	for i, d := range ds {
		r, err := s.h.Handle(ctx, tx, d)
		if err != nil {
			return nil, failedAt{index: i, err: err}
		}
		out[i] = r
	}
	return out, nil
}

// BatchError tells the consumer which delivery of a HandleBatch call failed, so it
// can retry or dead-letter that one alone and run the rest of the batch again.
func BatchError(index int, err error) error { return failedAt{index: index, err: err} }
