package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// clusterSize is the number of nats-server nodes of a cluster run: the smallest
// cluster that keeps a quorum for an R3 stream with one node down.
const clusterSize = 3

// clusterName is the cluster's name in every node's config.
const clusterName = "idem-chaos"

// portsPerNode: a client port, a route port and a monitoring port (/healthz, /jsz).
const portsPerNode = 3

// natsCluster is clusterSize real nats-server processes (built from go.mod's
// version) routed to each other, each with its own config file, store directory
// and fixed ports: a node killed and restarted comes back at the same address and
// on the same store, where the clients and the other nodes' routes look for it.
type natsCluster struct {
	nodes []*natsNode
}

// natsNode is one node of the cluster, one process at a time.
type natsNode struct {
	name      string // server_name, as JetStream's cluster info names it
	ps        *procs
	port      int // clients
	routePort int // cluster routes
	httpPort  int // monitoring
	storeDir  string
	conf      string
	log       *os.File

	mu     sync.Mutex
	p      *proc
	starts int
	frozen bool // SIGSTOPped and not yet SIGCONTinued
}

// startNATSCluster writes a config per node under dir, starts every node and waits
// until each says it is healthy (its JetStream meta layer has a leader and is
// current). ports holds portsPerNode ports per node.
func startNATSCluster(ctx context.Context, r *run, dir string, ports []int) (*natsCluster, error) {
	if len(ports) != clusterSize*portsPerNode {
		return nil, fmt.Errorf("chaos: cluster: %d ports for %d nodes", len(ports), clusterSize)
	}
	c := &natsCluster{}
	var routes []string
	for i := range clusterSize {
		n := &natsNode{
			name: fmt.Sprintf("n%d", i+1), ps: r.procs,
			port: ports[i*portsPerNode], routePort: ports[i*portsPerNode+1], httpPort: ports[i*portsPerNode+2],
		}
		n.storeDir = filepath.Join(dir, n.name, "store")
		n.conf = filepath.Join(dir, n.name, "nats.conf")
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", n.routePort))
		c.nodes = append(c.nodes, n)
	}
	for _, n := range c.nodes {
		if err := n.prepare(routes); err != nil {
			return nil, err
		}
	}
	// All at once: a node alone has no quorum, and its JetStream waits for the others.
	for _, n := range c.nodes {
		if err := n.start(); err != nil {
			return nil, err
		}
	}
	err := r.waitFor(ctx, time.Minute, "every nats-server node to be healthy", func() (bool, string, error) {
		var sick []string
		for _, n := range c.nodes {
			if err := n.healthz(ctx); err != nil {
				sick = append(sick, err.Error())
			}
		}
		return len(sick) == 0, strings.Join(sick, "; "), nil
	})
	if err != nil {
		return nil, fmt.Errorf("chaos: cluster: %w", err)
	}
	return c, nil
}

// prepare writes the node's config file and opens its log.
func (n *natsNode) prepare(routes []string) error {
	if err := os.MkdirAll(n.storeDir, 0o755); err != nil {
		return fmt.Errorf("chaos: cluster: %s store dir: %w", n.name, err)
	}
	if err := os.WriteFile(n.conf, []byte(n.config(routes)), 0o644); err != nil {
		return fmt.Errorf("chaos: cluster: %s config: %w", n.name, err)
	}
	log, err := n.ps.openLog("nats-" + n.name)
	if err != nil {
		return err
	}
	n.log = log
	return nil
}

// config is the node's nats-server config. Every node lists every route, its own
// included (nats-server skips a route to itself), so all three files differ only
// in name, ports and store. JetStream fsyncs every write, as production should
// (see natsConfSyncAlways): a node's loss of acknowledged writes is not what this
// run tests, the loss of the node is.
func (n *natsNode) config(routes []string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "server_name: %s\nlisten: \"127.0.0.1:%d\"\nhttp: \"127.0.0.1:%d\"\n", n.name, n.port, n.httpPort)
	fmt.Fprintf(&b, "jetstream {\n  store_dir: %q\n  sync_interval: always\n}\n", n.storeDir)
	fmt.Fprintf(&b, "cluster {\n  name: %s\n  listen: \"127.0.0.1:%d\"\n  routes: [\n", clusterName, n.routePort)
	for _, r := range routes {
		fmt.Fprintf(&b, "    %q\n", r)
	}
	b.WriteString("  ]\n}\n")
	return b.String()
}

