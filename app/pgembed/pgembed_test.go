package pgembed

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testkit/pgtest"
)

// testLogger sends the package's progress messages to the test log.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// clusterDir returns a fresh directory the postgres system user can reach when the
// test runs as root: t.TempDir() lives under a 0700 directory, so use one of our
// own under os.TempDir() (1777) with mode 0755.
func clusterDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "pgembed-test-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(d, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return filepath.Join(d, "postgres")
}

func needBinaries(t *testing.T) {
	t.Helper()
	if _, err := findBinaries(context.Background(), "", ""); err != nil {
		t.Skipf("no PostgreSQL server binaries on this machine, so no private cluster to test: %v", err)
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// deadURL names a port where nothing listens.
func deadURL(t *testing.T) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", freePort(t))
}

func query(t *testing.T, url, sql string, args ...any) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect to %s: %v", url, err)
	}
	defer conn.Close(ctx)
	var s string
	if err := conn.QueryRow(ctx, sql, args...).Scan(&s); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return s
}

func execSQL(t *testing.T, url, sql string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect to %s: %v", url, err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// The whole life of a private cluster: nothing answers at the URL the user did not
// choose, so Fallback creates one (two callers at once: one initdb, one adopts);
// it serves queries; it stops; it starts again on the same directory with its data
// and its recorded port; stopping twice is harmless.
func TestPrivateClusterLifecycle(t *testing.T) {
	needBinaries(t)
	t.Parallel()
	ctx := context.Background()
	// Under a data dir that does not exist yet, as on a fresh machine.
	dir := filepath.Join(clusterDir(t), "idem-data", Subdir)
	// An explicit free port for the first start: DefaultPort may be in use by
	// another test process. Later starts leave Port zero and reuse the recorded one.
	cfg := Config{Dir: dir, Port: freePort(t), Logger: testLogger(t)}

	// Two processes of one worker starting at once must not both run initdb.
	type started struct {
		url  string
		stop func(context.Context) error
		err  error
	}
	var wg sync.WaitGroup
	res := make([]started, 2)
	nothing := deadURL(t)
	for i := range res {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i].url, res[i].stop, res[i].err = Fallback(ctx, nothing, cfg)
		}()
	}
	wg.Wait()
	for i, r := range res {
		if r.err != nil {
			t.Fatalf("Fallback %d: %v", i, r.err)
		}
	}
	url, stop := res[0].url, res[0].stop
	t.Cleanup(func() { _ = stop(context.Background()) })
	if res[1].url != url {
		t.Fatalf("two starts of one cluster gave %s and %s", url, res[1].url)
	}
	if recorded, err := URL(dir); err != nil || recorded != url {
		t.Fatalf("URL(dir) = %q, %v; want %q", recorded, err, url)
	}

	if got := query(t, url, "SELECT current_user"); got != Superuser {
		t.Fatalf("current_user = %q, want %q", got, Superuser)
	}
	execSQL(t, url, "CREATE TABLE survives AS SELECT 'still here' AS v")
	if got := query(t, url, "SHOW unix_socket_directories"); got != "" {
		t.Errorf("unix_socket_directories = %q, want none", got)
	}
	if got := query(t, url, "SHOW listen_addresses"); got != "127.0.0.1" {
		t.Errorf("listen_addresses = %q, want loopback only", got)
	}
	if got := query(t, url, "SHOW wal_level"); got != "logical" {
		t.Errorf("wal_level = %q, want logical: the worker's relay reads the log", got)
	}

	if err := stop(ctx); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if err := res[1].stop(ctx); err != nil {
		t.Fatalf("second stop of a stopped cluster: %v", err)
	}
	if answers(ctx, url) {
		t.Fatalf("something still answers at %s after stop", url)
	}

	// Restart on the same directory: no initdb, same port, same data.
	cfg.Port = 0
	url2, stop2, err := Ensure(ctx, cfg)
	if err != nil {
		t.Fatalf("restart: %v", err)
	}
	t.Cleanup(func() { _ = stop2(context.Background()) })
	if url2 != url {
		t.Errorf("restart URL %s, want the recorded %s", url2, url)
	}
	if got := query(t, url2, "SELECT v FROM survives"); got != "still here" {
		t.Fatalf("after restart: %q", got)
	}
	if err := stop2(ctx); err != nil {
		t.Fatalf("stop after restart: %v", err)
	}
}

