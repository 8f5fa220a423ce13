// Package otelmsg holds what idem's spans share: the OpenTelemetry messaging
// semantic conventions for NATS (messaging.system "nats", destination, operation
// type and name, message id, consumer group, batch size), the carrier of trace
// context in message headers (through the global propagator, so whatever the
// application set with otel.SetTextMapPropagator travels), and the instrumentation
// scope name.
package otelmsg

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// Scope is the instrumentation scope of every idem tracer.
const Scope = "github.com/idemkit/idem"

// System is messaging.system: JetStream is NATS.
var System = semconv.MessagingSystemKey.String("nats")

// Operation names (messaging.operation.name), paired with their types.
const (
	OpEnqueue = "enqueue" // create: the message is written to the outbox
	OpPublish = "publish" // send: the relay publishes a batch to JetStream
	OpProcess = "process" // process: a consumer runs the message's effect
)

// Tracer returns idem's tracer from tp, or from the global provider when tp is nil.
func Tracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(Scope)
}

// Create is the attributes of a producer span: one message written to the outbox.
func Create(subject, msgID string) []attribute.KeyValue {
	return []attribute.KeyValue{System, semconv.MessagingOperationTypeCreate, semconv.MessagingOperationName(OpEnqueue),
		semconv.MessagingDestinationName(subject), semconv.MessagingMessageID(msgID)}
}

// Send is the attributes of the relay's span for a batch of n messages to
// destination (the subject when they share one, else the stream).
func Send(destination string, n int) []attribute.KeyValue {
	return []attribute.KeyValue{System, semconv.MessagingOperationTypeSend, semconv.MessagingOperationName(OpPublish),
		semconv.MessagingDestinationName(destination), semconv.MessagingBatchMessageCount(n)}
}

// Process is the attributes of a consumer's span for one message.
func Process(subject, msgID, consumer string) []attribute.KeyValue {
	return []attribute.KeyValue{System, semconv.MessagingOperationTypeProcess, semconv.MessagingOperationName(OpProcess),
		semconv.MessagingDestinationName(subject), semconv.MessagingMessageID(msgID), semconv.MessagingConsumerGroupName(consumer)}
}

// SpanName is "{operation} {destination}", the conventions' low-cardinality name:
// destinations are subjects, which name a kind of message, not one.
func SpanName(op, destination string) string { return op + " " + destination }

// Inject writes ctx's trace context into headers with the global propagator.
func Inject(ctx context.Context, headers map[string]string) {
	otel.GetTextMapPropagator().Inject(ctx, propagation.MapCarrier(headers))
}

// Extract returns ctx with the trace context that headers carry, if any.
func Extract(ctx context.Context, headers map[string]string) context.Context {
	return otel.GetTextMapPropagator().Extract(ctx, propagation.MapCarrier(headers))
}

// Fail records err on span and marks it failed.
func Fail(span trace.Span, err error) {
	if err == nil || !span.IsRecording() {
		return
	}
	span.RecordError(err)
	span.SetStatus(codes.Error, err.Error())
}

// Failf marks span failed with a message of its own (a dead letter's reason).
func Failf(span trace.Span, format string, args ...any) {
	if span.IsRecording() {
		span.SetStatus(codes.Error, fmt.Sprintf(format, args...))
	}
}