// URL is the node's client URL; it does not change across restarts.
func (n *natsNode) URL() string { return "nats://127.0.0.1:" + strconv.Itoa(n.port) }

// urls is every node's client URL, comma-separated, as the workers' --nats-url
// takes them.
func (c *natsCluster) urls() string {
	var us []string
	for _, n := range c.nodes {
		us = append(us, n.URL())
	}
	return strings.Join(us, ",")
}

// node is the node named name, or nil.
func (c *natsCluster) node(name string) *natsNode {
	for _, n := range c.nodes {
		if n.name == name {
			return n
		}
	}
	return nil
}

// start runs the node on its config and store, and returns once it accepts client
// connections. Its JetStream may still be catching up: waitCurrent says when it
// has.
func (n *natsNode) start() error {
	n.mu.Lock()
	n.starts++
	fmt.Fprintf(n.log, "=== chaos: nats-server %s start #%d\n", n.name, n.starts)
	p, err := n.ps.start("nats-"+n.name, n.log, nil, nil, natsBin, "-c", n.conf)
	if err == nil {
		n.p, n.frozen = p, false
	}
	n.mu.Unlock()
	if err != nil {
		return err
	}
	return n.waitListening(p, 30*time.Second)
}

// waitListening polls until the node accepts a client connection.
func (n *natsNode) waitListening(p *proc, timeout time.Duration) error {
	return waitStarted(p, timeout, "cluster node "+n.name, func() error {
		nc, err := nats.Connect(n.URL(), nats.Timeout(time.Second), nats.NoReconnect())
		if err == nil {
			nc.Close()
		}
		return err
	})
}

// proc is the running process.
func (n *natsNode) proc() *proc {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.p
}

// up reports whether the node runs and is not stopped: one to ask questions.
func (n *natsNode) up() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.p != nil && !n.p.exited() && !n.frozen
}

// kill9 SIGKILLs the node and waits until it is reaped: no shutdown, no leadership
// handed over, the store as the last fsync left it.
func (n *natsNode) kill9() {
	p := n.proc()
	p.kill()
	<-p.done
	fmt.Fprintf(n.log, "=== chaos: nats-server %s %s\n", n.name, p.outcome())
}

// term sends SIGTERM (nats-server's graceful shutdown: it steps down from the raft
// groups it leads) and waits for the exit; a node still alive after 30s is
// SIGKILLed, and term says so.
func (n *natsNode) term() error {
	p := n.proc()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return fmt.Errorf("chaos: cluster: SIGTERM %s: %w", n.name, err)
	}
	select {
	case <-p.done:
		fmt.Fprintf(n.log, "=== chaos: nats-server %s after SIGTERM: %s\n", n.name, p.outcome())
		return nil
	case <-time.After(30 * time.Second):
		n.kill9()
		return fmt.Errorf("chaos: cluster: %s still running 30s after SIGTERM; SIGKILLed it", n.name)
	}
}

// freeze SIGSTOPs the node: its sockets stay open and its peers and clients see
// silence, not a closed connection.
func (n *natsNode) freeze() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if err := n.p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		return fmt.Errorf("chaos: cluster: SIGSTOP %s: %w", n.name, err)
	}
	n.frozen = true
	fmt.Fprintf(n.log, "=== chaos: nats-server %s SIGSTOPped\n", n.name)
	return nil
}

// thaw SIGCONTs a frozen node; it is harmless on one that is not.
func (n *natsNode) thaw() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.frozen {
		return nil
	}
	if err := n.p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		return fmt.Errorf("chaos: cluster: SIGCONT %s: %w", n.name, err)
	}
	n.frozen = false
	fmt.Fprintf(n.log, "=== chaos: nats-server %s SIGCONTinued\n", n.name)
	return nil
}

// healthz is nil when the node's /healthz says ok: its meta layer has a leader
// and is current, and so is every stream and durable consumer it holds a replica
// of.
func (n *natsNode) healthz(ctx context.Context) error {
	var st struct {
		Status string `json:"status"`
		Error  string `json:"error"`
	}
	code, err := n.getJSON(ctx, "/healthz", &st)
	if err != nil {
		return err
	}
	if code != http.StatusOK || st.Status != "ok" {
		return fmt.Errorf("%s: /healthz %d %s: %s", n.name, code, st.Status, st.Error)
	}
	return nil
}

