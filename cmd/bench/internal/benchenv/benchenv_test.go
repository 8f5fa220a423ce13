package benchenv

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

func TestProfilePath(t *testing.T) {
	for _, tc := range []struct{ path, label, want string }{
		{"cpu.pprof", "e2e", "cpu.e2e.pprof"},
		{"/tmp/prof/cpu.pprof", "e2e-http-rate", "/tmp/prof/cpu.e2e-http-rate.pprof"},
		{"cpu", "relay", "cpu.relay"},
	} {
		if got := ProfilePath(tc.path, tc.label); got != tc.want {
			t.Errorf("ProfilePath(%q, %q) = %q, want %q", tc.path, tc.label, got, tc.want)
		}
	}
}

func TestStatementName(t *testing.T) {
	if got := statementName("SELECT  1\n\tFROM   t"); got != "SELECT 1 FROM t" {
		t.Errorf("statementName folds whitespace: %q", got)
	}
	if got := statementName(strings.Repeat("x", 100)); len(got) != 70 {
		t.Errorf("statementName keeps %d characters, want 70", len(got))
	}
}

func TestSQLTracerAddsUpByStatementAndResets(t *testing.T) {
	tr := newSQLTracer()
	for _, sql := range []string{"SELECT 1", "SELECT  1", "COMMIT"} {
		ctx := tr.TraceQueryStart(context.Background(), nil, pgx.TraceQueryStartData{SQL: sql})
		tr.TraceQueryEnd(ctx, nil, pgx.TraceQueryEndData{})
	}
	tr.TraceQueryEnd(context.Background(), nil, pgx.TraceQueryEndData{}) // no start: ignored
	if got := tr.stats["SELECT 1"]; got == nil || got.Calls != 2 {
		t.Fatalf("SELECT 1 counted %+v, want 2 calls", got)
	}
	var buf bytes.Buffer
	tr.Print(&buf, "e2e", 0)
	if !strings.Contains(buf.String(), "2 calls") || !strings.Contains(buf.String(), "COMMIT") {
		t.Errorf("Print wrote %q", buf.String())
	}
	tr.Reset()
	if len(tr.stats) != 0 {
		t.Errorf("Reset left %d statements", len(tr.stats))
	}
}
