package runenv_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/app/runenv"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

func closeEnv(t *testing.T, e *runenv.Env) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := e.Close(ctx); err != nil {
		t.Error(err)
	}
}

// The embedded server's URL, credential included, is recorded for the
// operator commands in a file only the worker's user can read, replacing a 0644
// file an earlier version left; a new data dir is private too.
func TestNATSURLFileIsPrivate(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "fresh", "idem")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, runenv.NATSURLFile)
	if err := os.WriteFile(file, []byte("nats://127.0.0.1:1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	e, err := runenv.Open(ctx, runenv.Config{DatabaseURL: db.URL, DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer closeEnv(t, e)
	fi, err := os.Lstat(file)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode() != 0o600 {
		t.Errorf("%s has mode %v, want -rw-------", file, fi.Mode())
	}
	if b, _ := os.ReadFile(file); strings.TrimSpace(string(b)) != e.NATSURL {
		t.Errorf("recorded %q, want %q", b, e.NATSURL)
	}
	if !strings.Contains(e.NATSURL, "@") {
		t.Errorf("NATS URL %q carries no credential", e.NATSURL)
	}
}

// A data dir that does not exist yet is created private; one that others may
// write to (they could replace nats.url or the lock) is refused.
func TestDataDirPermissions(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()

	fresh := filepath.Join(t.TempDir(), "a", "idem")
	e, err := runenv.Open(ctx, runenv.Config{DatabaseURL: db.URL, DataDir: fresh})
	if err != nil {
		t.Fatal(err)
	}
	closeEnv(t, e)
	fi, err := os.Stat(fresh)
	if err != nil {
		t.Fatal(err)
	}
	if perm := fi.Mode().Perm(); perm&0o077&^0o011 != 0 {
		t.Errorf("new data dir mode %04o: others may read or write it", perm)
	}

	open := t.TempDir()
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	_, err = runenv.Open(ctx, runenv.Config{DatabaseURL: db.URL, DataDir: open})
	if err == nil || !strings.Contains(err.Error(), "writable") || !strings.Contains(err.Error(), open) {
		t.Fatalf("world-writable data dir: err = %v; want a refusal naming it", err)
	}
	if _, err := os.Stat(filepath.Join(open, runenv.NATSURLFile)); err == nil {
		t.Error("nats.url was written into the refused data dir")
	}
}

// Two workers on one data dir would run two JetStream servers on one store: the
// second is refused at once, naming the directory, and changes nothing.
func TestSecondWorkerOnADataDirIsRefused(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	dir := t.TempDir()
	first, err := runenv.Open(ctx, runenv.Config{DatabaseURL: db.URL, DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer closeEnv(t, first)
	file := filepath.Join(dir, runenv.NATSURLFile)
	before, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}

	second, err := runenv.Open(ctx, runenv.Config{DatabaseURL: db.URL, DataDir: dir})
	if err == nil {
		closeEnv(t, second)
		t.Fatal("a second worker opened the same data dir")
	}
	if !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "another worker") {
		t.Errorf("err = %v; want it to name %s and the other worker", err, dir)
	}
	if after, _ := os.ReadFile(file); string(after) != string(before) {
		t.Errorf("nats.url changed from %q to %q", before, after)
	}
	if !first.NC.IsConnected() {
		t.Error("the first worker lost its NATS connection")
	}
	// After the first closes, the directory is free again.
	closeEnv(t, first)
	again, err := runenv.Open(ctx, runenv.Config{DatabaseURL: db.URL, DataDir: dir})
	if err != nil {
		t.Fatalf("after the first worker stopped: %v", err)
	}
	closeEnv(t, again)
}

// The default data dir is absolute and per user, so the operator commands find
// a running worker's files from any working directory.
func TestDefaultDataDir(t *testing.T) {
	home := t.TempDir()
	t.Setenv("HOME", home) // rules out t.Parallel
	cases := []struct{ xdg, want string }{
		{"/srv/state", "/srv/state/idem"},
		{"", filepath.Join(home, ".local", "state", "idem")},
		{"relative/state", filepath.Join(home, ".local", "state", "idem")}, // the XDG spec: ignore a relative path
	}
	for _, tc := range cases {
		t.Setenv("XDG_STATE_HOME", tc.xdg)
		want := tc.want
		if os.Geteuid() == 0 && !strings.HasPrefix(tc.xdg, "/") {
			want = "/var/lib/idem" // root's home is closed to the postgres user
		}
		if got, err := runenv.DefaultDataDir(); err != nil || got != want {
			t.Errorf("XDG_STATE_HOME=%q: DefaultDataDir() = %q, %v; want %q", tc.xdg, got, err, want)
		}
	}
}
