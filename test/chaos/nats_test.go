package chaos

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// natsServer is a real nats-server process (built from go.mod's version) with
// JetStream on a fixed port and store directory, so a kill -9 and restart brings
// back the same server to the same clients.
type natsServer struct {
	ps       *procs
	port     int
	storeDir string
	conf     string
	log      *os.File

	mu     sync.Mutex
	p      *proc
	starts int
}

// natsConfSyncAlways makes JetStream fsync every write, as docker-compose.yml does
// for production: the default (a sync every 2 minutes) lets a crash of the machine
// drop messages the server already acknowledged, which is not the failure most runs
// test. natsConfSyncDefault leaves the interval at that default: the store runs
// (store_test.go) lose acknowledged writes on purpose, and the reconciler must
// re-drive them.
const (
	natsConfSyncAlways  = "jetstream {\n  sync_interval: always\n}\n"
	natsConfSyncDefault = "jetstream {\n  # sync_interval left at its default (2m)\n}\n"
)

// startNATS starts nats-server with its store under dir; syncDefault leaves
// JetStream's fsync interval at its default instead of forcing a sync per write.
func startNATS(ps *procs, dir string, port int, syncDefault bool) (*natsServer, error) {
	n := &natsServer{ps: ps, port: port, storeDir: filepath.Join(dir, "store"), conf: filepath.Join(dir, "nats.conf")}
	if err := os.MkdirAll(n.storeDir, 0o755); err != nil {
		return nil, fmt.Errorf("chaos: nats store dir: %w", err)
	}
	conf := natsConfSyncAlways
	if syncDefault {
		conf = natsConfSyncDefault
	}
	if err := os.WriteFile(n.conf, []byte(conf), 0o644); err != nil {
		return nil, fmt.Errorf("chaos: nats config: %w", err)
	}
	log, err := ps.openLog("nats-server")
	if err != nil {
		return nil, err
	}
	n.log = log
	if err := n.start(); err != nil {
		return nil, err
	}
	return n, nil
}

// URL is the client URL; it does not change across restarts.
func (n *natsServer) URL() string { return "nats://127.0.0.1:" + strconv.Itoa(n.port) }

func (n *natsServer) start() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.starts++
	fmt.Fprintf(n.log, "=== chaos: nats-server start #%d\n", n.starts)
	p, err := n.ps.start("nats-server", n.log, nil, nil, natsBin,
		"-c", n.conf, "-js", "-sd", n.storeDir, "-p", strconv.Itoa(n.port), "-a", "127.0.0.1")
	if err != nil {
		return err
	}
	n.p = p
	return n.waitReady(p, 30*time.Second)
}

// waitReady polls until JetStream answers on the port (its store recovered).
func (n *natsServer) waitReady(p *proc, timeout time.Duration) error {
	return waitStarted(p, timeout, "nats-server", func() error { return jetStreamAnswers(n.URL()) })
}

// waitStarted polls up until it returns nil, failing at once if the process p
// exits and after timeout otherwise; what names the process in the errors.
func waitStarted(p *proc, timeout time.Duration, what string, up func() error) error {
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		if p.exited() {
			return fmt.Errorf("chaos: %s exited while starting (%s); see its log", what, p.outcome())
		}
		if last = up(); last == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond) // poll interval
	}
	return fmt.Errorf("chaos: %s not ready after %s: %w", what, timeout, last)
}

func jetStreamAnswers(url string) error {
	nc, err := nats.Connect(url, nats.Timeout(time.Second), nats.NoReconnect())
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = js.AccountInfo(ctx)
	return err
}

// crash is kill -9, a pause of down (the fault schedule's outage), and a restart on
// the same port and store.
func (n *natsServer) crash(ctx context.Context, down time.Duration) error {
	return n.crashWith(ctx, down, "", nil)
}

// crashWith is crash with damage done to the store while the server is dead:
// mutate runs after the kill -9 has been reaped and before the restart (what was
// done is logged as what). The server is restarted even when mutate fails.
func (n *natsServer) crashWith(ctx context.Context, down time.Duration, what string, mutate func() error) error {
	n.mu.Lock()
	p := n.p
	n.mu.Unlock()
	p.kill()
	<-p.done
	fmt.Fprintf(n.log, "=== chaos: nats-server %s; down for %s\n", p.outcome(), down)
	var merr error
	if mutate != nil {
		merr = mutate()
		fmt.Fprintf(n.log, "=== chaos: store damaged while nats-server was down: %s (err %v)\n", what, merr)
	}
	select {
	case <-time.After(down):
	case <-ctx.Done():
	}
	if err := n.start(); err != nil {
		return errors.Join(merr, err)
	}
	return merr
}

// down is kill -9 without a restart: the broker stays away until start.
func (n *natsServer) down() {
	n.mu.Lock()
	p := n.p
	n.mu.Unlock()
	p.kill()
	<-p.done
	fmt.Fprintf(n.log, "=== chaos: nats-server %s; down until restarted\n", p.outcome())
}

// streamMsgsDir is where the file store keeps stream's message blocks (account $G,
// the one an unconfigured server has).
func (n *natsServer) streamMsgsDir(stream string) string {
	return filepath.Join(n.storeDir, "jetstream", "$G", "streams", stream, "msgs")
}

// signal sends sig to the running nats-server: SIGSTOP pauses it, a broker that
// stops answering with its connections open (crash kills it even so).
func (n *natsServer) signal(sig syscall.Signal) {
	n.mu.Lock()
	p := n.p
	n.mu.Unlock()
	_ = p.cmd.Process.Signal(sig)
}
