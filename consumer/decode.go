package consumer

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/otelmsg"
)

// Dead-letter reasons (the prefix of idem_dead_letters.reason).
const (
	reasonNoKey      = "missing Idempotency-Key header"
	reasonBadKey     = "malformed Idempotency-Key"
	reasonMismatch   = "fingerprint mismatch: this key was first seen with a different payload"
	reasonPermanent  = "permanent handler error"
	reasonMaxDeliver = "max deliveries exceeded"
	reasonBadName    = "malformed " + idem.HeaderMessage
)

// decode turns a JetStream message into a Delivery, or says why it is poison.
func decode(m jetstream.Msg) (*Delivery, string) {
	d := &Delivery{raw: m, Deliveries: 1}
	d.Subject = m.Subject()
	d.Payload = m.Data()
	if d.Payload == nil {
		d.Payload = []byte{}
	}
	d.Headers = map[string]string{}
	for k, v := range m.Headers() {
		if len(v) > 0 {
			d.Headers[k] = v[0]
		}
	}
	if md, err := m.Metadata(); err == nil {
		d.Deliveries = int(md.NumDelivered)
		d.StreamSeq = md.Sequence.Stream
	}
	if at, err := time.Parse(time.RFC3339Nano, d.Headers[idem.HeaderEnqueuedAt]); err == nil {
		d.EnqueuedAt = at
	}
	d.Key = m.Headers().Get(idem.HeaderKey)
	if d.Key == "" {
		return d, reasonNoKey
	}
	if _, _, err := idem.ParseScopedKey(d.Key); err != nil {
		return d, fmt.Sprintf("%s: %v", reasonBadKey, err)
	}
	d.Name = d.Headers[idem.HeaderMessage]
	if err := idem.ValidateMessageName(d.Name); err != nil {
		return d, fmt.Sprintf("%s: %v", reasonBadName, err)
	}
	return d, ""
}

// startSpan opens the delivery's process span ("process <subject>", OpenTelemetry
// messaging conventions) as a child of the trace the producer put in the headers,
// read with the global propagator.
func (c *Consumer) startSpan(ctx context.Context, d *Delivery) {
	parent := otelmsg.Extract(ctx, d.Headers)
	attrs := append(otelmsg.Process(d.Subject, d.Headers[idem.HeaderMsgID], c.cfg.Name),
		attribute.String("idem.key", d.Key),
		attribute.Int("idem.deliveries", d.Deliveries))
	d.ctx, d.span = c.tracer.Start(parent, otelmsg.SpanName(otelmsg.OpProcess, d.Subject),
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
}
