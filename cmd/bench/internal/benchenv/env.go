// Package benchenv is a scenario phase's environment: a fresh database with
// idem's tables and the reference application's, a fresh embedded JetStream
// server with the reference application's stream, and the meter that times a
// phase in it.
package benchenv

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/embeddednats"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/outbox"
)

// Config configures one environment.
type Config struct {
	// AdminURL is the server on which the database is created.
	AdminURL string
	// MaxConns sizes the pool.
	MaxConns int32
	// SyncAlways is passed to the embedded JetStream server.
	SyncAlways bool
	// Keep leaves the database in place on Close.
	Keep bool
	// Label names the environment in messages and in the CPU profile's path.
	Label string
	// CPUProfile, when set, profiles every timed phase (see Meter).
	CPUProfile string
	// PlanCacheMode, when set, is Postgres's plan_cache_mode for every connection
	// (an experiment knob: force_custom_plan shows what generic plans cost).
	PlanCacheMode string
	// TraceSQL prints, after every timed phase, the client-side time per statement.
	TraceSQL bool
	Log      *slog.Logger
}

// Env is a fresh database (idem's tables and the reference application's) and a
// fresh embedded JetStream server with the reference application's stream.
type Env struct {
	cfg    Config
	db     *pgtest.DB
	DBName string
	Pool   *pgxpool.Pool
	NATS   *embeddednats.Server
	NC     *nats.Conn
	JS     jetstream.JetStream
	Stream jetstream.Stream
	// Inst is the reference application's installation on Pool and NC (the
	// public schema, its stream), with no observer: a scenario that counts a
	// component's events builds it on Inst.Observing.
	Inst *install.Installation
	// Outbox enqueues into the stream's subjects, as the reference application's
	// ingress does. It wakes the relays of Inst and of its Observing copies.
	Outbox   *outbox.Outbox
	storeDir string
	tracer   *sqlTracer
}

// New creates the database (migrated: idem's tables, then the reference
// application's) and starts the broker. Close undoes both.
func New(ctx context.Context, cfg Config) (env *Env, err error) {
	env = &Env{cfg: cfg}
	defer func() {
		if err != nil {
			env.Close(context.WithoutCancel(ctx))
		}
	}()

	// The test kit's throwaway database, migrated with idem's tables over a small
	// pool of its own; the benchmark's pool replaces it.
	env.db, err = pgtest.Create(ctx, pgtest.Options{AdminURL: cfg.AdminURL, MaxConns: 2})
	if err != nil {
		return env, fmt.Errorf("env: %w", err)
	}
	env.DBName = env.db.Name
	pcfg, err := pgxpool.ParseConfig(env.db.URL)
	if err != nil {
		return env, fmt.Errorf("env: pool config: %w", err)
	}
	// Every scenario runs on a warm pool, as a service does once it has run a
	// while: its connections are opened here, before any clock starts, and kept
	// (MinConns). On a cold pool the first requests of a rate phase pay for
	// opening connections during the burst. A service gets the same with
	// pool_min_conns in its database URL.
	pcfg.MaxConns = cfg.MaxConns
	pcfg.MinConns = cfg.MaxConns
	if cfg.PlanCacheMode != "" {
		pcfg.ConnConfig.RuntimeParams["plan_cache_mode"] = cfg.PlanCacheMode
	}
	if cfg.TraceSQL {
		env.tracer = newSQLTracer()
		pcfg.ConnConfig.Tracer = env.tracer
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return env, fmt.Errorf("env: open pool: %w", err)
	}
	env.db.Pool.Close()
	env.db.Pool, env.Pool = pool, pool // Drop closes it
	if err := warmPool(ctx, env.Pool); err != nil {
		return env, fmt.Errorf("env: %w", err)
	}
	if err := refapp.Migrate(ctx, env.Pool); err != nil {
		return env, fmt.Errorf("env: %w", err)
	}

	env.storeDir, err = os.MkdirTemp("", "idem-bench-js-")
	if err != nil {
		return env, fmt.Errorf("env: JetStream store dir: %w", err)
	}
	env.NATS, err = embeddednats.Start(embeddednats.Config{StoreDir: env.storeDir, SyncAlways: cfg.SyncAlways})
	if err != nil {
		return env, fmt.Errorf("env: %w", err)
	}
	env.NC, err = nats.Connect(env.NATS.URL(), nats.Name("idem-bench"))
	if err != nil {
		return env, fmt.Errorf("env: connect to embedded NATS: %w", err)
	}
	env.JS, err = jetstream.New(env.NC, jetstream.WithPublishAsyncMaxPending(4096))
	if err != nil {
		return env, fmt.Errorf("env: jetstream: %w", err)
	}
	env.Inst, err = install.New(env.Pool, env.NC, install.Config{
		Stream: install.Stream{
			Name:     refapp.StreamName,
			Subjects: []string{refapp.StreamSubjects},
			// For the rows that publish atomic batches; the others publish as before.
			AllowAtomicPublish: true,
		},
		Logger: cfg.Log,
	})
	if err != nil {
		return env, fmt.Errorf("env: %w", err)
	}
	env.Outbox = outbox.New(env.Inst)
	env.Stream, err = env.Inst.EnsureStream(ctx)
	if err != nil {
		return env, fmt.Errorf("env: %w", err)
	}
	return env, nil
}

// Label names the environment in messages.
func (e *Env) Label() string { return e.cfg.Label }

// Close stops the broker, removes its store and drops the database (unless Keep).
func (e *Env) Close(context.Context) {
	if e.NC != nil {
		e.NC.Close()
	}
	if e.NATS != nil {
		e.NATS.Stop()
	}
	if e.storeDir != "" {
		_ = os.RemoveAll(e.storeDir)
	}
	if e.db == nil {
		return
	}
	if e.cfg.Keep {
		e.db.Pool.Close()
		fmt.Fprintf(os.Stderr, "[%s] kept database %s\n", e.cfg.Label, e.DBName)
		return
	}
	if err := e.db.Drop(); err != nil {
		fmt.Fprintf(os.Stderr, "[%s] %v\n", e.cfg.Label, err)
	}
}

// warmPool opens every connection of pool now: it holds MaxConns of them at once,
// then gives them back.
func warmPool(ctx context.Context, pool *pgxpool.Pool) error {
	conns := make([]*pgxpool.Conn, 0, pool.Config().MaxConns)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range pool.Config().MaxConns {
		c, err := pool.Acquire(ctx)
		if err != nil {
			return fmt.Errorf("warm the pool: %w", err)
		}
		conns = append(conns, c)
	}
	return nil
}
