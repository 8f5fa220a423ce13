package scenario

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// watermillHTTP is the peer: the HTTP shape of e2e-http built with Watermill
// (watermill-sql publisher in the request transaction, its forwarder to
// JetStream, a router with its Deduplicator). It is a program of its own
// (-watermill-dir) in the benchmark's module, so Watermill's dependencies stay out
// of the library's go.mod; this scenario builds it, runs it with the HTTP scenarios' settings, and
// reads its rows (Result JSON) from its stdout.
type watermillHTTP struct{}

func (watermillHTTP) Name() string { return "watermill-http" }

func (watermillHTTP) Summary() string {
	return "the same HTTP shape built with Watermill (watermill-sql, forwarder, watermill-nats, Deduplicator): the peer in -watermill-dir"
}

func (s watermillHTTP) Rows(o Options) []string { return httpRows(s.Name(), o) }

// Run builds the peer and runs the binary directly rather than with go run,
// which would not pass an interrupt on: the peer drops its database when
// interrupted. Its stderr (progress, and go's download lines on a first build)
// passes through.
func (s watermillHTTP) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	o := h.Opts
	if _, err := os.Stat(filepath.Join(o.WatermillDir, "main.go")); err != nil {
		return nil, fmt.Errorf("%s: no peer program at %s (run the bench from the repository root, or set -watermill-dir): %w", s.Name(), o.WatermillDir, err)
	}
	tmp, err := os.MkdirTemp("", "idem-bench-watermill-")
	if err != nil {
		return nil, fmt.Errorf("%s: %w", s.Name(), err)
	}
	defer os.RemoveAll(tmp)
	exe := filepath.Join(tmp, "watermill-http")
	build := exec.CommandContext(ctx, "go", "build", "-o", exe, ".")
	build.Dir, build.Stdout, build.Stderr = o.WatermillDir, os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return nil, fmt.Errorf("%s: build the peer in %s: %w", s.Name(), o.WatermillDir, err)
	}

	cmd := exec.CommandContext(ctx, exe, watermillArgs(o)...)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, os.Stderr
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 30 * time.Second
	if err := cmd.Run(); err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return nil, fmt.Errorf("%s: the peer failed (%w); its messages are above", s.Name(), err)
		}
		return nil, fmt.Errorf("%s: %w", s.Name(), err)
	}
	var rs []report.Result
	if err := json.Unmarshal(stdout.Bytes(), &rs); err != nil {
		return nil, fmt.Errorf("%s: decode the peer's results: %w", s.Name(), err)
	}
	return rs, nil
}

// watermillArgs are the peer's flags for o: the HTTP scenarios' settings.
func watermillArgs(o Options) []string {
	args := []string{
		"-database-url", o.DatabaseURL,
		"-n", strconv.Itoa(o.N),
		"-clients", strconv.Itoa(o.HTTPClients),
		"-rate", strconv.Itoa(o.HTTPRate),
		"-rate-n", strconv.Itoa(o.HTTPRateN),
		"-timeout", o.Timeout.String(),
	}
	if o.Keep {
		args = append(args, "-keep")
	}
	return args
}
