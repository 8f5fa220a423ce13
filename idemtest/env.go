package idemtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/embeddednats"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/migrations"
)

// DefaultDatabaseURL is the Postgres server an Env creates its database on when
// neither Config.DatabaseURL nor $DATABASE_URL is set.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// startTimeout bounds New's call of Start: a Postgres that does not answer fails
// the test instead of hanging it.
const startTimeout = 60 * time.Second

// Config describes the environment a check runs in. The zero value is a database on
// $DATABASE_URL (or DefaultDatabaseURL) with idem's tables in public and no tables
// of the user's.
type Config struct {
	// DatabaseURL names the Postgres server the Env creates its own database on
	// (default $DATABASE_URL, else DefaultDatabaseURL). Its role must be allowed to
	// CREATE DATABASE. The database named in the URL is only used to connect.
	DatabaseURL string
	// Schema is the Postgres schema of the idem_* tables (default public). The
	// consumers of a Case are given it when their Config.Schema is empty.
	Schema string
	// Migrate creates the user's own tables, after idem's; nil creates none.
	Migrate func(ctx context.Context, pool *pgxpool.Pool) error
}

// Env is one isolated world for checks: a fresh Postgres database with idem's
// tables (and the user's, from Config.Migrate) and an embedded JetStream server of
// its own. Checks on one Env run one at a time (Check serialises them); for
// parallel checks use one Env each.
type Env struct {
	// Pool is connected to the Env's database.
	Pool *pgxpool.Pool
	// NC is connected to the embedded JetStream server; JS is JetStream on it.
	NC *nats.Conn
	JS jetstream.JetStream
	// DatabaseURL connects to the Env's database (for a second pool, psql, a
	// subprocess).
	DatabaseURL string
	// NATSURL is the embedded server's client URL.
	NATSURL string
	// Schema is the schema of the idem_* tables ("public" by default).
	Schema string

	adminURL string
	dbName   string
	storeDir string
	nats     *embeddednats.Server

	checking  sync.Mutex // held by a running Check
	closeOnce sync.Once
	closeErr  error

	// skipClaim is the kit's own negative control (see export_test.go): its
	// consumers run every delivery's handler without claiming the key.
	skipClaim bool
}

// Start creates the Env: a database named idemtest_<random> on the configured
// server, idem's migrations in Config.Schema, Config.Migrate, and a JetStream
// server on a random loopback port with its store in a temporary directory. It
// takes no testing.T, so TestMain and Example functions can use it; call Close when
// done. On error nothing is left behind.
func Start(ctx context.Context, cfg Config) (*Env, error) {
	if err := pgschema.Validate(cfg.Schema); err != nil {
		return nil, fmt.Errorf("idemtest: Config.Schema: %w", err)
	}
	admin := cfg.DatabaseURL
	if admin == "" {
		admin = os.Getenv("DATABASE_URL")
	}
	if admin == "" {
		admin = DefaultDatabaseURL
	}
	u, err := url.Parse(admin)
	if err != nil {
		return nil, fmt.Errorf("idemtest: database URL: %w", err)
	}
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("idemtest: random database name: %w", err)
	}
	e := &Env{Schema: pgschema.Name(cfg.Schema), adminURL: admin, dbName: "idemtest_" + hex.EncodeToString(b[:])}
	if err := e.start(ctx, cfg, u); err != nil {
		return nil, errors.Join(err, e.Close())
	}
	return e, nil
}

func (e *Env) start(ctx context.Context, cfg Config, u *url.URL) error {
	if err := adminExec(ctx, e.adminURL, "CREATE DATABASE "+e.dbName); err != nil {
		e.dbName = "" // nothing to drop
		return fmt.Errorf("idemtest: create database on %s (is Postgres running?): %w", u.Redacted(), err)
	}
	u.Path = "/" + e.dbName
	e.DatabaseURL = u.String()
	pcfg, err := pgxpool.ParseConfig(e.DatabaseURL)
	if err != nil {
		return fmt.Errorf("idemtest: %w", err)
	}
	// The consumer's batches, its dead letters, Effects and the user's Migrate share
	// the pool; the default (4 on a small machine) would make them queue.
	pcfg.MaxConns = 8
	if e.Pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return fmt.Errorf("idemtest: open pool: %w", err)
	}
	if _, err := migrations.Apply(ctx, e.Pool, migrations.Config{Schema: cfg.Schema}); err != nil {
		return fmt.Errorf("idemtest: migrate idem's tables: %w", err)
	}
	if cfg.Migrate != nil {
		if err := cfg.Migrate(ctx, e.Pool); err != nil {
			return fmt.Errorf("idemtest: Config.Migrate: %w", err)
		}
	}

	if e.storeDir, err = os.MkdirTemp("", "idemtest-jetstream-"); err != nil {
		return fmt.Errorf("idemtest: JetStream store: %w", err)
	}
	if e.nats, err = embeddednats.Start(embeddednats.Config{StoreDir: e.storeDir}); err != nil {
		return fmt.Errorf("idemtest: %w", err)
	}
	e.NATSURL = e.nats.URL()
	if e.NC, err = nats.Connect(e.NATSURL); err != nil {
		return fmt.Errorf("idemtest: connect to JetStream: %w", err)
	}
	if e.JS, err = jetstream.New(e.NC); err != nil {
		return fmt.Errorf("idemtest: JetStream: %w", err)
	}
	return nil
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

// Close stops the JetStream server, removes its store and drops the database
// (WITH (FORCE), so a connection left open by the user's code does not keep it
// alive). It is safe to call more than once; later calls return the first result.
func (e *Env) Close() error {
	e.closeOnce.Do(func() {
		if e.NC != nil {
			e.NC.Close()
		}
		if e.nats != nil {
			e.nats.Stop()
		}
		var errs []error
		if e.storeDir != "" {
			if err := os.RemoveAll(e.storeDir); err != nil {
				errs = append(errs, fmt.Errorf("remove JetStream store: %w", err))
			}
		}
		if e.Pool != nil {
			e.Pool.Close()
		}
		if e.dbName != "" {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := adminExec(ctx, e.adminURL, "DROP DATABASE IF EXISTS "+e.dbName+" WITH (FORCE)"); err != nil {
				errs = append(errs, fmt.Errorf("drop database %s: %w", e.dbName, err))
			}
		}
		if err := errors.Join(errs...); err != nil {
			e.closeErr = fmt.Errorf("idemtest: %w", err)
		}
	})
	return e.closeErr
}

// adminExec runs one statement on its own connection to the server: CREATE and DROP
// DATABASE cannot run inside the pool's database, nor in a transaction.
func adminExec(ctx context.Context, url, sql string) error {
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer c.Close(context.WithoutCancel(ctx))
	_, err = c.Exec(ctx, sql)
	return err
}
