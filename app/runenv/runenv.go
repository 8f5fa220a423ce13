// Package runenv opens what a worker process runs on: a Postgres pool and a NATS
// connection, with the zero-setup fallbacks of cmd/worker — an embedded JetStream
// server when no NATS URL is given, and a private Postgres cluster from the
// machine's binaries when nothing answers at a database URL the user did not
// choose. It is plumbing for the binaries, not library API: an application that
// embeds idem opens its own pool and connection.
//
// The data dir (Config.DataDir) holds, besides the embedded server's store and the
// private cluster:
//
//	lock            held by the running worker (a second one is refused)
//	database.json   the database the data dir belongs to (see DatabaseFile)
//	nats.url        the embedded server's URL, token included, mode 0600
package runenv

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/gofrs/flock"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/app/pgembed"
	"github.com/idemkit/idem/embeddednats"
)

// DefaultDatabaseURL is used when Config.DatabaseURL is empty.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// DefaultMaxConns is the pool size when neither Config.MaxConns nor the URL's
// pool_max_conns says otherwise: the reference worker reserves 6 connections and
// gives the ingress the rest.
const DefaultMaxConns = 16

// NATSURLFile, under DataDir, holds the embedded JetStream server's URL, token
// included, while it runs, so operator commands can find it. Mode 0600: the token
// is what keeps other local users off the server.
const NATSURLFile = "nats.url"

// Config says what to connect to.
type Config struct {
	// DatabaseURL (default DefaultDatabaseURL).
	DatabaseURL string
	// PrivatePostgres: when no Postgres answers at DatabaseURL, start a private
	// cluster from the machine's PostgreSQL binaries under DataDir/postgres and use
	// it instead. cmd/worker sets it when DATABASE_URL was not given. The choice is
	// made once per data dir and recorded (DatabaseFile): later starts use the
	// private cluster, or DatabaseURL, as the first did, without probing again.
	PrivatePostgres bool
	// NATSURL: empty starts an embedded JetStream server with its store under
	// DataDir/jetstream.
	NATSURL string
	// DataDir holds the embedded server's store, the private cluster, the lock and
	// the database record (default DefaultDataDir()). Relative paths are made
	// absolute.
	DataDir string
	// NATSAuth authenticates to the server at NATSURL and trusts its certificate.
	// It is refused with the embedded server, which has a token of its own.
	NATSAuth NATSAuth
	// EmbeddedNATSPort is the embedded server's port (default: a free port).
	EmbeddedNATSPort int
	// EmbeddedNATSSyncAlways makes the embedded server fsync every write. The
	// worker sets it only when it runs no reconciler: with one, a write the broker
	// acknowledged and then lost in a crash is found and re-driven, so JetStream's
	// default sync interval is safe, and faster.
	EmbeddedNATSSyncAlways bool
	// MaxConns is the pool's size unless the database URL sets pool_max_conns
	// (default DefaultMaxConns). pgxpool's own default (4 on a small machine) is less
	// than a worker reserves for its consumers, relay, collector and health checks.
	MaxConns int32
	// ApplicationName is the Postgres application_name of the pool's connections
	// (default "idem-worker"), so an operator can find them.
	ApplicationName string
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Env is an open environment. Close it when done.
type Env struct {
	Pool *pgxpool.Pool
	NC   *nats.Conn
	// DatabaseURL is the URL the pool connects to (the private cluster's when the
	// fallback was taken).
	DatabaseURL string
	// NATSURL is the server the connection uses (the embedded one's when embedded,
	// with its token: redact it with embeddednats.Redact before logging it).
	NATSURL string
	// DataDir is the absolute data directory.
	DataDir string

	lock         *flock.Flock
	nats         *embeddednats.Server
	stopPostgres func(context.Context) error
	log          *slog.Logger
	closeOnce    sync.Once
	closeErr     error
}

// Open connects to Postgres and NATS as cfg says, starting the zero-setup parts when
// needed. Before anything else it takes the data dir's lock, so a second worker on
// the same directory fails here having changed nothing. On error everything it
// started is stopped again.
func Open(ctx context.Context, cfg Config) (_ *Env, err error) {
	if cfg.DatabaseURL == "" {
		cfg.DatabaseURL = DefaultDatabaseURL
	}
	if cfg.DataDir == "" {
		if cfg.DataDir, err = DefaultDataDir(); err != nil {
			return nil, err
		}
	}
	if cfg.ApplicationName == "" {
		cfg.ApplicationName = "idem-worker"
	}
	if cfg.MaxConns == 0 {
		cfg.MaxConns = DefaultMaxConns
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.NATSURL == "" && !cfg.NATSAuth.Empty() {
		return nil, errors.New("NATS credentials and TLS files are for a server given by URL; the embedded server makes its own token")
	}
	// Before anything starts: a bad combination, or an unreadable nkey seed, fails
	// here having changed nothing.
	natsAuth, err := cfg.NATSAuth.Options()
	if err != nil {
		return nil, err
	}
	dir, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return nil, fmt.Errorf("data dir: %w", err)
	}
	if err := prepareDataDir(dir); err != nil {
		return nil, err
	}
	lock, err := lockDataDir(dir)
	if err != nil {
		return nil, err
	}
	e := &Env{DatabaseURL: cfg.DatabaseURL, DataDir: dir, lock: lock, log: cfg.Logger}
	defer func() {
		if err != nil {
			e.Close(context.WithoutCancel(ctx))
		}
	}()

	if err := e.openDatabase(ctx, cfg); err != nil {
		return nil, err
	}

	e.NATSURL = cfg.NATSURL
	if e.NATSURL == "" {
		store := filepath.Join(dir, "jetstream")
		ns, err := embeddednats.Start(embeddednats.Config{StoreDir: store, Port: cfg.EmbeddedNATSPort, SyncAlways: cfg.EmbeddedNATSSyncAlways})
		if err != nil {
			return nil, fmt.Errorf("embedded JetStream: %w", err)
		}
		e.nats = ns
		e.NATSURL = ns.URL()
		if err := writePrivateFile(filepath.Join(dir, NATSURLFile), []byte(e.NATSURL+"\n")); err != nil {
			return nil, fmt.Errorf("record embedded NATS URL: %w", err)
		}
		cfg.Logger.InfoContext(ctx, "embedded JetStream started", "url", embeddednats.Redact(e.NATSURL), "store", store)
	}
	// NATSURL may list several servers of a cluster, comma-separated: the client
	// connects to one and fails over to the others (and to those the cluster
	// announces).
	if e.NC, err = nats.Connect(e.NATSURL, ConnOptions(cfg.ApplicationName, natsAuth...)...); err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", embeddednats.Redact(e.NATSURL), err)
	}
	return e, nil
}

