// Package cluster_test runs the reference worker on a three-node JetStream cluster
// (three real nats-server instances in this process, routed to each other) with a
// replicated stream, and stops the stream's leader mid-run: every charge still
// lands exactly once.
package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/refapptest"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// freePort asks the kernel for a port nobody listens on.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// cluster is n JetStream servers routed to each other, on fixed ports so that a
// node restarted on its store comes back where clients and routes expect it.
type cluster struct {
	t       *testing.T
	opts    []*server.Options
	servers []*server.Server
}

// startCluster starts n nodes and returns once JetStream has a meta leader.
func startCluster(t *testing.T, n int) *cluster {
	t.Helper()
	c := &cluster{t: t, opts: make([]*server.Options, n), servers: make([]*server.Server, n)}
	routePorts := make([]int, n)
	for i := range routePorts {
		routePorts[i] = freePort(t)
	}
	var routes []string
	for _, p := range routePorts {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", p))
	}
	for i := range c.opts {
		c.opts[i] = &server.Options{
			ServerName: fmt.Sprintf("n%d", i+1), Host: "127.0.0.1", Port: freePort(t), NoLog: true, NoSigs: true,
			JetStream: true, StoreDir: t.TempDir(),
			Cluster: server.ClusterOpts{Name: "idem-test", Host: "127.0.0.1", Port: routePorts[i]},
			Routes:  server.RoutesFromStr(strings.Join(routes, ",")),
		}
		c.start(i)
	}
	t.Cleanup(func() {
		for _, s := range c.servers {
			if s != nil {
				s.Shutdown()
			}
		}
	})
	c.waitMetaLeader()
	return c
}

// start (re)starts node i on its store.
func (c *cluster) start(i int) {
	c.t.Helper()
	s, err := server.NewServer(c.opts[i])
	if err != nil {
		c.t.Fatal(err)
	}
	go s.Start()
	if !s.ReadyForConnections(20 * time.Second) {
		c.t.Fatalf("%s not ready", s.Name())
	}
	c.servers[i] = s
}

// stop shuts node i down (its store stays).
func (c *cluster) stop(i int) {
	c.servers[i].Shutdown()
	c.servers[i].WaitForShutdown()
}

func (c *cluster) waitMetaLeader() {
	c.t.Helper()
	testenv.Eventually(c.t, 45*time.Second, "a JetStream meta leader", func() bool {
		for _, s := range c.servers {
			if s != nil && s.Running() && s.JetStreamIsLeader() {
				return true
			}
		}
		return false
	})
}

func (c *cluster) urls() string {
	var urls []string
	for _, o := range c.opts {
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", o.Port))
	}
	return strings.Join(urls, ",")
}

// index is the position of the node named name.
func (c *cluster) index(name string) int {
	for i, o := range c.opts {
		if o.ServerName == name {
			return i
		}
	}
	c.t.Fatalf("no node %q", name)
	return -1
}

// streamLeader is the stream's current leader, once it has one that is not
// excluded.
func streamLeader(t *testing.T, js jetstream.JetStream, not string) string {
	t.Helper()
	var leader string
	testenv.Eventually(t, 45*time.Second, "the stream to have a leader other than "+not, func() bool {
		st, err := js.Stream(context.Background(), refapp.StreamName)
		if err != nil {
			return false
		}
		si, err := st.Info(context.Background())
		if err != nil || si.Cluster == nil || si.Cluster.Leader == "" || si.Cluster.Leader == not {
			return false
		}
		leader = si.Cluster.Leader
		return true
	})
	return leader
}

// charger sends charges as a client does: each with its own key, retried with
// that key until accepted, to the ingresses in turn.
type charger struct {
	t     *testing.T
	addrs []string
}

func (c charger) send(i int) string {
	c.t.Helper()
	key := idem.NewKey().String()
	body := fmt.Sprintf(`{"account":"acct_%d","amount_cents":%d}`, i, 100+i)
	deadline := time.Now().Add(60 * time.Second)
	for try := 0; ; try++ {
		addr := c.addrs[(i+try)%len(c.addrs)]
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/v1/payments", bytes.NewBufferString(body))
		req.Header.Set(idem.HeaderKey, key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusAccepted {
				return key
			}
		}
		if time.Now().After(deadline) {
			c.t.Errorf("charge %d not accepted after a minute: %v", i, err)
			return key
		}
		time.Sleep(50 * time.Millisecond) // a client's retry interval
	}
}

