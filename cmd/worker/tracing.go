package main

import (
	"context"
	"fmt"
	"io"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// traceExporter picks the span exporter: --trace (IDEM_TRACE) when given, else the
// standard OTEL_TRACES_EXPORTER, otelEnv ("otlp", "console" for stderr, "none").
func traceExporter(flag, otelEnv string) (string, error) {
	if flag != "" {
		switch flag {
		case "none", "stderr", "otlp":
			return flag, nil
		}
		return "", fmt.Errorf("--trace must be none, stderr or otlp, not %q", flag)
	}
	switch v := strings.TrimSpace(otelEnv); v {
	case "", "none":
		return "none", nil
	case "otlp":
		return "otlp", nil
	case "console":
		return "stderr", nil
	default:
		return "", fmt.Errorf("OTEL_TRACES_EXPORTER=%q: the worker exports otlp, console or none", v)
	}
}

// setupTracing sets the global propagator (W3C trace context and baggage: the
// worker carries a caller's trace through the outbox whether or not it exports
// spans) and, unless the exporter is "none", a tracer provider exporting to
// stderr or over OTLP/HTTP. OTLP is configured by the standard variables
// (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
// OTEL_EXPORTER_OTLP_HEADERS, ...); the service is named by OTEL_SERVICE_NAME
// (default idem-worker) and OTEL_RESOURCE_ATTRIBUTES. The returned shutdown flushes
// the spans still buffered.
func setupTracing(ctx context.Context, exporter string, stderr io.Writer) (trace.TracerProvider, func(context.Context) error, error) {
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	var exp sdktrace.SpanExporter
	var err error
	switch exporter {
	case "none":
		return nil, func(context.Context) error { return nil }, nil
	case "stderr":
		exp, err = stdouttrace.New(stdouttrace.WithWriter(stderr))
	case "otlp":
		exp, err = otlptracehttp.New(ctx)
	default:
		return nil, nil, fmt.Errorf("unknown span exporter %q", exporter)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("tracing: %s exporter: %w", exporter, err)
	}
	// Later detectors win: the environment overrides the default name.
	res, err := resource.New(ctx, resource.WithAttributes(semconv.ServiceName("idem-worker")), resource.WithTelemetrySDK(), resource.WithFromEnv())
	if err != nil {
		return nil, nil, fmt.Errorf("tracing: resource: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	return tp, tp.Shutdown, nil
}
