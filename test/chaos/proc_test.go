package chaos

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// proc is one child process: the nats-server, one incarnation of a worker, or one
// enqueue invocation.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{} // closed once the process has exited and been reaped
}

// kill sends SIGKILL: no handler, no flush, no deferred function. It is harmless on a
// process that already exited.
func (p *proc) kill() { _ = p.cmd.Process.Signal(syscall.SIGKILL) }

// exited reports whether the process has ended.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// killed reports whether the process died of SIGKILL (valid after done).
func (p *proc) killed() bool {
	ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// exitCode is the exit status, or -1 when a signal ended the process (valid after
// done).
func (p *proc) exitCode() int { return p.cmd.ProcessState.ExitCode() }

// outcome describes how the process ended, for logs.
func (p *proc) outcome() string {
	if p.killed() {
		return "killed by SIGKILL"
	}
	return p.cmd.ProcessState.String()
}

// procs owns every child process and log file of one run. Cleanup kills whatever is
// still alive, even when the test failed half-way; a failed test gets the tail of
// every log.
type procs struct {
	dir string // where log files go (under t.TempDir())

	mu   sync.Mutex
	live map[*proc]struct{}
	logs []string // paths, in creation order
}

func newProcs(t *testing.T, dir string) *procs {
	ps := &procs{dir: dir, live: map[*proc]struct{}{}}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("chaos: log dir: %v", err)
	}
	t.Cleanup(func() {
		ps.killAll()
		if t.Failed() {
			ps.dumpTails(t, 40)
		}
	})
	return ps
}

// openLog opens (appending) the log file name.log; every incarnation of a worker
// appends to its slot's file, every enqueue of a lane to the lane's.
func (ps *procs) openLog(name string) (*os.File, error) {
	path := filepath.Join(ps.dir, name+".log")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("chaos: open log %s: %w", path, err)
	}
	ps.mu.Lock()
	ps.logs = append(ps.logs, path)
	ps.mu.Unlock()
	return f, nil
}

// addLog registers a log file some other program writes (the private Postgres
// server's), so that a failed run prints its tail too.
func (ps *procs) addLog(path string) {
	ps.mu.Lock()
	ps.logs = append(ps.logs, path)
	ps.mu.Unlock()
}

// start runs bin with args. stderr goes to log, stdout to stdout (or log when nil);
// env is added to a scrubbed copy of ours.
func (ps *procs) start(name string, log, stdout *os.File, env []string, bin string, args ...string) (*proc, error) {
	cmd := exec.Command(bin, args...)
	cmd.Env = childEnv(env)
	cmd.Stderr = log
	cmd.Stdout = log
	if stdout != nil {
		cmd.Stdout = stdout
	}
	// Own process group (a ^C to go test is ours to handle), and SIGKILL if the test
	// process dies without running its cleanup.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("chaos: start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	ps.mu.Lock()
	ps.live[p] = struct{}{}
	ps.mu.Unlock()
	go func() {
		_ = cmd.Wait() // the exit status is read from ProcessState
		ps.mu.Lock()
		delete(ps.live, p)
		ps.mu.Unlock()
		close(p.done)
	}()
	return p, nil
}

// killAll SIGKILLs every live process and waits until each is reaped.
func (ps *procs) killAll() {
	ps.mu.Lock()
	live := make([]*proc, 0, len(ps.live))
	for p := range ps.live {
		live = append(live, p)
	}
	ps.mu.Unlock()
	for _, p := range live {
		p.kill()
	}
	for _, p := range live {
		<-p.done
	}
}

// childEnv is our environment without anything that would steer a child by accident
// (a stray IDEM_FAULTS in the developer's shell, a DATABASE_URL pointing elsewhere),
// plus extra.
func childEnv(extra []string) []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "IDEM_") || name == "DATABASE_URL" || name == "NATS_URL" {
			continue
		}
		env = append(env, kv)
	}
	return append(env, extra...)
}

// dumpTails logs the last n lines of every log file.
func (ps *procs) dumpTails(t *testing.T, n int) {
	ps.mu.Lock()
	logs := append([]string(nil), ps.logs...)
	ps.mu.Unlock()
	for _, path := range logs {
		tail, err := tailFile(path, n)
		if err != nil {
			t.Logf("chaos: %v", err)
			continue
		}
		t.Logf("chaos: ---- last %d lines of %s ----\n%s", n, filepath.Base(path), tail)
	}
}

func tailFile(path string, n int) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("tail %s: %w", path, err)
	}
	defer f.Close()
	const window = 64 << 10
	if st, err := f.Stat(); err == nil && st.Size() > window {
		if _, err := f.Seek(st.Size()-window, io.SeekStart); err != nil {
			return "", fmt.Errorf("tail %s: %w", path, err)
		}
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return "", fmt.Errorf("tail %s: %w", path, err)
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n"))), nil
}

// countInLogs counts occurrences of each needle over every log file whose name
// starts with prefix.
func (ps *procs) countInLogs(prefix string, needles ...string) (map[string]int, error) {
	ps.mu.Lock()
	logs := append([]string(nil), ps.logs...)
	ps.mu.Unlock()
	counts := make(map[string]int, len(needles))
	seen := map[string]bool{}
	for _, path := range logs {
		if seen[path] || !strings.HasPrefix(filepath.Base(path), prefix) {
			continue
		}
		seen[path] = true
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("chaos: read %s: %w", path, err)
		}
		for _, s := range needles {
			counts[s] += bytes.Count(b, []byte(s))
		}
	}
	return counts, nil
}

// firstLine returns the first line containing needle in the log file name.log, or
// "".
func (ps *procs) firstLine(name, needle string) string {
	b, err := os.ReadFile(filepath.Join(ps.dir, name+".log"))
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.Contains(line, needle) {
			return line
		}
	}
	return ""
}

// relayMode is the relay the workers run: the log relay, which the suite's own
// Postgres (wal_level = logical, a superuser) allows, or the polling relay when the
// suite runs its polling pass (IDEM_TEST_RELAY=poll, as make test does).
func relayMode() string {
	if os.Getenv("IDEM_TEST_RELAY") == "poll" {
		return "poll"
	}
	return "log"
}
