package pgembed

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// withoutPassword is url with its password dropped: what any other local user of
// the machine can try.
func withoutPassword(t *testing.T, url string) string {
	t.Helper()
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", cfg.User, cfg.Port, cfg.Database)
}

// mustBeRefused fails t unless the server at url answers and refuses the login.
func mustBeRefused(t *testing.T, url, what string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgconn.Connect(ctx, url)
	if err == nil {
		conn.Close(ctx)
		t.Fatalf("%s: connected to %s; want the login refused", what, url)
	}
	if !strings.Contains(err.Error(), "password") {
		t.Fatalf("%s: %v; want a refused password (the server should answer)", what, err)
	}
}

// noTrust fails t when pg_hba.conf still trusts anybody.
func noTrust(t *testing.T, url string) {
	t.Helper()
	if n := query(t, url, "SELECT count(*)::text FROM pg_hba_file_rules WHERE auth_method = 'trust' OR error IS NOT NULL"); n != "0" {
		t.Fatalf("pg_hba.conf has %s trust (or broken) rules", n)
	}
}

// legacyInitdb creates a cluster in pgdata as versions before the password did:
// every connection trusted.
func legacyInitdb(t *testing.T, r *runner, pgdata string) {
	t.Helper()
	if err := r.exec(context.Background(), "initdb", r.bins.initdb(), "--pgdata="+pgdata, "--username="+Superuser,
		"--auth=trust", "--encoding=UTF8", "--locale=C"); err != nil {
		t.Fatal(err)
	}
}

// The private cluster's superuser has a generated password, kept in a 0600 file
// beside the cluster; a login without it (any other local user) is refused.
func TestConnectionWithoutThePasswordIsRefused(t *testing.T) {
	needBinaries(t)
	t.Parallel()
	ctx := context.Background()
	dir := clusterDir(t)
	url, stop, err := Ensure(ctx, Config{Dir: dir, Port: freePort(t), Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = stop(context.Background()) })

	if got := query(t, url, "SELECT current_user"); got != Superuser {
		t.Fatalf("current_user = %q", got)
	}
	mustBeRefused(t, withoutPassword(t, url), "no password")
	mustBeRefused(t, strings.Replace(url, "postgres://postgres:", "postgres://postgres:x", 1), "a wrong password")
	noTrust(t, url)

	fi, err := os.Lstat(filepath.Join(dir, "password"))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 || !fi.Mode().IsRegular() {
		t.Errorf("password file mode %v, want a regular file 0600", fi.Mode())
	}
	// Operator commands find the cluster, password included, from the directory.
	if recorded, err := URL(dir); err != nil || recorded != url {
		t.Errorf("URL(dir) = %q, %v; want %q", recorded, err, url)
	}
}

// A cluster an earlier version created with trust authentication, still running
// (its worker was killed), is given a password and a pg_hba.conf without trust on
// the next start, keeping its data; after a stop it stays closed.
func TestTrustClusterFromAnEarlierVersionIsClosed(t *testing.T) {
	needBinaries(t)
	t.Parallel()
	ctx := context.Background()
	cfg := mustDefaults(t, Config{Dir: clusterDir(t), Port: freePort(t), Logger: testLogger(t)})
	r, err := newRunner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.prepareDir(); err != nil {
		t.Fatal(err)
	}
	if r.bins, err = findBinaries(ctx, "", ""); err != nil {
		t.Fatal(err)
	}
	pgdata := filepath.Join(cfg.Dir, pgdataDir)
	legacyInitdb(t, r, pgdata)
	if err := r.start(ctx, pgdata, cfg.Port); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.stop(context.Background(), pgdata) })
	if err := os.WriteFile(filepath.Join(cfg.Dir, portFile), fmt.Appendf(nil, "%d\n", cfg.Port), 0o644); err != nil {
		t.Fatal(err)
	}
	open := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", cfg.Port)
	execSQL(t, open, "CREATE TABLE survives AS SELECT 'still here' AS v")

	url, stop, err := Ensure(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	mustBeRefused(t, open, "the running trust cluster after Ensure")
	noTrust(t, url)
	if got := query(t, url, "SELECT v FROM survives"); got != "still here" {
		t.Fatalf("data after the upgrade: %q", got)
	}
	if err := stop(ctx); err != nil {
		t.Fatal(err)
	}

	cfg.Port = 0
	url2, stop2, err := Ensure(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = stop2(context.Background()) })
	if url2 != url {
		t.Errorf("restart URL %q, want %q", url2, url)
	}
	mustBeRefused(t, open, "after a restart")
	if got := query(t, url2, "SELECT v FROM survives"); got != "still here" {
		t.Fatalf("data after the restart: %q", got)
	}
}

