package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
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

// env is one phase's fresh environment: a new database on the server and a new
// embedded JetStream server with an empty store.
type env struct {
	label    string
	adminURL string
	keep     bool
	dbName   string
	pool     *pgxpool.Pool
	nats     *server.Server
	storeDir string
}

// newEnv creates the database (with the application's tables) and starts the
// broker. close undoes both.
func newEnv(ctx context.Context, label, adminURL string, maxConns int32, keep bool) (e *env, err error) {
	e = &env{label: label, adminURL: adminURL, keep: keep}
	defer func() {
		if err != nil {
			e.close(context.WithoutCancel(ctx))
		}
	}()

	var b [5]byte
	_, _ = rand.Read(b[:])
	name := "bench_wm_" + hex.EncodeToString(b[:])
	admin, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return e, fmt.Errorf("connect to %s: %w", redact(adminURL), err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		return e, fmt.Errorf("create database %s: %w", name, err)
	}
	e.dbName = name

	u, err := url.Parse(adminURL)
	if err != nil {
		return e, fmt.Errorf("parse database URL: %w", err)
	}
	u.Path = "/" + name
	pcfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		return e, fmt.Errorf("pool config: %w", err)
	}
	pcfg.MaxConns = maxConns
	if e.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return e, fmt.Errorf("open pool: %w", err)
	}
	if _, err := e.pool.Exec(ctx, schema); err != nil {
		return e, fmt.Errorf("create tables: %w", err)
	}

	if e.storeDir, err = os.MkdirTemp("", "bench-wm-js-"); err != nil {
		return e, fmt.Errorf("JetStream store dir: %w", err)
	}
	// The embedded server as idem's bench runs it (internal/embeddednats): real
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
func (e *env) close(ctx context.Context) {
	if e.nats != nil {
		e.nats.Shutdown()
		e.nats.WaitForShutdown()
	}
	if e.storeDir != "" {
		_ = os.RemoveAll(e.storeDir)
	}
	if e.pool != nil {
		e.pool.Close()
	}
	if e.dbName == "" {
		return
	}
	if e.keep {
		fmt.Fprintf(os.Stderr, "[%s] kept database %s\n", e.label, e.dbName)
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, e.adminURL)
	if err != nil {
		fmt.Fprintf(os.Stderr, "[%s] drop database %s: %v\n", e.label, e.dbName, err)
		return
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+e.dbName+" WITH (FORCE)"); err != nil {
		fmt.Fprintf(os.Stderr, "[%s] drop database %s: %v\n", e.label, e.dbName, err)
	}
}

func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparseable URL)"
	}
	return u.Redacted()
}

// The meter below is cmd/bench's (env.go), copied: the numbers must be taken the
// same way for the rows to compare.

// meter measures one timed phase: wall time, this process's CPU (the Go program
// and the embedded JetStream server) and the CPU of the Postgres backends serving
// this phase's database.
type meter struct {
	env   *env
	start time.Time
	ru    syscall.Rusage
	pg    map[int]time.Duration
}

// measurement is what a meter saw.
type measurement struct {
	elapsed time.Duration
	// procCPU is user+system CPU of this process (Go code and the embedded broker).
	procCPU time.Duration
	// pgCPU is user+system CPU of the Postgres backends connected to the phase's
	// database (shared processes such as the WAL writer are not included).
	pgCPU time.Duration
}

func (e *env) startMeter(ctx context.Context) (*meter, error) {
	m := &meter{env: e}
	var err error
	if m.pg, err = e.backendCPU(ctx); err != nil {
		return nil, err
	}
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &m.ru); err != nil {
		return nil, fmt.Errorf("meter: getrusage: %w", err)
	}
	m.start = time.Now()
	return m, nil
}

func (m *meter) stop(ctx context.Context) (measurement, error) {
	var out measurement
	out.elapsed = time.Since(m.start)
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return out, fmt.Errorf("meter: getrusage: %w", err)
	}
	out.procCPU = tv(ru.Utime) + tv(ru.Stime) - tv(m.ru.Utime) - tv(m.ru.Stime)
	pg, err := m.env.backendCPU(ctx)
	if err != nil {
		return out, err
	}
	for pid, t := range pg {
		out.pgCPU += t - m.pg[pid] // a backend that started during the phase counts from 0
	}
	return out, nil
}

func tv(t syscall.Timeval) time.Duration {
	return time.Duration(t.Sec)*time.Second + time.Duration(t.Usec)*time.Microsecond
}

// backendCPU returns the CPU time used so far by each Postgres backend connected
// to the phase's database, from /proc (Postgres runs on this machine). A backend
// that cannot be read (it exited, or Postgres is remote) is skipped.
func (e *env) backendCPU(ctx context.Context) (map[int]time.Duration, error) {
	rows, err := e.pool.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = $1`, e.dbName)
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
