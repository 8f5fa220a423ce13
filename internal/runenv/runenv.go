// Package runenv opens what a worker process runs on: a Postgres pool and a NATS
// connection, with the zero-setup fallbacks of cmd/worker — an embedded JetStream
// server when no NATS URL is given, and a private Postgres cluster from the
// machine's binaries when nothing answers at a database URL the user did not
// choose. It is plumbing for the binaries, not library API: an application that
// embeds idem opens its own pool and connection.
package runenv

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/internal/embeddednats"
	"github.com/idemkit/idem/internal/pgembed"
)

// DefaultDatabaseURL is used when Config.DatabaseURL is empty.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// NATSURLFile, under DataDir, holds the embedded JetStream server's URL while it
// runs, so operator commands can find it.
const NATSURLFile = "nats.url"

// Config says what to connect to.
type Config struct {
	// DatabaseURL (default DefaultDatabaseURL).
	DatabaseURL string
	// PrivatePostgres: when no Postgres answers at DatabaseURL, start a private
	// cluster from the machine's PostgreSQL binaries under DataDir/postgres and use
	// it instead. cmd/worker sets it when DATABASE_URL was not given.
	PrivatePostgres bool
	// NATSURL: empty starts an embedded JetStream server with its store under
	// DataDir/jetstream.
	NATSURL string
	// DataDir holds the embedded server's store and the private cluster (default
	// ./idem-data).
	DataDir string
	// EmbeddedNATSPort is the embedded server's port (default: a free port).
	EmbeddedNATSPort int
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
	// NATSURL is the server the connection uses (the embedded one's when embedded).
	NATSURL string

	nats         *embeddednats.Server
	stopPostgres func(context.Context) error
	log          *slog.Logger
}

// Open connects to Postgres and NATS as cfg says, starting the zero-setup parts when
// needed. On error everything it started is stopped again.
func Open(ctx context.Context, cfg Config) (_ *Env, err error) {
	if cfg.DatabaseURL == "" {
		cfg.DatabaseURL = DefaultDatabaseURL
	}
	if cfg.DataDir == "" {
		cfg.DataDir = "idem-data"
	}
	if cfg.ApplicationName == "" {
		cfg.ApplicationName = "idem-worker"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	e := &Env{DatabaseURL: cfg.DatabaseURL, log: cfg.Logger}
	defer func() {
		if err != nil {
			e.Close(context.Background())
		}
	}()

	if cfg.PrivatePostgres {
		url, stop, err := pgembed.Fallback(ctx, cfg.DatabaseURL, pgembed.Config{
			Dir: filepath.Join(cfg.DataDir, pgembed.Subdir), Logger: cfg.Logger})
		if err != nil {
			return nil, fmt.Errorf("no Postgres answers at %s, and no private one: %w", Redact(cfg.DatabaseURL), err)
		}
		e.DatabaseURL, e.stopPostgres = url, stop
	}
	pcfg, err := pgxpool.ParseConfig(e.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("database URL: %w", err)
	}
	if _, ok := pcfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		pcfg.ConnConfig.RuntimeParams["application_name"] = cfg.ApplicationName
	}
	if e.Pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return nil, fmt.Errorf("open database pool: %w", err)
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := e.Pool.Ping(pingCtx); err != nil {
		return nil, fmt.Errorf("no Postgres answers at %s: %w (start one, or use docker-compose.yml)", Redact(e.DatabaseURL), err)
	}

	e.NATSURL = cfg.NATSURL
	if e.NATSURL == "" {
		store := filepath.Join(cfg.DataDir, "jetstream")
		ns, err := embeddednats.Start(embeddednats.Config{StoreDir: store, Port: cfg.EmbeddedNATSPort, SyncAlways: true})
		if err != nil {
			return nil, fmt.Errorf("embedded JetStream: %w", err)
		}
		e.nats = ns
		e.NATSURL = ns.URL()
		if err := os.WriteFile(filepath.Join(cfg.DataDir, NATSURLFile), []byte(e.NATSURL+"\n"), 0o644); err != nil {
			return nil, fmt.Errorf("record embedded NATS URL: %w", err)
		}
		cfg.Logger.InfoContext(ctx, "embedded JetStream started", "url", e.NATSURL, "store", store)
	}
	if e.NC, err = nats.Connect(e.NATSURL, nats.Name(cfg.ApplicationName), nats.MaxReconnects(-1), nats.ReconnectWait(250*time.Millisecond)); err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", e.NATSURL, err)
	}
	return e, nil
}

// Close closes the connections and stops what Open started, in reverse order.
func (e *Env) Close(ctx context.Context) error {
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
	return errors.Join(errs...)
}

// Redact hides a password in a database URL for messages.
func Redact(u string) string {
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil || cfg.ConnConfig.Password == "" {
		return u
	}
	return fmt.Sprintf("postgres://%s:***@%s:%d/%s", cfg.ConnConfig.User, cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Database)
}