// A cluster made directly in Dir (internal/pglocal's layout, with trust
// authentication) is run in place, not shadowed by a new empty one.
func TestClusterDirectlyInDirIsUsedInPlace(t *testing.T) {
	needBinaries(t)
	t.Parallel()
	ctx := context.Background()
	dir := clusterDir(t)
	cfg := Config{Dir: dir, Port: freePort(t), Logger: testLogger(t)}
	r, err := newRunner(mustDefaults(t, cfg))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.prepareDir(); err != nil {
		t.Fatal(err)
	}
	if r.bins, err = findBinaries(ctx, "", ""); err != nil {
		t.Fatal(err)
	}
	legacyInitdb(t, r, dir)
	url, stop, err := Ensure(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = stop(context.Background()) })
	if got := query(t, url, "SELECT current_setting('data_directory')"); got != dir {
		t.Errorf("data_directory = %s, want %s", got, dir)
	}
	if _, err := os.Stat(filepath.Join(dir, pgdataDir)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a second cluster was created beside the first: %v", err)
	}
	if err := stop(ctx); err != nil {
		t.Fatal(err)
	}
}

func mustDefaults(t *testing.T, cfg Config) Config {
	t.Helper()
	cfg, err := cfg.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// A recorded port that another program took meanwhile is given up for a free one.
func TestChoosePort(t *testing.T) {
	log := testLogger(t)
	recorded := filepath.Join(t.TempDir(), portFile)
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	busy := held.Addr().(*net.TCPAddr).Port
	if err := writePort(recorded, busy); err != nil {
		t.Fatal(err)
	}
	if got, err := choosePort(0, recorded, log); err != nil || got == busy {
		t.Errorf("choosePort with the recorded port taken = %d, %v", got, err)
	}
	free := freePort(t)
	if err := writePort(recorded, free); err != nil {
		t.Fatal(err)
	}
	if got, _ := choosePort(0, recorded, log); got != free {
		t.Errorf("choosePort = %d, want the recorded %d", got, free)
	}
	if got, _ := choosePort(4242, recorded, log); got != 4242 {
		t.Errorf("choosePort with Config.Port = %d, want 4242", got)
	}
}

// A user who has a Postgres gets it: Fallback touches nothing.
func TestFallbackPrefersAnAnsweringServer(t *testing.T) {
	ctx := context.Background()
	admin := pgtest.AdminURL()
	if !answers(ctx, admin) {
		t.Skipf("no Postgres answers at %s", admin)
	}
	dir := filepath.Join(t.TempDir(), "postgres")
	url, stop, err := Fallback(ctx, admin, Config{Dir: dir, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if url != admin {
		t.Errorf("Fallback = %s, want the answering %s", url, admin)
	}
	if err := stop(ctx); err != nil {
		t.Errorf("stop of a server we did not start: %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Fallback created %s although a server answered (%v)", dir, err)
	}
}

// With no binaries the error says so and names the alternatives.
func TestNoBinariesErrorNamesTheAlternatives(t *testing.T) {
	_, _, err := Ensure(context.Background(), Config{Dir: clusterDir(t), BinDir: t.TempDir(), Logger: testLogger(t)})
	if !errors.Is(err, ErrNoBinaries) {
		t.Fatalf("err = %v, want ErrNoBinaries", err)
	}
	for _, want := range []string{"docker compose up", "DATABASE_URL", "apt install postgresql"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

// Under root, Postgres runs as the postgres user: a directory it cannot reach, or
// no such user at all, is a clear error before anything runs.
func TestRootNeedsAUserThatCanReachTheDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("only root hands Postgres to another user")
	}
	ctx := context.Background()

	_, _, err := Ensure(ctx, Config{Dir: clusterDir(t), SystemUser: "no-such-user-idem", Logger: testLogger(t)})
	if err == nil || !strings.Contains(err.Error(), `"no-such-user-idem" system user, but there is none`) {
		t.Errorf("missing user: err = %v", err)
	}

	if _, err := user.Lookup("postgres"); err != nil {
		t.Skip("no postgres system user")
	}
	private := t.TempDir() // mode 0700, owned by root
	_, _, err = Ensure(ctx, Config{Dir: filepath.Join(private, "idem-data", "postgres"), Logger: testLogger(t)})
	if err == nil || !strings.Contains(err.Error(), "cannot reach") || !strings.Contains(err.Error(), "chmod o+x") {
		t.Errorf("unreachable dir: err = %v", err)
	}
}

func TestVersions(t *testing.T) {
	for v, want := range map[string]string{"15.20": "15", "16": "16", "9.6.24": "9.6", "10.1": "10"} {
		if got := majorOf(v); got != want {
			t.Errorf("majorOf(%q) = %q, want %q", v, got, want)
		}
	}
	less := [][2]string{{"9.6", "15.2"}, {"15.2", "15.10"}, {"15", "15.1"}, {"14.9", "15.0"}}
	for _, p := range less {
		if !versionLess(p[0], p[1]) || versionLess(p[1], p[0]) {
			t.Errorf("want %s < %s", p[0], p[1])
		}
	}
}

func TestChildEnvDropsPGVariables(t *testing.T) {
	got := childEnv([]string{"PATH=/bin", "PGDATA=/elsewhere", "PGPORT=1", "LC_ALL=de_DE", "HOME=/root"})
	want := []string{"PATH=/bin", "HOME=/root", "LC_ALL=C"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("childEnv = %q, want %q", got, want)
	}
}
