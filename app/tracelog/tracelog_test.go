package tracelog_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/app/tracelog"
)

func TestHandlerAddsTheSpan(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	log := slog.New(tracelog.New(slog.NewTextHandler(&buf, nil))).With("component", "relay")
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid}))

	log.InfoContext(ctx, "published")
	log.Info("no context")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("%d lines: %q", len(lines), buf.String())
	}
	if !strings.Contains(lines[0], "trace_id=4bf92f3577b34da6a3ce929d0e0e4736") || !strings.Contains(lines[0], "span_id=00f067aa0ba902b7") || !strings.Contains(lines[0], "component=relay") {
		t.Errorf("with a span: %q, want its trace_id, span_id and the logger's attributes", lines[0])
	}
	if strings.Contains(lines[1], "trace_id") {
		t.Errorf("without a span: %q carries a trace_id", lines[1])
	}
}
