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

const deadURL = "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2"

// The zero-setup start: nothing answers at the database URL, so Open starts a
// private Postgres under the data dir, and an embedded JetStream server whose URL
// it records for the operator commands.
func TestPrivatePostgresWhenNoneAnswers(t *testing.T) {
	if _, err := os.Stat("/usr/lib/postgresql"); err != nil {
		t.Skip("no PostgreSQL server binaries on this machine") // .ci/run installs them
	}
	t.Parallel()
	dir, err := os.MkdirTemp("", "idem-private-pg-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755) //nolint:errcheck // the postgres user must reach it
	t.Cleanup(func() { os.RemoveAll(dir) })

	ctx := context.Background()
	e, err := runenv.Open(ctx, runenv.Config{DatabaseURL: deadURL, PrivatePostgres: true, DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := e.Close(ctx); err != nil {
			t.Error(err)
		}
	})
	if e.DatabaseURL == deadURL || !strings.Contains(e.DatabaseURL, "127.0.0.1") {
		t.Errorf("DatabaseURL = %q, want the private cluster's", e.DatabaseURL)
	}
	var one int
	if err := e.Pool.QueryRow(ctx, `SELECT 1`).Scan(&one); err != nil || one != 1 {
		t.Fatalf("private cluster: %v", err)
	}
	recorded, err := os.ReadFile(filepath.Join(dir, runenv.NATSURLFile))
	if err != nil || strings.TrimSpace(string(recorded)) != e.NATSURL {
		t.Errorf("recorded NATS URL %q (%v), want %q", recorded, err, e.NATSURL)
	}
	if !e.NC.IsConnected() {
		t.Error("not connected to the embedded JetStream server")
	}
}

// Without the fallback, a missing Postgres is a clear error naming the way out.
func TestNoPostgresIsAClearError(t *testing.T) {
	t.Parallel()
	_, err := runenv.Open(context.Background(), runenv.Config{DatabaseURL: deadURL, DataDir: t.TempDir()})
	if err == nil {
		t.Fatal("opened without a database")
	}
	for _, want := range []string{"no Postgres answers", "docker-compose.yml"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
}

// A database that answers is used as it is, with the worker's application_name.
func TestOpenUsesAnAnsweringDatabase(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	e, err := runenv.Open(ctx, runenv.Config{DatabaseURL: db.URL, PrivatePostgres: true, DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx) //nolint:errcheck
	var name string
	if err := e.Pool.QueryRow(ctx, `SELECT current_setting('application_name')`).Scan(&name); err != nil || name != "idem-worker" {
		t.Errorf("application_name = %q (%v), want idem-worker", name, err)
	}
	if e.DatabaseURL != db.URL {
		t.Errorf("DatabaseURL = %q, want the answering one", e.DatabaseURL)
	}
	// Enough connections for the worker's reservations (pgxpool's default is 4 on a
	// two-core machine, and the worker refuses to start on it).
	if got := e.Pool.Config().MaxConns; got != runenv.DefaultMaxConns {
		t.Errorf("MaxConns = %d, want %d", got, runenv.DefaultMaxConns)
	}
}

// A pool size in the URL is the user's choice.
func TestOpenKeepsThePoolSizeOfTheURL(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	url := db.URL + "&pool_max_conns=5"
	if !strings.Contains(db.URL, "?") {
		url = db.URL + "?pool_max_conns=5"
	}
	e, err := runenv.Open(ctx, runenv.Config{DatabaseURL: url, DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx) //nolint:errcheck
	if got := e.Pool.Config().MaxConns; got != 5 {
		t.Errorf("MaxConns = %d, want the URL's 5", got)
	}
}

func TestRedact(t *testing.T) {
	t.Parallel()
	if got := runenv.Redact("postgres://u:secret@h:5432/d"); strings.Contains(got, "secret") {
		t.Errorf("Redact kept the password: %q", got)
	}
}
