package pglocal

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
)

// A private cluster starts from the machine's binaries, keeps its data across a
// stop and a second start, and stops.
func TestStartStopRestart(t *testing.T) {
	if _, err := findBinaries(); err != nil {
		t.Skip(err)
	}
	t.Parallel()
	// Not t.TempDir(): its 0700 parent would keep the postgres user out.
	base, err := os.MkdirTemp("", "pglocal-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(base, 0o755) //nolint:errcheck
	t.Cleanup(func() { os.RemoveAll(base) })

	l, _ := net.Listen("tcp", "127.0.0.1:0")
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()

	ctx := context.Background()
	cfg := Config{Dir: filepath.Join(base, "postgres"), Port: port}
	c, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Stop(context.Background()) }) //nolint:errcheck
	conn, err := pgx.Connect(ctx, c.URL())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `CREATE TABLE kept (v int); INSERT INTO kept VALUES (42)`); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)

	// Starting again while it runs reuses it.
	if _, err := Start(ctx, cfg); err != nil {
		t.Fatalf("second start while running: %v", err)
	}
	if err := c.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	c2, err := Start(ctx, cfg)
	if err != nil {
		t.Fatalf("restart: %v", err)
	}
	conn, err = pgx.Connect(ctx, c2.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var v int
	if err := conn.QueryRow(ctx, `SELECT v FROM kept`).Scan(&v); err != nil || v != 42 {
		t.Fatalf("data after restart: %d, %v", v, err)
	}
}

func TestUnreachableDirIsAClearError(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("only root hands the cluster to the postgres user")
	}
	if _, err := findBinaries(); err != nil {
		t.Skip(err)
	}
	dir := t.TempDir() // 0700: the postgres user cannot enter
	_, err := Start(context.Background(), Config{Dir: filepath.Join(dir, "pg")})
	if err == nil {
		t.Fatal("started in a directory the postgres user cannot reach")
	}
	t.Log(err)
}
