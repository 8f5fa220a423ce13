package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/embeddednats"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/internal/app/refapp"
)

// EnvConfig configures one scenario's environment.
type EnvConfig struct {
	// AdminURL is the server on which the database is created.
	AdminURL string
	// MaxConns sizes the pool.
	MaxConns int32
	// SyncAlways is passed to the embedded JetStream server.
	SyncAlways bool
	// Keep leaves the database in place on Close.
	Keep bool
	// Scenario names the environment in messages and in the CPU profile's path.
	Scenario string
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
	cfg    EnvConfig
	DBName string
	Pool   *pgxpool.Pool
	NATS   *embeddednats.Server
	NC     *nats.Conn
	JS     jetstream.JetStream
	Stream jetstream.Stream
	// Outbox enqueues into the stream's subjects, as the reference application's
	// ingress does.
	Outbox   *outbox.Outbox
	storeDir string
	tracer   *sqlTracer
}

// NewEnv creates the database (migrated: idem's tables, then the reference
// application's) and starts the broker. Close undoes both.
func NewEnv(ctx context.Context, cfg EnvConfig) (env *Env, err error) {
	env = &Env{cfg: cfg}
	defer func() {
		if err != nil {
			env.Close(context.WithoutCancel(ctx))
		}
	}()

	var b [5]byte
	_, _ = rand.Read(b[:])
	name := "idem_bench_" + hex.EncodeToString(b[:])
	admin, err := pgx.Connect(ctx, cfg.AdminURL)
	if err != nil {
		return env, fmt.Errorf("env: connect to %s: %w", redact(cfg.AdminURL), err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		return env, fmt.Errorf("env: create database %s: %w", name, err)
	}
	env.DBName = name

	u, err := url.Parse(cfg.AdminURL)
	if err != nil {
		return env, fmt.Errorf("env: parse database URL: %w", err)
	}
	u.Path = "/" + name
	pcfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		return env, fmt.Errorf("env: pool config: %w", err)
	}
	// Every scenario runs on a warm pool, as a service does once it has run a
	// while: its connections are opened here, before any clock starts, and kept
	// (MinConns). On a cold pool the first 100 ms of the 1,000 requests/s phase
	// pay for opening connections during the burst, which alone put e2e-http's
	// p99 at 9.6-18 ms against 7.4-8.7 ms for the rest of the phase (2026-12-01).
	// A service gets the same with pool_min_conns in its database URL.
	pcfg.MaxConns = cfg.MaxConns
	pcfg.MinConns = cfg.MaxConns
	if cfg.PlanCacheMode != "" {
		pcfg.ConnConfig.RuntimeParams["plan_cache_mode"] = cfg.PlanCacheMode
	}
	if cfg.TraceSQL {
		env.tracer = newSQLTracer()
		pcfg.ConnConfig.Tracer = env.tracer
	}
	env.Pool, err = pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return env, fmt.Errorf("env: open pool: %w", err)
	}
	if err := warmPool(ctx, env.Pool); err != nil {
		return env, fmt.Errorf("env: %w", err)
	}
	if _, err := migrations.Apply(ctx, env.Pool, migrations.Config{}); err != nil {
		return env, fmt.Errorf("env: %w", err)
	}
	if err := refapp.Migrate(ctx, env.Pool); err != nil {
		return env, fmt.Errorf("env: %w", err)
	}
	env.Outbox, err = outbox.New(outbox.Config{Subjects: []string{refapp.StreamSubjects}})
	if err != nil {
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
	env.Stream, err = outbox.EnsureStream(ctx, env.JS, outbox.StreamConfig{
		Name:     refapp.StreamName,
		Subjects: []string{refapp.StreamSubjects},
		// For the rows that publish atomic batches; the others publish as before.
		AllowAtomicPublish: true,
	})
	if err != nil {
		return env, fmt.Errorf("env: %w", err)
	}
	return env, nil
}