// startWorker runs the reference application on db and the whole cluster.
func startWorker(t *testing.T, db *pgtest.DB, c *cluster, cfg refapp.Config) *refapp.Service {
	t.Helper()
	nc, err := nats.Connect(c.urls(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	cfg.HTTPAddr = "127.0.0.1:0"
	cfg.Stream.Replicas = 3
	cfg.Charges.AckWait = 2 * time.Second // a worker's unacked batch comes back soon
	return refapptest.Start(t, db.Pool, nc, cfg)
}

func TestStreamLeaderLossOnAThreeNodeCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a three-node JetStream cluster")
	}
	t.Parallel()
	c := startCluster(t, 3)
	// The worker is given every node, as --nats-url takes them.
	nc, err := nats.Connect(c.urls(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	db := pgtest.New(t)
	cfg := refapp.Config{HTTPAddr: "127.0.0.1:0"}
	cfg.Stream.Replicas = 3
	svc := refapptest.Start(t, db.Pool, nc, cfg)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	info, err := js.Stream(context.Background(), refapp.StreamName)
	if err != nil {
		t.Fatal(err)
	}
	si, err := info.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if si.Config.Replicas != 3 || si.Cluster == nil || len(si.Cluster.Replicas) != 2 {
		t.Fatalf("stream %s: %d replicas, cluster %+v; want R3 on three nodes", refapp.StreamName, si.Config.Replicas, si.Cluster)
	}

	// Charges go in with a client that retries with the same key (as
	// cmd/enqueue does) while the stream's leader is stopped halfway.
	const total = 60
	keys := make([]string, total)
	send := func(i int) {
		t.Helper()
		keys[i] = idem.NewKey().String()
		body := fmt.Sprintf(`{"account":"acct_%d","amount_cents":%d}`, i, 100+i)
		deadline := time.Now().Add(45 * time.Second)
		for {
			req, _ := http.NewRequest(http.MethodPost, "http://"+svc.Addr()+"/v1/payments", bytes.NewBufferString(body))
			req.Header.Set(idem.HeaderKey, keys[i])
			req.Header.Set("Content-Type", "application/json")
			resp, err := http.DefaultClient.Do(req)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusAccepted {
					return
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("charge %d not accepted: %v", i, err)
			}
			time.Sleep(50 * time.Millisecond) // a client's retry interval
		}
	}
	for i := range total / 2 {
		send(i)
	}
	leader := si.Cluster.Leader
	c.stop(c.index(leader)) // the stream's leader dies
	for i := total / 2; i < total; i++ {
		send(i)
	}
	testenv.Eventually(t, 90*time.Second, "every charge in the ledger", func() bool {
		return db.Count(t, `SELECT count(DISTINCT idempotency_key) FROM ledger_entries`) == total
	})
	if n := db.Count(t, `SELECT count(*) FROM ledger_entries`); n != total {
		t.Errorf("ledger rows = %d for %d charges: doubled=%d", n, total, n-total)
	}
	after, err := info.Info(context.Background())
	if err != nil || after.Cluster == nil || after.Cluster.Leader == "" || after.Cluster.Leader == leader {
		t.Fatalf("stream leader after %s stopped: %+v (%v), want another node", leader, after, err)
	}
	t.Logf("cluster: charges=%d stopped_leader=%s new_leader=%s lost=0 doubled=0", total, leader, after.Cluster.Leader)
}

// Three workers (three ingresses, three consumers, two relays) on one database and
// the whole cluster, charges flowing all along, while the cluster is hurt: the
// stream's leader stops and comes back, then every node restarts in turn. Every
// charge lands exactly once.
func TestThreeWorkersThroughLeaderLossAndRollingRestarts(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a three-node JetStream cluster and three workers")
	}
	t.Parallel()
	c := startCluster(t, 3)
	db := pgtest.New(t)
	svcs := []*refapp.Service{
		startWorker(t, db, c, refapp.Config{}),
		startWorker(t, db, c, refapp.Config{}),
		startWorker(t, db, c, refapp.Config{DisableRelay: true}),
	}
	nc, err := nats.Connect(c.urls(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ch := charger{t: t}
	for _, s := range svcs {
		ch.addrs = append(ch.addrs, s.Addr())
	}

	// The load runs until the faults are over, then a little more.
	const minCharges = 150
	var mu sync.Mutex
	var keys []string
	faultsDone := make(chan struct{})
	loadDone := make(chan struct{})
	go func() {
		defer close(loadDone)
		for i := 0; ; i++ {
			select {
			case <-faultsDone:
				mu.Lock()
				n := len(keys)
				mu.Unlock()
				if n >= minCharges {
					return
				}
			default:
			}
			k := ch.send(i)
			mu.Lock()
			keys = append(keys, k)
			mu.Unlock()
		}
	}()
	sent := func() int { mu.Lock(); defer mu.Unlock(); return len(keys) }
	testenv.Eventually(t, 45*time.Second, "charges flowing", func() bool { return sent() >= 20 })

	// 1. The stream's leader stops; another takes over; the old one comes back.
	leader := streamLeader(t, js, "")
	c.stop(c.index(leader))
	next := streamLeader(t, js, leader)
	before := sent()
	testenv.Eventually(t, 60*time.Second, "charges flowing without the old leader", func() bool { return sent() >= before+20 })
	c.start(c.index(leader))
	faults := []string{fmt.Sprintf("stopped stream leader %s, %s took over, %s restarted", leader, next, leader)}

	// 2. Every node restarts in turn, waiting for the cluster to have a meta
	// leader and for charges to flow before the next.
	for i := range c.opts {
		c.stop(i)
		c.waitMetaLeader()
		c.start(i)
		c.waitMetaLeader()
		before := sent()
		testenv.Eventually(t, 60*time.Second, "charges flowing after restarting "+c.opts[i].ServerName, func() bool { return sent() >= before+10 })
		faults = append(faults, "restarted "+c.opts[i].ServerName)
	}
	close(faultsDone)
	<-loadDone

	mu.Lock()
	total := len(keys)
	mu.Unlock()
	testenv.Eventually(t, 120*time.Second, "every charge in the ledger", func() bool {
		return db.Count(t, `SELECT count(DISTINCT idempotency_key) FROM ledger_entries`) == total
	})
	rows := db.Count(t, `SELECT count(*) FROM ledger_entries`)
	if rows != total {
		t.Errorf("ledger rows = %d for %d charges", rows, total)
	}
	folded := db.Count(t, `SELECT count(*) FROM payments`) // one per key: the ingress folds retries
	if folded != total {
		t.Errorf("payments = %d for %d charges", folded, total)
	}
	t.Logf("cluster chaos: workers=3 relays=2 charges=%d faults=%q lost=%d doubled=%d", total, faults,
		total-db.Count(t, `SELECT count(DISTINCT idempotency_key) FROM ledger_entries`), rows-total)
}
