// Package pgembed starts a private PostgreSQL cluster from the machine's own
// PostgreSQL binaries, so that `go run ./cmd/worker` works on a fresh machine with
// nothing configured.
//
// It is not an embedded database: it runs the real initdb, pg_ctl and postgres
// programs of an installed PostgreSQL (Debian's /usr/lib/postgresql/*/bin, PGDG's
// /usr/pgsql-*/bin, Homebrew, or whatever is on PATH). The cluster lives in one
// directory and survives restarts:
//
//	<Dir>/pgdata/        the cluster (initdb's data directory; a cluster made
//	                     directly in Dir by an earlier version is used in place)
//	<Dir>/password       the superuser's generated password (mode 0600)
//	<Dir>/port           the TCP port it listens on, chosen once and reused
//	<Dir>/postgres.log   the server's log
//	<Dir>/lock           serialises two processes starting the same cluster
//
// The server listens on 127.0.0.1 only, with no Unix sockets (so it needs no
// /var/run/postgresql), and every login needs the superuser's password
// (scram-sha-256): the URL Ensure and URL return carries it, and so does the
// password file, which only this process's user can read. A cluster an earlier
// version created with trust authentication is closed the same way at its next
// start. It is still a development convenience, not a production deployment;
// production sets DATABASE_URL.
//
// PostgreSQL refuses to run as root. When this process is root, pgembed runs
// initdb and pg_ctl as the "postgres" system user instead, which must be able to
// reach Dir. Dir then belongs to that user, and pgembed opens the files it keeps
// there without following symlinks (see files.go).
package pgembed

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Subdir is where a program keeps its private cluster under its own data
// directory: the worker uses <--data-dir>/postgres, and its operator commands look
// there for the cluster a running worker started.
const Subdir = "postgres"

// DefaultPort is the port a new cluster tries first. It is not Postgres's 5432, so
// that the private cluster never shadows (or is shadowed by) a system one.
const DefaultPort = 54329

// Superuser and Database are the role and the database in the URL Ensure returns.
// The URL carries the superuser's password too.
const (
	Superuser = "postgres"
	Database  = "postgres"
)

// ErrNoBinaries is returned (wrapped) when no PostgreSQL server binaries exist on
// the machine.
var ErrNoBinaries = errors.New("pgembed: no PostgreSQL server binaries (initdb, pg_ctl) found")

// Config configures Ensure. Only Dir is required.
type Config struct {
	// Dir is the directory the private cluster lives in (see the package doc).
	// Relative paths are made absolute. Required.
	Dir string
	// Port is the TCP port on 127.0.0.1. Zero means: the port recorded by an earlier
	// start when it is still free, else DefaultPort when free, else any free port.
	Port int
	// BinDir is the directory holding initdb and pg_ctl. Empty means: search the
	// usual install locations, newest version first, then PATH.
	BinDir string
	// SystemUser runs Postgres when this process is root (default "postgres").
	SystemUser string
	// StartTimeout bounds pg_ctl's wait for the server to accept connections
	// (default 60s; crash recovery after an unclean stop can take a while).
	StartTimeout time.Duration
	// Logger receives progress messages (default slog.Default()).
	Logger *slog.Logger
}

