package runenv_test

import (
	"net/url"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/app/runenv"
	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/internal/testkit/tcpproxy"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// A server that stops answering without closing the socket (SIGSTOP, a partition
// that drops packets) is given up after a few missed pings, so the client fails
// over to another server of the cluster. With nats.go's default keepalive (pings
// every 2 minutes) this test times out.
func TestConnectionGivesUpASilentServer(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	u, err := url.Parse(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := tcpproxy.New(u.Host)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = proxy.Addr()
	t.Cleanup(func() { _ = proxy.Close() })
	disconnected := make(chan struct{}, 1)
	opts := append(runenv.ConnOptions("keepalive-test"), nats.DisconnectErrHandler(func(*nats.Conn, error) {
		select {
		case disconnected <- struct{}{}:
		default:
		}
	}))
	nc, err := nats.Connect(u.String(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)

	proxy.Pause()
	start := time.Now()
	limit := runenv.PingInterval*(runenv.MaxPingsOutstanding+2) + 5*time.Second
	select {
	case <-disconnected:
		t.Logf("silent server given up after %s", time.Since(start).Round(100*time.Millisecond))
	case <-time.After(limit):
		t.Fatalf("still connected to a silent server after %s", limit)
	}
	proxy.Resume()
	testenv.Eventually(t, 30*time.Second, "the connection to come back", nc.IsConnected)
}
