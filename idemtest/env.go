package idemtest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

// defaultDatabaseURL is the Postgres server an Env creates its database on when
// neither Config.DatabaseURL nor $DATABASE_URL is set.
const defaultDatabaseURL = pgtest.DefaultURL

// startTimeout bounds New's call of Start: a Postgres that does not answer fails
// the test instead of hanging it.
const startTimeout = 60 * time.Second

// Config describes the environment a check runs in. The zero value is a database
// on the server of $DATABASE_URL (or of DatabaseURL's default) with idem's tables
// in public, no tables of the user's and no broker: set NATSURL before running a
// check.
type Config struct {
	// DatabaseURL names the Postgres server the Env creates its own database on
	// (default $DATABASE_URL, else
	// postgres://postgres@127.0.0.1:5432/postgres). Its role must be allowed to
	// CREATE DATABASE. The database named in the URL is only used to connect.
	DatabaseURL string
	// Schema is the Postgres schema of the idem_* tables (default public): the
	// checks' consumers claim their keys there.
	Schema string
	// Migrate creates the user's own tables, after idem's; nil creates none.
	Migrate func(ctx context.Context, pool *pgxpool.Pool) error
	// Logger receives the log of the checks' consumers (default: discarded).
	Logger *slog.Logger
	// NATSURL is the JetStream server the Env's checks publish to and consume
	// from, the Env's own: a check creates its stream there (Case.Stream) and
	// deletes it at the end, so Envs that check at the same time need a server
	// each, or streams and subjects of their own. Empty leaves the Env without a
	// broker (NC and JS nil): Check refuses to run, the database stays usable.
	// The kit starts no server, so that a module using it does not link one; the
	// module github.com/idemkit/idem/embeddednats runs one in the test process:
	//
	//	srv, err := embeddednats.Start(embeddednats.Config{StoreDir: t.TempDir()})
	//	...
	//	t.Cleanup(srv.Stop)
	//	env := idemtest.New(t, idemtest.Config{NATSURL: srv.URL()})
	NATSURL string
}

// Env is one isolated world for checks: a fresh Postgres database with idem's
// tables (and the user's, from Config.Migrate) and a connection to the JetStream
// server of Config.NATSURL. Checks on one Env run one at a time (Check serialises
// them); for parallel checks use one Env, and one server, each.
type Env struct {
	// Pool is connected to the Env's database.
	Pool *pgxpool.Pool
	// NC is connected to Config.NATSURL; JS is JetStream on it. Both are nil on
	// an Env without a broker.
	NC *nats.Conn
	JS jetstream.JetStream
	// DatabaseURL connects to the Env's database (for a second pool, psql, a
	// subprocess).
	DatabaseURL string
	// NATSURL is Config.NATSURL.
	NATSURL string
	// Schema is the schema of the idem_* tables ("public" by default).
	Schema string

	log *slog.Logger
	db  *pgtest.DB

	checking  sync.Mutex // held by a running Check
	closeOnce sync.Once
	closeErr  error

	// skipClaim is the kit's own negative control (see export_test.go): its
	// consumers run every delivery's handler without claiming the key.
	skipClaim bool
}

// Start creates the Env: a database named idem_t_<random> on the configured server
// (the test kit's one throwaway-database helper), idem's migrations in
// Config.Schema, Config.Migrate, and a connection to Config.NATSURL. It takes no
// testing.T, so TestMain and Example functions can use it; call Close when done.
// On error nothing is left behind.
func Start(ctx context.Context, cfg Config) (*Env, error) {
	if err := pgschema.Validate(cfg.Schema); err != nil {
		return nil, fmt.Errorf("idemtest: Config.Schema: %w", err)
	}
	e := &Env{Schema: pgschema.Name(cfg.Schema), log: cfg.Logger}
	if e.log == nil {
		e.log = slog.New(slog.DiscardHandler)
	}
	if err := e.start(ctx, cfg); err != nil {
		return nil, errors.Join(err, e.Close())
	}
	return e, nil
}

func (e *Env) start(ctx context.Context, cfg Config) error {
	// The consumer's batches, its dead letters, Effects and the user's Migrate share
	// the pool; the default (4 on a small machine) would make them queue.
	db, err := pgtest.Create(ctx, pgtest.Options{AdminURL: cfg.DatabaseURL, Schema: cfg.Schema, MaxConns: 8})
	if err != nil {
		return fmt.Errorf("idemtest: %w", err)
	}
	e.db, e.Pool, e.DatabaseURL = db, db.Pool, db.URL
	if cfg.Migrate != nil {
		if err := cfg.Migrate(ctx, e.Pool); err != nil {
			return fmt.Errorf("idemtest: Config.Migrate: %w", err)
		}
	}

	if cfg.NATSURL == "" {
		return nil
	}
	e.NATSURL = cfg.NATSURL
	if e.NC, err = nats.Connect(e.NATSURL); err != nil {
		return fmt.Errorf("idemtest: connect to Config.NATSURL: %w", err)
	}
	if e.JS, err = jetstream.New(e.NC); err != nil {
		return fmt.Errorf("idemtest: JetStream: %w", err)
	}
	return nil
}

// installation is the installation of the Env's tables on stream s.
func (e *Env) installation(s install.Stream) (*install.Installation, error) {
	return install.New(e.Pool, e.NC, install.Config{Schema: e.Schema, Stream: s, Logger: e.log})
}

// New is Start for a test: it fails t at once if the Env cannot be started, and
// closes it when t ends.
func New(t testing.TB, cfg Config) *Env {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
	defer cancel()
	e, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("idemtest: close: %v", err)
		}
	})
	return e
}

// Close closes the connection to the broker and drops the database (WITH (FORCE),
// so a connection left open by the user's code does not keep it alive); the
// server of Config.NATSURL is the caller's to stop. It is safe to call more than
// once; later calls return the first result.
func (e *Env) Close() error {
	e.closeOnce.Do(func() {
		if e.NC != nil {
			e.NC.Close()
		}
		if e.db != nil {
			if err := e.db.Drop(); err != nil {
				e.closeErr = fmt.Errorf("idemtest: %w", err)
			}
		}
	})
	return e.closeErr
}
