package main

import (
	"bytes"
	"strings"
	"testing"
)

// The ingress has no group commit: a worker told to use it, by flag or by
// environment, refuses to start and says so, rather than running without it
// unannounced. 0 (off) starts (here it then fails on the database nobody runs).
func TestGroupCommitIsRefused(t *testing.T) {
	t.Setenv("IDEM_GROUP_COMMIT", "") // rules out t.Parallel
	dead := "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable"
	start := func(args ...string) (int, string) {
		var out, errb bytes.Buffer
		args = append(args, "--database-url", dead, "--data-dir", t.TempDir(), "--http-addr", freeAddr(t))
		return run(args, &out, &errb), errb.String()
	}
	if code, stderr := start("--group-commit", "8"); code != exitUsage || !strings.Contains(stderr, "group commit was removed") {
		t.Errorf("--group-commit 8: exit %d, stderr %q; want %d saying group commit was removed", code, stderr, exitUsage)
	}
	t.Setenv("IDEM_GROUP_COMMIT", "8")
	if code, stderr := start(); code != exitUsage || !strings.Contains(stderr, "IDEM_GROUP_COMMIT") || !strings.Contains(stderr, "group commit was removed") {
		t.Errorf("IDEM_GROUP_COMMIT=8: exit %d, stderr %q; want %d saying group commit was removed", code, stderr, exitUsage)
	}
	t.Setenv("IDEM_GROUP_COMMIT", "0")
	if _, stderr := start(); strings.Contains(stderr, "group commit") {
		t.Errorf("IDEM_GROUP_COMMIT=0 (off) was refused: %q", stderr)
	}
}
