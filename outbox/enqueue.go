package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"strings"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
)

// Enqueue writes msg into the outbox inside the caller's transaction, so the message
// exists if and only if the caller's business rows commit. The relay is woken by a
// NOTIFY that Postgres delivers at commit.
//
// msg.Key must be the scoped key (idem.ScopedKey) and msg.Subject must lie under the
// stream's subjects ("idem.>"). The Nats-Msg-Id is derived from both (idem.MsgID)
// unless msg.Headers sets one explicitly.
func Enqueue(ctx context.Context, tx pgx.Tx, msg idem.Message) error {
	return EnqueueBatch(ctx, tx, []idem.Message{msg})
}

// EnqueueBatch writes many messages in one round trip, for producers that emit a
// batch of intents in one transaction.
func EnqueueBatch(ctx context.Context, tx pgx.Tx, msgs []idem.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	keys := make([]string, len(msgs))
	subjects := make([]string, len(msgs))
	msgIDs := make([]string, len(msgs))
	headers := make([]string, len(msgs))
	payloads := make([][]byte, len(msgs))
	for i, m := range msgs {
		if err := validate(m); err != nil {
			return fmt.Errorf("outbox: enqueue message %d: %w", i, err)
		}
		h := withTraceContext(ctx, m.Headers)
		hj, err := json.Marshal(h)
		if err != nil {
			return fmt.Errorf("outbox: enqueue: encode headers: %w", err)
		}
		keys[i], subjects[i], msgIDs[i] = m.Key, m.Subject, idem.MsgID(m.Subject, m.Key)
		if id := h[idem.HeaderMsgID]; id != "" {
			// An explicit Msg-Id (a dead-letter replay) gets past the broker's
			// de-duplication window; the inbox still folds it by key.
			msgIDs[i] = id
		}
		headers[i], payloads[i] = string(hj), m.Payload
	}
	if _, err := tx.Exec(ctx, sqlEnqueue, keys, subjects, msgIDs, headers, payloads); err != nil {
		return fmt.Errorf("outbox: enqueue: %w", err)
	}
	if _, err := tx.Exec(ctx, sqlNotify, NotifyChannel); err != nil {
		return fmt.Errorf("outbox: enqueue: notify: %w", err)
	}
	return nil
}

// withTraceContext adds the caller's W3C trace context (traceparent, tracestate) to
// the message headers, so the consumer's span continues the producer's trace. The
// caller's map is not modified.
func withTraceContext(ctx context.Context, headers map[string]string) map[string]string {
	h := make(map[string]string, len(headers)+2)
	maps.Copy(h, headers)
	if trace.SpanContextFromContext(ctx).IsValid() {
		if _, set := h["traceparent"]; !set {
			propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(h))
		}
	}
	return h
}

func validate(m idem.Message) error {
	if m.Key == "" {
		return idem.ErrMissingKey
	}
	if !strings.HasPrefix(m.Subject, "idem.") || strings.ContainsAny(m.Subject, " \t\r\n*>") {
		return fmt.Errorf("subject %q is not a literal subject under idem.>", m.Subject)
	}
	if m.Payload == nil {
		return fmt.Errorf("nil payload")
	}
	return nil
}
