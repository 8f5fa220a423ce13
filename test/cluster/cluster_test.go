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
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/refapp"
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

// startCluster starts n JetStream servers routed to each other and returns them
// once JetStream has a meta leader.
func startCluster(t *testing.T, n int) []*server.Server {
	t.Helper()
	ports := make([]int, n)
	for i := range ports {
		ports[i] = freePort(t)
	}
	var routes []string
	for _, p := range ports {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", p))
	}
	servers := make([]*server.Server, n)
	for i := range servers {
		opts := &server.Options{
			ServerName: fmt.Sprintf("n%d", i+1), Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true,
			JetStream: true, StoreDir: t.TempDir(),
			Cluster: server.ClusterOpts{Name: "idem-test", Host: "127.0.0.1", Port: ports[i]},
			Routes:  server.RoutesFromStr(strings.Join(routes, ",")),
		}
		s, err := server.NewServer(opts)
		if err != nil {
			t.Fatal(err)
		}
		go s.Start()
		t.Cleanup(s.Shutdown)
		servers[i] = s
	}
	for _, s := range servers {
		if !s.ReadyForConnections(20 * time.Second) {
			t.Fatalf("%s not ready", s.Name())
		}
	}
	testenv.Eventually(t, 45*time.Second, "a JetStream meta leader", func() bool {
		for _, s := range servers {
			if s.JetStreamIsLeader() {
				return true
			}
		}
		return false
	})
	return servers
}

func TestStreamLeaderLossOnAThreeNodeCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a three-node JetStream cluster")
	}
	t.Parallel()
	servers := startCluster(t, 3)
	var urls []string
	for _, s := range servers {
		urls = append(urls, s.ClientURL())
	}
	// The worker is given every node, as --nats-url takes them.
	nc, err := nats.Connect(strings.Join(urls, ","), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	db := pgtest.New(t)
	cfg := refapp.Config{HTTPAddr: "127.0.0.1:0"}
	cfg.Stream.Replicas = 3
	svc, err := refapp.Start(context.Background(), db.Pool, nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = svc.Shutdown(ctx)
	})
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
	for _, s := range servers {
		if s.Name() == leader {
			s.Shutdown() // the stream's leader dies
		}
	}
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