// metaLeader is the JetStream meta leader as the node sees it ("" for none).
func (n *natsNode) metaLeader(ctx context.Context) (string, error) {
	var jsz struct {
		Meta *struct {
			Leader string `json:"leader"`
		} `json:"meta_cluster"`
	}
	if _, err := n.getJSON(ctx, "/jsz", &jsz); err != nil {
		return "", err
	}
	if jsz.Meta == nil {
		return "", nil
	}
	return jsz.Meta.Leader, nil
}

// getJSON GETs path on the node's monitoring port, with a short deadline (a
// stopped node does not answer at all).
func (n *natsNode) getJSON(ctx context.Context, path string, v any) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d%s", n.httpPort, path), nil)
	if err != nil {
		return 0, fmt.Errorf("%s: %s: %w", n.name, path, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, fmt.Errorf("%s: %s: %w", n.name, path, err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return resp.StatusCode, fmt.Errorf("%s: %s: %w", n.name, path, err)
	}
	return resp.StatusCode, nil
}

// streamInfo asks JetStream for the stream's info ($JS.API.STREAM.INFO, with its
// cluster part: leader, replicas, whether each is current) through a connection
// of its own to this node. The stream's leader answers, wherever it runs.
func (n *natsNode) streamInfo(ctx context.Context, stream string) (*jetstream.StreamInfo, error) {
	nc, err := nats.Connect(n.URL(), nats.Name("idem-chaos-cluster-probe"), nats.Timeout(time.Second), nats.NoReconnect())
	if err != nil {
		return nil, fmt.Errorf("%s: connect: %w", n.name, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("%s: jetstream: %w", n.name, err)
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("%s: stream info: %w", n.name, err)
	}
	return s.CachedInfo(), nil
}

// streamInfoVia asks through the first node that is up and not one of skip.
func (c *natsCluster) streamInfoVia(ctx context.Context, stream string, skip ...*natsNode) (*jetstream.StreamInfo, error) {
	var errs []error
	for _, n := range c.nodes {
		if !n.up() || containsNode(skip, n) {
			continue
		}
		si, err := n.streamInfo(ctx, stream)
		if err == nil {
			return si, nil
		}
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		return nil, errors.New("no node up to ask")
	}
	return nil, errors.Join(errs...)
}

func containsNode(ns []*natsNode, n *natsNode) bool {
	for _, m := range ns {
		if m == n {
			return true
		}
	}
	return false
}

// natsURL is what the workers and the checker connect to: the single server, or
// every node of the cluster.
func (r *run) natsURL() string {
	if r.cluster != nil {
		return r.cluster.nats.urls()
	}
	return r.nats.URL()
}

// workersOn lists the worker slots (with their roles) whose running incarnation
// holds an established TCP connection to node n's client port: from /proc, each
// process's socket inodes and the kernel's TCP table. (Linux only; elsewhere it
// finds none.) A worker's NATS client picks one node of --nats-url at random.
func (r *run) workersOn(n *natsNode) []*worker {
	inodes := tcpInodesTo(n.port)
	var on []*worker
	for _, w := range r.workers {
		w.mu.Lock()
		p := w.cur
		w.mu.Unlock()
		if p != nil && !p.exited() && holdsSocket(p.cmd.Process.Pid, inodes) {
			on = append(on, w)
		}
	}
	return on
}

// tcpInodesTo is the socket inodes of the established IPv4 connections whose
// remote port is port.
func tcpInodesTo(port int) map[string]bool {
	inodes := map[string]bool{}
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return inodes
	}
	for _, line := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) < 10 || f[3] != "01" { // 01: ESTABLISHED
			continue
		}
		_, hexPort, ok := strings.Cut(f[2], ":")
		if p, err := strconv.ParseInt(hexPort, 16, 32); ok && err == nil && int(p) == port {
			inodes[f[9]] = true
		}
	}
	return inodes
}

// holdsSocket reports whether process pid has one of inodes open.
func holdsSocket(pid int, inodes map[string]bool) bool {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	fds, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	for _, fd := range fds {
		link, err := os.Readlink(filepath.Join(dir, fd.Name()))
		if err != nil {
			continue
		}
		if ino, ok := strings.CutPrefix(link, "socket:["); ok && inodes[strings.TrimSuffix(ino, "]")] {
			return true
		}
	}
	return false
}
