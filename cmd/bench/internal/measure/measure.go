// Package measure takes the benchmark's measurements: CPU time (this process and
// the Postgres backends of a scenario's database, read from /proc), peak RSS, and
// the arithmetic the rows are made of (latency percentiles, rates, CPU per intent).
//
// The parsers and the arithmetic are pure functions, so they are tested without a
// database; the functions that read /proc or getrusage are thin wrappers over them.
package measure

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Measurement is what one timed phase took.
type Measurement struct {
	Elapsed time.Duration
	// ProcCPU is user+system CPU of this process (Go code and the embedded broker).
	ProcCPU time.Duration
	// PGCPU is user+system CPU of the Postgres backends connected to the scenario's
	// database during the phase (shared processes such as the WAL writer are not
	// included).
	PGCPU time.Duration
}

// SelfCPU returns the user+system CPU this process has used so far.
func SelfCPU() (time.Duration, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, fmt.Errorf("measure: getrusage: %w", err)
	}
	return timeval(ru.Utime) + timeval(ru.Stime), nil
}

func timeval(t syscall.Timeval) time.Duration {
	return time.Duration(t.Sec)*time.Second + time.Duration(t.Usec)*time.Microsecond
}

// CPUDelta adds up what each process used between two samples of per-pid CPU
// times. A pid that appears only in after started during the phase and counts
// from zero; one that appears only in before exited, and what it used after the
// first sample is lost (Postgres backends of a scenario live as long as its pool).
func CPUDelta(before, after map[int]time.Duration) time.Duration {
	var d time.Duration
	for pid, t := range after {
		d += t - before[pid]
	}
	return d
}

// clockTicks is USER_HZ, 100 on every Linux architecture Go supports.
const clockTicks = 100

// ProcCPU reads utime+stime of pid from /proc/PID/stat.
func ProcCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	return ParseProcStat(b)
}

// ParseProcStat returns utime+stime from the contents of a /proc/PID/stat file.
// The command name (field 2) is parenthesised and may hold spaces and parentheses,
// so the fields are counted from its last ')'.
func ParseProcStat(b []byte) (time.Duration, error) {
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, errors.New("measure: malformed /proc stat: no command name")
	}
	// Fields after the command: state(3) ... utime(14) stime(15).
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, errors.New("measure: short /proc stat")
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, fmt.Errorf("measure: /proc stat: %w", err)
	}
	return time.Duration(ut+st) * time.Second / clockTicks, nil
}

// PeakRSS returns this process's peak resident set size in bytes (VmHWM).
func PeakRSS() (int64, error) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, fmt.Errorf("measure: %w", err)
	}
	kb, err := ParseKB(b, "VmHWM")
	if err != nil {
		return 0, err
	}
	return kb * 1024, nil
}

// ParseKB returns the value, in kB, of the line "field: N kB" of a /proc file such
// as /proc/self/status or /proc/meminfo.
func ParseKB(b []byte, field string) (int64, error) {
	for line := range strings.SplitSeq(string(b), "\n") {
		rest, ok := strings.CutPrefix(line, field+":")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("measure: parse %s: %w", field, err)
		}
		return kb, nil
	}
	return 0, fmt.Errorf("measure: no %s line", field)
}

// CPUModel returns the first "model name" of a /proc/cpuinfo, or "".
func CPUModel(cpuinfo []byte) string {
	for line := range strings.SplitSeq(string(cpuinfo), "\n") {
		if rest, ok := strings.CutPrefix(line, "model name"); ok {
			return strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(rest), ":"))
		}
	}
	return ""
}

// Sample is a reading taken at the start or the end of a timed phase: the
// clock, this process's CPU, and each listed backend's CPU.
type Sample struct {
	At       time.Time
	CPU      time.Duration
	Backends map[int]time.Duration
}

// Take reads the clock and this process's CPU (in that order, so a start sample
// is taken as late and an end sample as early as it can be), then the CPU of
// each of pids (BackendsCPU).
func Take(pids []int) (Sample, error) {
	s := Sample{At: time.Now()}
	var err error
	if s.CPU, err = SelfCPU(); err != nil {
		return s, err
	}
	s.Backends = BackendsCPU(pids)
	return s, nil
}

// Querier is what Backends needs of a pool or connection.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Backends lists the pids of the Postgres backends connected to database
// (Postgres runs on this machine: their CPU is read from /proc, BackendsCPU).
func Backends(ctx context.Context, db Querier, database string) ([]int, error) {
	rows, err := db.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = $1`, database)
	if err != nil {
		return nil, fmt.Errorf("meter: list backends: %w", err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("meter: list backends: %w", err)
	}
	out := make([]int, len(pids))
	for i, p := range pids {
		out[i] = int(p)
	}
	return out, nil
}

// BackendsCPU reads the CPU each of pids has used so far, skipping a pid that
// cannot be read.
func BackendsCPU(pids []int) map[int]time.Duration {
	out := make(map[int]time.Duration, len(pids))
	for _, pid := range pids {
		if t, err := ProcCPU(pid); err == nil {
			out[pid] = t
		}
	}
	return out
}

// Between is what a phase took from the sample start to the sample end.
func Between(start, end Sample) Measurement {
	return Measurement{
		Elapsed: end.At.Sub(start.At),
		ProcCPU: end.CPU - start.CPU,
		PGCPU:   CPUDelta(start.Backends, end.Backends),
	}
}
