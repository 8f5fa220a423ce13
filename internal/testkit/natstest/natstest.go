// Package natstest starts a real nats-server with JetStream for one test, as a
// process of its own.
//
// The server is built from source at the version internal/testkit/natsserver pins,
// once, into the user's cache directory, and shared by every test binary that asks
// for it (Binary). The library does not depend on the server's code, so an
// embedder's module graph holds no nats-server; its tests pay a process start
// instead.
package natstest

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gofrs/flock"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Options shape a server. The zero value is a JetStream server on a free loopback
// port with its store in the test's temp dir and a generated token.
type Options struct {
	// StoreDir holds JetStream's files (default: a new t.TempDir()).
	StoreDir string
	// Port is the client port (default: a free one). A restart keeps it.
	Port int
	// Token is the credential clients present (default: generated).
	Token string
	// MaxPayload is the largest message the server takes (default: the server's).
	MaxPayload int
	// SyncAlways fsyncs every JetStream write.
	SyncAlways bool
}

// Server is a running nats-server process.
type Server struct {
	opts Options
	dir  string   // the config and log files
	temp []string // directories Run made, removed by Close

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// Unreachable returns a connection to a server that is not there (port 1 of
// the loopback), closed at cleanup. It is never connected and never reconnects
// within a test, so a request on it fails or times out. A test that must show a
// setup step touches no broker hands it this connection.
func Unreachable(t testing.TB) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect("nats://127.0.0.1:1", nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1), nats.ReconnectWait(time.Hour))
	if err != nil {
		t.Fatalf("natstest: unreachable connection: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// Start runs a JetStream server for t and stops it at cleanup.
func Start(t testing.TB) *Server {
	t.Helper()
	return StartWith(t, Options{})
}

// StartWith runs a server shaped by opts for t and stops it at cleanup.
func StartWith(t testing.TB, opts Options) *Server {
	t.Helper()
	if opts.StoreDir == "" {
		opts.StoreDir = t.TempDir()
	}
	s, err := Run(opts)
	if err != nil {
		t.Fatalf("natstest: %v", err)
	}
	t.Cleanup(s.Close)
	return s
}

// Run starts a server shaped by opts without a test: what StartWith does, for
// TestMain, Example functions and other kits. Close it when done.
func Run(opts Options) (*Server, error) {
	s := &Server{}
	var err error
	if opts.StoreDir == "" {
		if opts.StoreDir, err = os.MkdirTemp("", "natstest-store-"); err != nil {
			return nil, fmt.Errorf("natstest: %w", err)
		}
		s.temp = append(s.temp, opts.StoreDir)
	}
	if s.dir, err = os.MkdirTemp("", "natstest-"); err != nil {
		s.Close()
		return nil, fmt.Errorf("natstest: %w", err)
	}
	s.temp = append(s.temp, s.dir)
	if opts.Token == "" {
		var b [16]byte
		_, _ = rand.Read(b[:])
		opts.Token = hex.EncodeToString(b[:])
	}
	if opts.Port == 0 {
		if opts.Port, err = freePort(); err != nil {
			s.Close()
			return nil, fmt.Errorf("natstest: %w", err)
		}
	}
	s.opts = opts
	if err := s.start(); err != nil {
		s.Close()
		return nil, fmt.Errorf("natstest: %w", err)
	}
	return s, nil
}

// Close stops the server and removes the directories Run made for it.
func (s *Server) Close() {
	s.Stop()
	for _, d := range s.temp {
		_ = os.RemoveAll(d)
	}
}

// URL is the client URL, token included (nats.Connect takes a URL's user part as
// the token).
func (s *Server) URL() string {
	u := url.URL{Scheme: "nats", User: url.User(s.opts.Token), Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(s.opts.Port))}
	return u.String()
}

// Options returns the options the server runs with, Port and Token filled in.
func (s *Server) Options() Options { return s.opts }

// Stop shuts the server down (SIGTERM, then SIGKILL after ten seconds) and waits
// for the process to exit. It is a no-op on a stopped server.
func (s *Server) Stop() { s.signal(syscall.SIGTERM) }

// Kill stops the server with SIGKILL, as a crash would.
func (s *Server) Kill() { s.signal(syscall.SIGKILL) }

func (s *Server) signal(sig syscall.Signal) {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// Restart stops the server and starts it again on the same port and store, with
// the same token, as after a crash of the broker (JetStream's files are what
// survives).
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Stop()
	if err := s.start(); err != nil {
		t.Fatalf("natstest: restart: %v", err)
	}
}

// Resume starts a server that Stop or Kill stopped, on the same port and store,
// with the same token: the broker back after an outage.
func (s *Server) Resume(t testing.TB) {
	t.Helper()
	if err := s.start(); err != nil {
		t.Fatalf("natstest: resume: %v", err)
	}
}

// Restart is s.Restart, returning s, for callers that hold a server value.
func Restart(t testing.TB, s *Server) *Server {
	t.Helper()
	s.Restart(t)
	return s
}

func (s *Server) start() error {
	bin, err := Binary()
	if err != nil {
		return err
	}
	conf := fmt.Sprintf("listen: 127.0.0.1:%d\nauthorization { token: %q }\njetstream { store_dir: %q%s }\n",
		s.opts.Port, s.opts.Token, s.opts.StoreDir, map[bool]string{true: ", sync_interval: always", false: ""}[s.opts.SyncAlways])
	if s.opts.MaxPayload > 0 {
		conf += fmt.Sprintf("max_payload: %d\n", s.opts.MaxPayload)
	}
	confFile := filepath.Join(s.dir, "nats.conf")
	if err := os.WriteFile(confFile, []byte(conf), 0o600); err != nil {
		return err
	}
	logFile, err := os.OpenFile(filepath.Join(s.dir, "nats.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, "-c", confFile)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return fmt.Errorf("start nats-server: %w", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logFile.Close()
		close(done)
	}()
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()
	if err := s.ready(done); err != nil {
		s.Kill()
		log, _ := os.ReadFile(filepath.Join(s.dir, "nats.log"))
		return fmt.Errorf("nats-server on port %d: %w\n%s", s.opts.Port, err, log)
	}
	return nil
}

// ready waits until the server answers a JetStream request.
func (s *Server) ready(exited <-chan struct{}) error {
	deadline := time.Now().Add(30 * time.Second)
	var last error
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return errors.New("exited at start")
		default:
		}
		if last = s.ping(); last == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("not ready after 30s: %w", last)
}

func (s *Server) ping() error {
	nc, err := nats.Connect(s.URL(), nats.Timeout(time.Second), nats.NoReconnect())
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err = js.AccountInfo(ctx)
	return err
}

var build struct {
	once sync.Once
	bin  string
	err  error
}

// Binary returns the path of the nats-server binary, building it the first time
// (in this process, and across processes by a lock on the cache directory).
func Binary() (string, error) {
	build.once.Do(func() { build.bin, build.err = buildBinary() })
	return build.bin, build.err
}

func buildBinary() (string, error) {
	_, self, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("natstest: cannot find the test kit's source")
	}
	tools := filepath.Join(filepath.Dir(self), "..", "natsserver")
	sum, err := os.ReadFile(filepath.Join(tools, "go.sum"))
	if err != nil {
		return "", fmt.Errorf("natstest: the tool module that pins nats-server: %w", err)
	}
	h := sha256.Sum256(sum)
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "idem-testkit")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("natstest: %w", err)
	}
	bin := filepath.Join(dir, "nats-server-"+hex.EncodeToString(h[:8]))
	lock := flock.New(bin + ".lock")
	if err := lock.Lock(); err != nil {
		return "", fmt.Errorf("natstest: lock %s: %w", lock.Path(), err)
	}
	defer lock.Unlock() //nolint:errcheck
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	tmp := bin + ".tmp"
	cmd := exec.Command("go", "build", "-o", tmp, "github.com/nats-io/nats-server/v2")
	cmd.Dir = tools
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("natstest: build nats-server in %s: %w\n%s", tools, err, out)
	}
	if err := os.Rename(tmp, bin); err != nil {
		return "", fmt.Errorf("natstest: %w", err)
	}
	return bin, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
