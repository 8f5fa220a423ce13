package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

// schema is the application's own tables, as idem's reference application has
// them (refapp/schema.sql, without its multi-tenant scope column). Watermill's
// tables (the forwarder topic and its offsets) are created by watermill-sql
// itself when the forwarder subscribes.
const schema = `
CREATE TABLE payments (
    id              bigserial   PRIMARY KEY,
    idempotency_key text        NOT NULL,
    account         text        NOT NULL,
    amount_cents    bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
-- Deliberately no unique constraint on idempotency_key: a double effect must show
-- up as a second row, not be hidden by the database.
CREATE TABLE ledger_entries (
    id              bigserial   PRIMARY KEY,
    idempotency_key text        NOT NULL,
    account         text        NOT NULL,
    amount_cents    bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ledger_entries_key ON ledger_entries (idempotency_key);
`

// env is one phase's fresh environment: a new database on the server (the test
// kit's throwaway database, left empty) and a new embedded JetStream server with
// an empty store.
type env struct {
	label    string
	keep     bool
	db       *pgtest.DB
	dbName   string
	pool     *pgxpool.Pool
	nats     *server.Server
	storeDir string
}

// newEnv creates the database (with the application's tables) and starts the
// broker. close undoes both.
func newEnv(ctx context.Context, label, adminURL string, maxConns int32, keep bool) (e *env, err error) {
	e = &env{label: label, keep: keep}
	defer func() {
		if err != nil {
			e.close(context.WithoutCancel(ctx))
		}
	}()

	if e.db, err = pgtest.Create(ctx, pgtest.Options{AdminURL: adminURL, MaxConns: maxConns, NoMigrate: true}); err != nil {
		return e, err
	}
	e.dbName, e.pool = e.db.Name, e.db.Pool
	if _, err := e.pool.Exec(ctx, schema); err != nil {
		return e, fmt.Errorf("create tables: %w", err)
	}

	if e.storeDir, err = os.MkdirTemp("", "bench-wm-js-"); err != nil {
		return e, fmt.Errorf("JetStream store dir: %w", err)
	}
	// The embedded server as idem's bench runs it (embeddednats): real
	// nats-server code, JetStream on a file store, the default sync interval (not
	// SyncAlways), a random loopback port.
	ns, err := server.NewServer(&server.Options{
		ServerName: "bench-wm",
		Host:       "127.0.0.1",
		Port:       server.RANDOM_PORT,
		JetStream:  true,
		StoreDir:   e.storeDir,
		NoSigs:     true,
		NoLog:      true,
	})
	if err != nil {
		return e, fmt.Errorf("nats server: %w", err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		ns.Shutdown()
		return e, errors.New("nats server not ready after 10s")
	}
	e.nats = ns
	return e, nil
}

// natsURL is the embedded server's client URL.
func (e *env) natsURL() string { return e.nats.ClientURL() }

// close stops the broker, removes its store and drops the database (unless keep).
func (e *env) close(context.Context) {
	if e.nats != nil {
		e.nats.Shutdown()
		e.nats.WaitForShutdown()
	}
	if e.storeDir != "" {
		_ = os.RemoveAll(e.storeDir)
	}
	if e.db == nil {
		return
	}
	if e.keep {
		e.pool.Close()
		fmt.Fprintf(os.Stderr, "[%s] kept database %s\n", e.label, e.dbName)
		return
	}
	if err := e.db.Drop(); err != nil {
		fmt.Fprintf(os.Stderr, "[%s] %v\n", e.label, err)
	}
}

// meter measures one timed phase as cmd/bench does (package measure, the same
// code): wall time, this process's CPU (the Go program and the embedded
// JetStream server) and the CPU of the Postgres backends serving this phase's
// database.
type meter struct {
	env   *env
	start measure.Sample
}

func (e *env) startMeter(ctx context.Context) (*meter, error) {
	pids, err := e.backends(ctx)
	if err != nil {
		return nil, err
	}
	m := &meter{env: e}
	if m.start, err = measure.Take(pids); err != nil {
		return nil, err
	}
	return m, nil
}

func (m *meter) stop(ctx context.Context) (measure.Measurement, error) {
	end, err := measure.Take(nil)
	if err != nil {
		return measure.Measurement{}, err
	}
	pids, err := m.env.backends(ctx)
	if err != nil {
		return measure.Measurement{}, err
	}
	end.Backends = measure.BackendsCPU(pids)
	return measure.Between(m.start, end), nil
}

// backends lists the Postgres backends connected to the database.
func (e *env) backends(ctx context.Context) ([]int, error) {
	return measure.Backends(ctx, e.pool, e.dbName)
}
