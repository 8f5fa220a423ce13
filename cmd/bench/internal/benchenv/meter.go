package benchenv

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strings"

	"github.com/idemkit/idem/cmd/bench/internal/measure"
)

// Meter measures one timed phase: wall time, this process's CPU (the Go program and
// the embedded JetStream server) and the CPU of the Postgres backends serving this
// environment's database.
type Meter struct {
	env         *Env
	start       measure.Sample
	stopProfile func()
}

// StartMeter begins a timed phase (and the CPU profile, when asked for).
func (e *Env) StartMeter(ctx context.Context) (*Meter, error) {
	m := &Meter{env: e, stopProfile: func() {}}
	pids, err := e.backends(ctx)
	if err != nil {
		return nil, err
	}
	if e.cfg.CPUProfile != "" {
		m.stopProfile, err = startProfile(e.cfg.CPUProfile, e.cfg.Label)
		if err != nil {
			return nil, err
		}
	}
	if m.start, err = measure.Take(pids); err != nil {
		m.stopProfile()
		return nil, err
	}
	if e.tracer != nil {
		e.tracer.Reset()
	}
	return m, nil
}

// Stop ends the phase. The backends are listed again after the clock and this
// process's CPU are read, so a backend that started during the phase counts.
func (m *Meter) Stop(ctx context.Context) (measure.Measurement, error) {
	end, err := measure.Take(nil)
	if err != nil {
		return measure.Measurement{}, err
	}
	m.stopProfile()
	if m.env.tracer != nil {
		m.env.tracer.Print(os.Stderr, m.env.cfg.Label, end.At.Sub(m.start.At))
	}
	pids, err := m.env.backends(ctx)
	if err != nil {
		return measure.Measurement{}, err
	}
	end.Backends = measure.BackendsCPU(pids)
	return measure.Between(m.start, end), nil
}

// backends lists the Postgres backends connected to the database.
func (e *Env) backends(ctx context.Context) ([]int, error) {
	return measure.Backends(ctx, e.Pool, e.DBName)
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
