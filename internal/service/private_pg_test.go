package service_test

import (
	"context"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/service"
)

// The zero-setup start: nothing answers at the database URL, so the worker starts a
// private Postgres under its data dir and serves requests on it.
func TestPrivatePostgresWhenNoneAnswers(t *testing.T) {
	if _, err := os.Stat("/usr/lib/postgresql"); err != nil {
		t.Skip("no PostgreSQL server binaries on this machine")
	}
	t.Parallel()
	dir, err := os.MkdirTemp("", "idem-private-pg-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755) //nolint:errcheck // the postgres user must reach it
	t.Cleanup(func() { os.RemoveAll(dir) })

	svc, err := service.Start(context.Background(), service.Config{
		DatabaseURL:     "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2",
		PrivatePostgres: true,
		DataDir:         dir,
		HTTPAddr:        "127.0.0.1:0",
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		svc.Shutdown(ctx) //nolint:errcheck
	})
	r := post(t, "http://"+svc.HTTPAddr()+"/v1/payments", "k-private", `{"account":"a","amount_cents":1}`, nil)
	if r.StatusCode != http.StatusAccepted {
		t.Fatalf("status %d", r.StatusCode)
	}
	var n int
	if err := svc.Pool.QueryRow(context.Background(), `SELECT count(*) FROM payments`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("payments on the private cluster = %d, %v", n, err)
	}
}

// Without the fallback, a missing Postgres is a clear error naming the way out.
func TestNoPostgresIsAClearError(t *testing.T) {
	t.Parallel()
	_, err := service.Start(context.Background(), service.Config{
		DatabaseURL: "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2",
		DataDir:     t.TempDir(),
		HTTPAddr:    "127.0.0.1:0",
	})
	if err == nil {
		t.Fatal("started without a database")
	}
	for _, want := range []string{"no Postgres answers", "docker-compose.yml"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
}