// openDatabase opens the pool on the database the data dir belongs to. Without a
// record (a new data dir) the first start chooses as cfg says and records the
// choice; with one it uses the recorded kind (private cluster or URL) rather than
// probing again, so a worker never switches between the two (after a reboot the
// system Postgres may still be starting when the worker probes), and it refuses a
// database that is not the recorded one.
func (e *Env) openDatabase(ctx context.Context, cfg Config) error {
	rec, err := ReadDatabaseRecord(e.DataDir)
	if err != nil {
		return err
	}
	pgCfg := pgembed.Config{Dir: filepath.Join(e.DataDir, pgembed.Subdir), Logger: cfg.Logger}
	private := false
	switch {
	case !cfg.PrivatePostgres:
	case rec == nil:
		url, stop, err := pgembed.Fallback(ctx, cfg.DatabaseURL, pgCfg)
		if err != nil {
			return fmt.Errorf("no Postgres answers at %s, and no private one: %w", Redact(cfg.DatabaseURL), err)
		}
		private = url != cfg.DatabaseURL
		e.DatabaseURL, e.stopPostgres = url, stop
	case rec.Private:
		cfg.Logger.InfoContext(ctx, "this data dir's worker runs on its private Postgres", "record", filepath.Join(e.DataDir, DatabaseFile))
		url, stop, err := pgembed.Ensure(ctx, pgCfg)
		if err != nil {
			return fmt.Errorf("the private Postgres this data dir's worker runs on (recorded in %s): %w", filepath.Join(e.DataDir, DatabaseFile), err)
		}
		private = true
		e.DatabaseURL, e.stopPostgres = url, stop
	}

	pcfg, err := pgxpool.ParseConfig(e.DatabaseURL)
	if err != nil {
		return fmt.Errorf("database URL: %w", err)
	}
	if _, ok := pcfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		pcfg.ConnConfig.RuntimeParams["application_name"] = cfg.ApplicationName
	}
	// ParseConfig consumes pool_max_conns without saying whether it was there.
	if !strings.Contains(e.DatabaseURL, "pool_max_conns") {
		pcfg.MaxConns = cfg.MaxConns
	}
	if e.Pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return fmt.Errorf("open database pool: %w", err)
	}
	if err := ping(ctx, e.Pool, rec != nil); err != nil {
		if rec != nil && !rec.Private && cfg.PrivatePostgres {
			return fmt.Errorf("no Postgres answers at %s: %w. This data dir's worker runs on the database at %s (recorded in %s), "+
				"so it does not start a private one instead: start that Postgres (after a reboot it may still be starting), "+
				"or give this worker another --data-dir", Redact(e.DatabaseURL), err, rec.URL, filepath.Join(e.DataDir, DatabaseFile))
		}
		return fmt.Errorf("no Postgres answers at %s: %w (start one, or use docker-compose.yml)", Redact(e.DatabaseURL), err)
	}

	if rec != nil {
		return rec.Check(ctx, e.Pool, e.DataDir, e.DatabaseURL)
	}
	id, name, err := Identify(ctx, e.Pool)
	if err != nil {
		return err
	}
	e.log.InfoContext(ctx, "recording the database this data dir belongs to", "file", filepath.Join(e.DataDir, DatabaseFile),
		"system_identifier", id, "database", name, "private", private)
	return writeDatabaseRecord(e.DataDir, DatabaseRecord{
		SystemIdentifier: id, Database: name, Private: private, URL: Redact(e.DatabaseURL), RecordedAt: time.Now().UTC(),
	})
}