func (c Config) withDefaults() (Config, error) {
	if c.Dir == "" {
		return c, errors.New("pgembed: Config.Dir is required")
	}
	abs, err := filepath.Abs(c.Dir)
	if err != nil {
		return c, fmt.Errorf("pgembed: %w", err)
	}
	// Absolute, because the commands run with Dir as their working directory and,
	// under root, as another user who must walk the whole path.
	c.Dir = abs
	if c.SystemUser == "" {
		c.SystemUser = "postgres"
	}
	if c.StartTimeout == 0 {
		c.StartTimeout = 60 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c, nil
}

// The files and directories under Config.Dir.
const (
	pgdataDir    = "pgdata"
	passwordFile = "password"
	portFile     = "port"
	logFile      = "postgres.log"
	lockFile     = "lock"
)

// urlFor is the connection URL of a private cluster listening on port. password is
// empty only for a cluster an earlier version created with trust authentication,
// still run by that version.
func urlFor(port int, password string) string {
	user := Superuser
	if password != "" {
		user += ":" + password
	}
	return fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", user, port, Database)
}

// URL returns the connection URL of the private cluster in dir, password included,
// from the port its last start recorded. It does not start anything or check that
// the server runs; operator commands use it to find the cluster a running worker
// started.
func URL(dir string) (string, error) {
	port, err := readPort(filepath.Join(dir, portFile))
	if err != nil {
		return "", fmt.Errorf("pgembed: no private Postgres under %s: %w", dir, err)
	}
	pw, err := readPassword(filepath.Join(dir, passwordFile))
	if err != nil {
		return "", err
	}
	return urlFor(port, pw), nil
}

// Fallback is what a program calls when the user did not choose a database: it
// returns url itself when a Postgres server answers there, and otherwise starts
// (or reuses) the private cluster in cfg.Dir with Ensure and returns its URL.
//
// A server that answers but refuses the login still counts as answering: the user
// has a Postgres with a configuration problem, and quietly using another database
// would hide it. stop is a no-op when url was used as it is.
func Fallback(ctx context.Context, url string, cfg Config) (string, func(context.Context) error, error) {
	if answers(ctx, url) {
		return url, func(context.Context) error { return nil }, nil
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	log.Info("no Postgres answers; starting a private one (set DATABASE_URL to use your own)", "tried", redact(url))
	return Ensure(ctx, cfg)
}

// answers reports whether a Postgres server is at url: a connection that succeeds,
// or one the server itself refuses (a *pgconn.PgError: wrong password, no such
// database), as opposed to nothing listening.
func answers(ctx context.Context, url string) bool {
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		return true // not ours to fix: let the caller report the bad URL
	}
	cfg.ConnectTimeout = 3 * time.Second
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err == nil {
		_ = conn.Close(ctx)
		return true
	}
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr)
}

// Ensure makes the private cluster in cfg.Dir run and returns its URL and a stop
// function. It creates the cluster with initdb the first time, starts it with
// pg_ctl, and when it is already running (a previous process was killed before it
// could stop it) simply adopts it.
//
// stop runs `pg_ctl stop -m fast`: open transactions are rolled back, and the next
// Ensure starts the server again on the same data. Calling stop twice is harmless.
// A process that dies without calling stop leaves the server running; the next
// Ensure adopts it.
func Ensure(ctx context.Context, cfg Config) (url string, stop func(context.Context) error, err error) {
	cfg, err = cfg.withDefaults()
	if err != nil {
		return "", nil, err
	}
	log := cfg.Logger
	log.Info("starting private Postgres", "dir", cfg.Dir)

	r, err := newRunner(cfg)
	if err != nil {
		return "", nil, err
	}
	if err := r.prepareDir(); err != nil {
		return "", nil, err
	}
	unlock, err := lockDir(filepath.Join(cfg.Dir, lockFile))
	if err != nil {
		return "", nil, err
	}
	defer unlock()
	// Refuse a planted symlink now, before initdb and a start that would only be
	// undone when the port is recorded.
	for _, name := range []string{passwordFile, portFile} {
		if fi, err := os.Lstat(filepath.Join(cfg.Dir, name)); err == nil && fi.Mode()&os.ModeSymlink != 0 {
			return "", nil, fmt.Errorf("pgembed: %s %w", filepath.Join(cfg.Dir, name), errSymlink)
		}
	}

	pgdata := filepath.Join(cfg.Dir, pgdataDir)
	if _, err := readPlain(filepath.Join(cfg.Dir, "PG_VERSION"), 16); err == nil {
		// A cluster made directly in Dir (the layout of the earlier internal/pglocal):
		// run it where it is rather than create a second one beside it.
		pgdata = cfg.Dir
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", nil, fmt.Errorf("pgembed: %w", err)
	} else if err := r.checkPgdata(pgdata); err != nil {
		return "", nil, err
	}
	// A cluster can only be run by binaries of the major version that created it.
	existingMajor, err := clusterMajor(pgdata)
	if err != nil {
		return "", nil, err
	}
	bins, err := findBinaries(ctx, cfg.BinDir, existingMajor)
	if err != nil {
		return "", nil, err
	}
	r.bins = bins

	// Before initdb, which reads it; for an existing cluster without one (an
	// earlier version's), closeTrust sets it.
	password, err := r.ensurePassword()
	if err != nil {
		return "", nil, err
	}
	if existingMajor == "" {
		if err := r.initdb(ctx, pgdata); err != nil {
			return "", nil, err
		}
	}

	stop = r.stopFunc(pgdata)
	port, running, err := r.running(ctx, pgdata)
	if err != nil {
		return "", nil, err
	}
	if running {
		log.Info("private Postgres was already running; reusing it", "port", port, "pgdata", pgdata)
	} else if port, err = r.startOnAPort(ctx, pgdata); err != nil {
		return "", nil, err
	}
	// From here on the server runs: on error, stop it only if we started it.
	fail := func(err error) (string, func(context.Context) error, error) {
		if !running {
			_ = stop(context.WithoutCancel(ctx))
		}
		return "", nil, err
	}
	if err := writePort(filepath.Join(cfg.Dir, portFile), port); err != nil {
		return fail(err)
	}
	url = urlFor(port, password)
	if err := r.closeTrust(ctx, url); err != nil {
		return fail(err)
	}
	if !running {
		log.Info("private Postgres ready", "url", redact(url), "version", bins.version, "log", filepath.Join(cfg.Dir, logFile))
	}
	return url, stop, nil
}

