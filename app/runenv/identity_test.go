package runenv_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/app/runenv"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

func needServerBinaries(t *testing.T) {
	t.Helper()
	if _, err := os.Stat("/usr/lib/postgresql"); err != nil {
		t.Skip("no PostgreSQL server binaries on this machine") // .ci/run installs them
	}
}

// reachableDir is a fresh data dir the postgres system user can reach when the
// test runs as root (t.TempDir() is under a 0700 directory).
func reachableDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "idem-runenv-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755) //nolint:errcheck // the postgres user must reach it
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "data")
}

func systemIdentifier(t *testing.T, e *runenv.Env) string {
	t.Helper()
	var id string
	if err := e.Pool.QueryRow(context.Background(), `SELECT system_identifier::text FROM pg_control_system()`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

func port(t *testing.T, url string) uint16 {
	t.Helper()
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Port
}

// A data dir belongs to one Postgres cluster. A zero-setup worker that started
// its private cluster sticks to it even when a Postgres answers at the default URL
// later (after a reboot the system one may come up first or last), and a worker
// pointed at another cluster is refused, naming both.
func TestDataDirStaysWithItsPrivateCluster(t *testing.T) {
	needServerBinaries(t)
	t.Parallel()
	ctx := context.Background()
	dir := reachableDir(t)
	system := pgtest.AdminURL()

	e, err := runenv.Open(ctx, runenv.Config{DatabaseURL: deadURL, PrivatePostgres: true, DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	private, privateID := e.DatabaseURL, systemIdentifier(t, e)
	closeEnv(t, e)

	// The system Postgres answers now; the worker stays on its private cluster.
	e, err = runenv.Open(ctx, runenv.Config{DatabaseURL: system, PrivatePostgres: true, DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if got := systemIdentifier(t, e); got != privateID || port(t, e.DatabaseURL) != port(t, private) {
		t.Errorf("second start on %s (cluster %s); want the private %s (cluster %s)", runenv.Redact(e.DatabaseURL), got, runenv.Redact(private), privateID)
	}
	closeEnv(t, e)

	// The user names the system Postgres: another cluster than this data dir's.
	_, err = runenv.Open(ctx, runenv.Config{DatabaseURL: system, DataDir: dir})
	if err == nil {
		t.Fatal("opened a data dir recorded for another cluster")
	}
	sys, err2 := pgconn.Connect(ctx, system)
	if err2 != nil {
		t.Fatal(err2)
	}
	defer sys.Close(ctx)
	res := sys.ExecParams(ctx, `SELECT system_identifier::text FROM pg_control_system()`, nil, nil, nil, nil).Read()
	if res.Err != nil {
		t.Fatal(res.Err)
	}
	systemID := string(res.Rows[0][0])
	msg := err.Error()
	t.Logf("refusal: %s", msg)
	for _, want := range []string{privateID, systemID, runenv.Redact(private), runenv.Redact(system), "--data-dir", dir} {
		if !strings.Contains(msg, want) {
			t.Errorf("refusal lacks %q:\n%s", want, msg)
		}
	}
	if pw, _ := pgconn.ParseConfig(private); pw.Password != "" && strings.Contains(msg, pw.Password) {
		t.Errorf("refusal shows the private cluster's password:\n%s", msg)
	}
}

// A worker that used the database at its URL does not switch to a private cluster
// when that database does not answer for a while (the system Postgres still
// booting): it fails, naming the database it waits for.
func TestDataDirStaysWithItsDatabaseURL(t *testing.T) {
	needServerBinaries(t)
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	dir := reachableDir(t)
	e, err := runenv.Open(ctx, runenv.Config{DatabaseURL: db.URL, PrivatePostgres: true, DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	closeEnv(t, e)

	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	e, err = runenv.Open(short, runenv.Config{DatabaseURL: deadURL, PrivatePostgres: true, DataDir: dir})
	if err == nil {
		closeEnv(t, e)
		t.Fatalf("opened %s: switched databases", runenv.Redact(e.DatabaseURL))
	}
	if _, serr := os.Stat(filepath.Join(dir, "postgres")); serr == nil {
		t.Errorf("a private cluster was started although this data dir used %s", db.URL)
	}
	t.Logf("refusal: %v", err)
	if !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Errorf("err = %v; want it to name the database it waits for", err)
	}
}
