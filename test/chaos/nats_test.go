package chaos

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
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

// natsConf makes JetStream fsync every write, as docker-compose.yml does for
// production: the default (a sync every 2 minutes) lets a crash of the machine drop
// messages the server already acknowledged, which is not the failure under test.
const natsConf = "jetstream {\n  sync_interval: always\n}\n"

func startNATS(ps *procs, dir string, port int) (*natsServer, error) {
	n := &natsServer{ps: ps, port: port, storeDir: filepath.Join(dir, "store"), conf: filepath.Join(dir, "nats.conf")}
	if err := os.MkdirAll(n.storeDir, 0o755); err != nil {
		return nil, fmt.Errorf("chaos: nats store dir: %w", err)
	}
	if err := os.WriteFile(n.conf, []byte(natsConf), 0o644); err != nil {
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
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		if p.exited() {
			return fmt.Errorf("chaos: nats-server exited while starting (%s); see its log", p.outcome())
		}
		if last = jetStreamAnswers(n.URL()); last == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond) // poll interval
	}
	return fmt.Errorf("chaos: nats-server not ready after %s: %w", timeout, last)
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
	n.mu.Lock()
	p := n.p
	n.mu.Unlock()
	p.kill()
	<-p.done
	fmt.Fprintf(n.log, "=== chaos: nats-server %s; down for %s\n", p.outcome(), down)
	select {
	case <-time.After(down):
	case <-ctx.Done():
	}
	return n.start()
}