// Under root, pgembed writes and reads files inside a directory the postgres
// user owns, which that user could fill with symlinks to root's files. Every such
// file is opened without following a symlink, and the directory itself must not be
// one. (The refusal holds for any user; under root it is what keeps a compromised
// postgres account from writing through root.)
func TestSymlinksInTheClusterDirAreRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// victim is a file of root's the symlinks point at; it must come out untouched.
	victim := func(t *testing.T) string {
		p := filepath.Join(t.TempDir(), "victim")
		if err := os.WriteFile(p, []byte("root's secret\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	untouched := func(t *testing.T, p string) {
		t.Helper()
		b, err := os.ReadFile(p)
		if err != nil || string(b) != "root's secret\n" {
			t.Errorf("the symlink's target was changed: %q, %v", b, err)
		}
	}
	refused := func(t *testing.T, err error, secret bool) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), "symlink") {
			t.Errorf("err = %v; want a refusal naming the symlink", err)
		}
		if secret && err != nil && strings.Contains(err.Error(), "secret") {
			t.Errorf("the error shows the symlink target's content: %v", err)
		}
	}
	plant := func(t *testing.T, dir, name, target string) {
		t.Helper()
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	ensure := func(t *testing.T, dir string) error {
		t.Helper()
		_, stop, err := Ensure(ctx, Config{Dir: dir, Port: freePort(t), Logger: testLogger(t)})
		if err == nil {
			_ = stop(context.Background())
		}
		return err
	}

	for _, name := range []string{lockFile, portFile, "password"} {
		t.Run("write "+name, func(t *testing.T) {
			needBinaries(t)
			t.Parallel()
			dir, v := clusterDir(t), victim(t)
			plant(t, dir, name, v)
			refused(t, ensure(t, dir), true)
			untouched(t, v)
		})
	}
	for _, name := range []string{portFile, "password"} {
		t.Run("read "+name, func(t *testing.T) {
			dir, v := clusterDir(t), victim(t)
			plant(t, dir, name, v)
			if name == "password" {
				if err := os.WriteFile(filepath.Join(dir, portFile), []byte("54329\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			_, err := URL(dir)
			refused(t, err, true)
		})
	}
	t.Run("the directory", func(t *testing.T) {
		needBinaries(t)
		t.Parallel()
		target := t.TempDir()
		before, err := os.Stat(target)
		if err != nil {
			t.Fatal(err)
		}
		parent := filepath.Dir(clusterDir(t))
		dir := filepath.Join(parent, "postgres")
		if err := os.Symlink(target, dir); err != nil {
			t.Fatal(err)
		}
		refused(t, ensure(t, dir), false)
		after, err := os.Stat(target)
		if err != nil {
			t.Fatal(err)
		}
		b, a := before.Sys().(*syscall.Stat_t), after.Sys().(*syscall.Stat_t)
		if a.Uid != b.Uid || a.Gid != b.Gid || after.Mode() != before.Mode() {
			t.Errorf("the symlinked directory was changed: owner %d:%d mode %v, was %d:%d %v", a.Uid, a.Gid, after.Mode(), b.Uid, b.Gid, before.Mode())
		}
		if entries, _ := os.ReadDir(target); len(entries) > 0 {
			t.Errorf("files were created through the symlink: %v", entries)
		}
	})
}
