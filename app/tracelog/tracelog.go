// Package tracelog attaches the current span's trace_id and span_id to every log
// record written with a context (slog's ...Context methods, which idem's
// components use throughout), so a log line can be found from its trace and a
// trace from its log lines.
package tracelog

import (
	"context"
	"log/slog"

	"go.opentelemetry.io/otel/trace"
)

// Handler wraps another slog.Handler.
type Handler struct{ slog.Handler }

// New wraps h.
func New(h slog.Handler) *Handler { return &Handler{Handler: h} }

// Handle adds trace_id and span_id when ctx carries a valid span context.
func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r = r.Clone()
		r.AddAttrs(slog.String("trace_id", sc.TraceID().String()), slog.String("span_id", sc.SpanID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

// WithAttrs keeps the wrapper around the derived handler.
func (h *Handler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &Handler{Handler: h.Handler.WithAttrs(attrs)}
}

// WithGroup keeps the wrapper around the derived handler.
func (h *Handler) WithGroup(name string) slog.Handler {
	return &Handler{Handler: h.Handler.WithGroup(name)}
}
