// Package pglocal starts a private PostgreSQL cluster from the machine's own
// PostgreSQL binaries, so `go run ./cmd/worker` works on a machine where nothing
// answers at DATABASE_URL. The cluster lives under the worker's data directory and
// survives restarts: a second start reuses it.
//
// It is a convenience for a first run, not a production set-up: use a managed
// Postgres, or docker-compose.yml, and set DATABASE_URL.
package pglocal

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
)

// ErrNoBinaries: no initdb/pg_ctl was found on this machine.
var ErrNoBinaries = errors.New("pglocal: no PostgreSQL server binaries found (looked in /usr/lib/postgresql/*/bin and PATH); install PostgreSQL, set DATABASE_URL, or run `docker compose up` with the repository's docker-compose.yml")

// Config configures a private cluster. The zero value (plus Dir) is valid.
type Config struct {
	// Dir holds the cluster (created when absent). Required.
	Dir string
	// Port on 127.0.0.1 (default 54329).
	Port int
	// Logger receives progress (default slog.Default()).
	Logger *slog.Logger
}

// Cluster is a running private cluster.
type Cluster struct {
	cfg  Config
	bin  string
	cred *syscall.Credential
}

// URL connects to the cluster's postgres database as the postgres user.
func (c *Cluster) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.cfg.Port)
}

// Start initialises the cluster if Dir has none, and starts it unless it is already
// running.
func Start(ctx context.Context, cfg Config) (*Cluster, error) {
	if cfg.Dir == "" {
		return nil, errors.New("pglocal: Dir is required")
	}
	if cfg.Port == 0 {
		cfg.Port = 54329
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("pglocal: %w", err)
	}
	cfg.Dir = dir
	bin, err := findBinaries()
	if err != nil {
		return nil, err
	}
	c := &Cluster{cfg: cfg, bin: bin}

	// PostgreSQL refuses to run as root: run it as the postgres system user.
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("pglocal: running as root needs a 'postgres' system user to own the cluster: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		c.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := reachable(dir); err != nil {
			return nil, err
		}
	}

	if _, err := os.Stat(filepath.Join(dir, "PG_VERSION")); errors.Is(err, os.ErrNotExist) {
		cfg.Logger.Info("creating a private Postgres cluster", "dir", dir, "binaries", bin)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("pglocal: %w", err)
		}
		if c.cred != nil {
			if err := os.Chown(dir, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
				return nil, fmt.Errorf("pglocal: chown %s: %w", dir, err)
			}
		}
		if err := c.run(ctx, "initdb", "-D", dir, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"); err != nil {
			return nil, err
		}
	}
	if c.run(ctx, "pg_ctl", "-D", dir, "status") == nil {
		cfg.Logger.Info("private Postgres already running", "dir", dir)
		return c, nil
	}
	cfg.Logger.Info("starting private Postgres", "dir", dir, "port", cfg.Port)
	opts := fmt.Sprintf("-p %d -c listen_addresses=127.0.0.1 -k %s", cfg.Port, dir)
	logFile := filepath.Join(dir, "server.log")
	if err := c.run(ctx, "pg_ctl", "-D", dir, "-l", logFile, "-o", opts, "-w", "-t", "60", "start"); err != nil {
		tail, _ := os.ReadFile(logFile)
		return nil, fmt.Errorf("%w\nserver log:\n%s", err, lastLines(string(tail), 10))
	}
	return c, nil
}

// Stop shuts the cluster down (fast mode: open transactions roll back).
func (c *Cluster) Stop(ctx context.Context) error {
	return c.run(ctx, "pg_ctl", "-D", c.cfg.Dir, "-m", "fast", "-w", "stop")
}

func (c *Cluster) run(ctx context.Context, tool string, args ...string) error {
	cmd := exec.CommandContext(ctx, filepath.Join(c.bin, tool), args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.Dir = c.cfg.Dir
	if _, err := os.Stat(c.cfg.Dir); err != nil {
		cmd.Dir = "/"
	}
	if c.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("pglocal: %s: %w: %s", tool, err, strings.TrimSpace(out.String()))
	}
	return nil
}

// findBinaries returns the newest /usr/lib/postgresql/N/bin with initdb, or the
// directory of initdb on PATH.
func findBinaries() (string, error) {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	for _, d := range dirs {
		if isExec(filepath.Join(d, "initdb")) && isExec(filepath.Join(d, "pg_ctl")) {
			return d, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		d := filepath.Dir(p)
		if isExec(filepath.Join(d, "pg_ctl")) {
			return d, nil
		}
	}
	return "", ErrNoBinaries
}

func version(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

func isExec(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir() && st.Mode()&0o111 != 0
}

// reachable checks that the postgres user can reach dir: every existing parent
// must be searchable by others, since the cluster runs as that user.
func reachable(dir string) error {
	for p := filepath.Dir(dir); ; p = filepath.Dir(p) {
		if st, err := os.Stat(p); err == nil && st.Mode().Perm()&0o001 == 0 {
			return fmt.Errorf("pglocal: the postgres user cannot reach %s: %s is mode %v; choose a --data-dir outside it", dir, p, st.Mode().Perm())
		}
		if p == "/" || p == "." {
			return nil
		}
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
