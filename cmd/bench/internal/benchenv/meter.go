package benchenv

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/cmd/bench/internal/measure"
)

// Meter measures one timed phase: wall time, this process's CPU (the Go program and
// the embedded JetStream server) and the CPU of the Postgres backends serving this
// environment's database.
type Meter struct {
	env         *Env
	start       time.Time
	cpu         time.Duration
	pg          map[int]time.Duration
	stopProfile func()
}

// StartMeter begins a timed phase (and the CPU profile, when asked for).
func (e *Env) StartMeter(ctx context.Context) (*Meter, error) {
	m := &Meter{env: e, stopProfile: func() {}}
	var err error
	if m.pg, err = e.backendCPU(ctx); err != nil {
		return nil, err
	}
	if e.cfg.CPUProfile != "" {
		m.stopProfile, err = startProfile(e.cfg.CPUProfile, e.cfg.Label)
		if err != nil {
			return nil, err
		}
	}
	if m.cpu, err = measure.SelfCPU(); err != nil {
		m.stopProfile()
		return nil, err
	}
	if e.tracer != nil {
		e.tracer.Reset()
	}
	m.start = time.Now()
	return m, nil
}

// Stop ends the phase.
func (m *Meter) Stop(ctx context.Context) (measure.Measurement, error) {
	var out measure.Measurement
	out.Elapsed = time.Since(m.start)
	cpu, err := measure.SelfCPU()
	if err != nil {
		return out, err
	}
	m.stopProfile()
	if m.env.tracer != nil {
		m.env.tracer.Print(os.Stderr, m.env.cfg.Label, out.Elapsed)
	}
	out.ProcCPU = cpu - m.cpu
	pg, err := m.env.backendCPU(ctx)
	if err != nil {
		return out, err
	}
	out.PGCPU = measure.CPUDelta(m.pg, pg)
	return out, nil
}

// backendCPU returns the CPU time used so far by each Postgres backend connected to
// the environment's database, from /proc (Postgres runs on this machine). A backend
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
		if t, err := measure.ProcCPU(int(pid)); err == nil {
			out[int(pid)] = t
		}
	}
	return out, nil
}

// ProfilePath inserts label before path's extension: cpu.pprof, e2e -> cpu.e2e.pprof.
func ProfilePath(path, label string) string {
	ext := filepath.Ext(path)
	return strings.TrimSuffix(path, ext) + "." + label + ext
}

// startProfile starts a CPU profile written to ProfilePath(path, label); the
// returned stop is never nil.
func startProfile(path, label string) (stop func(), err error) {
	path = ProfilePath(path, label)
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("cpuprofile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
		fmt.Fprintf(os.Stderr, "[%s] CPU profile written to %s\n", label, path)
	}, nil
}