// Close stops the broker, removes its store and drops the database (unless Keep).
func (e *Env) Close(ctx context.Context) {
	if e.NC != nil {
		e.NC.Close()
	}
	if e.NATS != nil {
		e.NATS.Stop()
	}
	if e.storeDir != "" {
		_ = os.RemoveAll(e.storeDir)
	}
	if e.Pool != nil {
		e.Pool.Close()
	}
	if e.DBName == "" {
		return
	}
	if e.cfg.Keep {
		fmt.Fprintf(os.Stderr, "[%s] kept database %s\n", e.cfg.Scenario, e.DBName)
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, e.cfg.AdminURL)
	if err != nil {
		fmt.Fprintf(os.Stderr, "[%s] drop database %s: %v\n", e.cfg.Scenario, e.DBName, err)
		return
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+e.DBName+" WITH (FORCE)"); err != nil {
		fmt.Fprintf(os.Stderr, "[%s] drop database %s: %v\n", e.cfg.Scenario, e.DBName, err)
	}
}

func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparseable URL)"
	}
	return u.Redacted()
}

// Meter measures one timed phase: wall time, this process's CPU (the Go program and
// the embedded JetStream server) and the CPU of the Postgres backends serving this
// scenario's database.
type Meter struct {
	env         *Env
	start       time.Time
	ru          syscall.Rusage
	pg          map[int]time.Duration
	stopProfile func()
}

// Measurement is what a Meter saw.
type Measurement struct {
	Elapsed time.Duration
	// ProcCPU is user+system CPU of this process (Go code and the embedded broker).
	ProcCPU time.Duration
	// PGCPU is user+system CPU of the Postgres backends connected to the scenario's
	// database during the phase (shared processes such as the WAL writer are not
	// included).
	PGCPU time.Duration
}

// StartMeter begins a timed phase (and the CPU profile, when asked for).
func (e *Env) StartMeter(ctx context.Context) (*Meter, error) {
	m := &Meter{env: e, stopProfile: func() {}}
	var err error
	if m.pg, err = e.backendCPU(ctx); err != nil {
		return nil, err
	}
	if e.cfg.CPUProfile != "" {
		m.stopProfile, err = startProfile(e.cfg.CPUProfile, e.cfg.Scenario)
		if err != nil {
			return nil, err
		}
	}
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &m.ru); err != nil {
		return nil, fmt.Errorf("meter: getrusage: %w", err)
	}
	if e.tracer != nil {
		e.tracer.Reset()
	}
	m.start = time.Now()
	return m, nil
}

// Stop ends the phase.
func (m *Meter) Stop(ctx context.Context) (Measurement, error) {
	var out Measurement
	out.Elapsed = time.Since(m.start)
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return out, fmt.Errorf("meter: getrusage: %w", err)
	}
	m.stopProfile()
	if m.env.tracer != nil {
		m.env.tracer.Print(os.Stderr, m.env.cfg.Scenario, out.Elapsed)
	}
	out.ProcCPU = tv(ru.Utime) + tv(ru.Stime) - tv(m.ru.Utime) - tv(m.ru.Stime)
	pg, err := m.env.backendCPU(ctx)
	if err != nil {
		return out, err
	}
	for pid, t := range pg {
		out.PGCPU += t - m.pg[pid] // a backend that started during the phase counts from 0
	}
	return out, nil
}

func tv(t syscall.Timeval) time.Duration {
	return time.Duration(t.Sec)*time.Second + time.Duration(t.Usec)*time.Microsecond
}

// backendCPU returns the CPU time used so far by each Postgres backend connected to
// the scenario's database, from /proc (Postgres runs on this machine). A backend
// that cannot be read (it exited, or Postgres is remote) is skipped.
func (e *Env) backendCPU(ctx context.Context) (map[int]time.Duration, error) {
	rows, err := e.Pool.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = $1`, e.DBName)
	if err != nil {
		return nil, fmt.Errorf("meter: list backends: %w", err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("meter: list backends: %w", err)
	}
	out := make(map[int]time.Duration, len(pids))
	for _, pid := range pids {
		if t, err := procCPU(int(pid)); err == nil {
			out[int(pid)] = t
		}
	}
	return out, nil
}

// clockTicks is USER_HZ, 100 on every Linux architecture Go supports.
const clockTicks = 100

// procCPU reads utime+stime of pid from /proc/PID/stat.
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, errors.New("malformed /proc stat")
	}
	// Fields after the command: state(3) ... utime(14) stime(15).
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, errors.New("short /proc stat")
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, err
	}
	return time.Duration(ut+st) * time.Second / clockTicks, nil
}

// peakRSS returns this process's peak resident set size in bytes (VmHWM).
func peakRSS() (int64, error) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("parse VmHWM: %w", err)
			}
			return kb * 1024, nil
		}
	}
	return 0, errors.New("no VmHWM in /proc/self/status")
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