// startOnAPort starts the server on the port choosePort picks. Should another
// program take that port between the choice and the server's bind (two clusters
// starting at once), it tries once more on a free port, unless Config.Port fixed it.
func (r *runner) startOnAPort(ctx context.Context, pgdata string) (int, error) {
	port, err := choosePort(r.cfg.Port, filepath.Join(r.cfg.Dir, portFile), r.cfg.Logger)
	if err != nil {
		return 0, err
	}
	err = r.start(ctx, pgdata, port)
	if err == nil || r.cfg.Port != 0 || portFree(port) {
		return port, err
	}
	r.cfg.Logger.Warn("another program took the port while the private Postgres started; trying another", "port", port)
	if port, err = anyFreePort(); err != nil {
		return 0, err
	}
	return port, r.start(ctx, pgdata, port)
}

// stopFunc returns the idempotent stop function for the cluster in pgdata.
func (r *runner) stopFunc(pgdata string) func(context.Context) error {
	var once sync.Once
	var err error
	return func(ctx context.Context) error {
		once.Do(func() {
			r.cfg.Logger.Info("stopping private Postgres", "pgdata", pgdata)
			err = r.stop(ctx, pgdata)
		})
		return err
	}
}

// clusterMajor returns the major version recorded in pgdata/PG_VERSION ("15",
// "9.6"), or "" when there is no cluster yet.
func clusterMajor(pgdata string) (string, error) {
	b, err := readPlain(filepath.Join(pgdata, "PG_VERSION"), 16)
	if errors.Is(err, os.ErrNotExist) {
		if entries, _ := os.ReadDir(pgdata); len(entries) > 0 {
			// Half a cluster: initdb was interrupted. initdb refuses a non-empty
			// directory, so say what to do rather than fail obscurely.
			return "", fmt.Errorf("pgembed: %s is not empty but holds no cluster (PG_VERSION missing; an interrupted initdb?): remove it to start afresh", pgdata)
		}
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("pgembed: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// choosePort picks the port for a start (see Config.Port).
func choosePort(want int, recordedFile string, log *slog.Logger) (int, error) {
	if want != 0 {
		return want, nil
	}
	if recorded, err := readPort(recordedFile); err == nil {
		if portFree(recorded) {
			return recorded, nil
		}
		log.Warn("the private Postgres's recorded port is taken by another program; choosing another", "port", recorded)
	}
	if portFree(DefaultPort) {
		return DefaultPort, nil
	}
	return anyFreePort()
}

func anyFreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgembed: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func portFree(port int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

func readPort(path string) (int, error) {
	b, err := readPlain(path, 16)
	if err != nil {
		return 0, err
	}
	port, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || port <= 0 || port > 65535 {
		// Not the content: it is not ours, and under root it need not be the user's.
		return 0, fmt.Errorf("%s: does not hold a port number", path)
	}
	return port, nil
}

// writePort records the port. The file belongs to this process's user (root under
// root): the port is no secret, but it must not be changed behind the worker's back.
func writePort(path string, port int) error {
	if err := writePlain(path, []byte(strconv.Itoa(port)+"\n"), 0o644, nil); err != nil {
		return fmt.Errorf("pgembed: record port: %w", err)
	}
	return nil
}

// redact hides a password in a URL for log messages.
func redact(url string) string {
	cfg, err := pgconn.ParseConfig(url)
	if err != nil || cfg.Password == "" {
		return url
	}
	return strings.Replace(url, ":"+cfg.Password+"@", ":***@", 1)
}
