package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"go.opentelemetry.io/otel"
)

func TestTraceExporterChoice(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		flag, env, want string
		fails           bool
	}{
		{"", "", "none", false},
		{"", "otlp", "otlp", false},
		{"", "console", "stderr", false},
		{"", "none", "none", false},
		{"", "zipkin", "", true},
		{"stderr", "otlp", "stderr", false}, // the flag wins
		{"otlp", "", "otlp", false},
		{"jaeger", "", "", true},
	} {
		got, err := traceExporter(tc.flag, tc.env)
		if (err != nil) != tc.fails || got != tc.want {
			t.Errorf("--trace %q, OTEL_TRACES_EXPORTER %q: %q, %v; want %q (error: %v)", tc.flag, tc.env, got, err, tc.want, tc.fails)
		}
	}
}

// With the otlp exporter, spans go over OTLP/HTTP to the endpoint the standard
// variable names, with the service name from OTEL_SERVICE_NAME.
func TestOTLPExportFollowsTheEnvironment(t *testing.T) {
	var posts atomic.Int64
	var body atomic.Value
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/traces" && r.Header.Get("Content-Type") == "application/x-protobuf" {
			b, _ := io.ReadAll(r.Body)
			body.Store(string(b))
			posts.Add(1)
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer collector.Close()
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.URL)
	t.Setenv("OTEL_SERVICE_NAME", "billing-worker")

	tp, shutdown, err := setupTracing(context.Background(), "otlp", io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	_, span := tp.Tracer("test").Start(context.Background(), "publish orders.created")
	span.End()
	if err := shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if posts.Load() == 0 {
		t.Fatal("no OTLP request reached the collector named by OTEL_EXPORTER_OTLP_ENDPOINT")
	}
	b, _ := body.Load().(string)
	for _, want := range []string{"publish orders.created", "billing-worker"} {
		if !strings.Contains(b, want) {
			t.Errorf("the exported spans lack %q", want)
		}
	}
	if otel.GetTextMapPropagator().Fields() == nil {
		t.Error("no global propagator set")
	}
}
