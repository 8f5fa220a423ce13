package main

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
)

// runWatermillHTTP builds the watermill-http peer, a program of its own in a nested
// module, runs it with the HTTP scenarios' settings, and reads its rows (the Result
// JSON) from its stdout. Its stderr (progress, and go's download lines on a first
// build) passes through. The binary is run directly rather than with go run, which
// would not pass an interrupt on: the peer drops its database when interrupted.
func runWatermillHTTP(ctx context.Context, opts Options) ([]Result, error) {
	if _, err := os.Stat(filepath.Join(opts.WatermillDir, "go.mod")); err != nil {
		return nil, fmt.Errorf("watermill-http: no peer module at %s (run the bench from the repository root, or set -watermill-dir): %w", opts.WatermillDir, err)
	}
	tmp, err := os.MkdirTemp("", "idem-bench-watermill-")
	if err != nil {
		return nil, fmt.Errorf("watermill-http: %w", err)
	}
	defer os.RemoveAll(tmp)
	exe := filepath.Join(tmp, "watermill-http")
	build := exec.CommandContext(ctx, "go", "build", "-o", exe, ".")
	build.Dir, build.Stdout, build.Stderr = opts.WatermillDir, os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return nil, fmt.Errorf("watermill-http: build the peer in %s: %w", opts.WatermillDir, err)
	}

	args := []string{
		"-database-url", opts.DatabaseURL,
		"-n", strconv.Itoa(opts.N),
		"-clients", strconv.Itoa(opts.HTTPClients),
		"-rate", strconv.Itoa(opts.HTTPRate),
		"-rate-n", strconv.Itoa(opts.HTTPRateN),
		"-timeout", opts.Timeout.String(),
	}
	if opts.Keep {
		args = append(args, "-keep")
	}
	cmd := exec.CommandContext(ctx, exe, args...)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, os.Stderr
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 30 * time.Second
	if err := cmd.Run(); err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return nil, fmt.Errorf("watermill-http: the peer failed (%w); its messages are above", err)
		}
		return nil, fmt.Errorf("watermill-http: %w", err)
	}
	var rs []Result
	if err := json.Unmarshal(stdout.Bytes(), &rs); err != nil {
		return nil, fmt.Errorf("watermill-http: decode the peer's results: %w", err)
	}
	return rs, nil
}