// ping checks that the database answers. When the data dir's record says this
// database was used before, it waits for it (up to 10s, or ctx): it is expected
// back, and may still be starting. A first start fails at once instead.
func ping(ctx context.Context, pool *pgxpool.Pool, expected bool) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		err := pool.Ping(ctx)
		if err == nil || !expected {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(250 * time.Millisecond): // a server that is starting up tells nobody when it is done
		}
	}
}

// Close closes the connections, stops what Open started, in reverse order, and
// releases the data dir's lock last. Calling it again returns the first result.
func (e *Env) Close(ctx context.Context) error {
	e.closeOnce.Do(func() {
		var errs []error
		if e.NC != nil {
			_ = e.NC.Drain()
			e.NC.Close()
		}
		if e.nats != nil {
			e.nats.Stop()
		}
		if e.Pool != nil {
			e.Pool.Close()
		}
		if e.stopPostgres != nil {
			ctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			if err := e.stopPostgres(ctx); err != nil {
				errs = append(errs, fmt.Errorf("stop the private Postgres: %w", err))
			}
		}
		if e.lock != nil {
			if err := e.lock.Unlock(); err != nil {
				errs = append(errs, fmt.Errorf("unlock the data dir: %w", err))
			}
		}
		e.closeErr = errors.Join(errs...)
	})
	return e.closeErr
}

// Redact hides a password in a database URL for messages.
func Redact(u string) string {
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil || cfg.ConnConfig.Password == "" {
		return u
	}
	return fmt.Sprintf("postgres://%s:***@%s:%d/%s", cfg.ConnConfig.User, cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Database)
}

// Keepalive of the NATS connection: a ping every PingInterval, and the connection
// is given up (and another server of the cluster tried) after MaxPingsOutstanding
// unanswered ones. nats.go's defaults (2 minutes, 2) leave a worker on a server
// that stopped answering without closing its socket (SIGSTOP, a partition that
// drops packets) for up to 4 minutes: its relay waits for PubAcks that never come.
// The cluster chaos test (test/chaos, TestChaosCluster) found it.
const (
	PingInterval        = 5 * time.Second
	MaxPingsOutstanding = 2
)

// ConnOptions are the worker's NATS connection options, with the given
// authentication and TLS options (see NATSAuth): reconnect forever, quickly, and
// notice a silent server within about PingInterval × (MaxPingsOutstanding + 1).
func ConnOptions(name string, auth ...nats.Option) []nats.Option {
	return append([]nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.PingInterval(PingInterval),
		nats.MaxPingsOutstanding(MaxPingsOutstanding),
	}, auth...)
}
