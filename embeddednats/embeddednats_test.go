package embeddednats

import (
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// The server requires a credential, which URL carries. Without it any local
// user could publish, delete the stream or pull and ack a durable's messages.
func TestClientWithoutTheCredentialIsRefused(t *testing.T) {
	t.Parallel()
	s, err := Start(Config{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	cfg := s.Config()
	bare := "nats://" + net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.Port))
	if nc, err := nats.Connect(bare, nats.NoReconnect(), nats.Timeout(3*time.Second)); err == nil {
		nc.Close()
		t.Fatalf("connected to %s without a credential", bare)
	} else if !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Fatalf("connect without a credential: %v; want an authorization error", err)
	}
	if nc, err := nats.Connect(strings.Replace(s.URL(), "://", "://x", 1), nats.NoReconnect(), nats.Timeout(3*time.Second)); err == nil {
		nc.Close()
		t.Fatal("connected with a wrong credential")
	}

	nc, err := nats.Connect(s.URL(), nats.NoReconnect())
	if err != nil {
		t.Fatalf("connect with URL(): %v", err)
	}
	nc.Close()
	if s.URL() == bare {
		t.Fatalf("URL() %q carries no credential", s.URL())
	}

	// A restart on the same configuration keeps the credential its clients know.
	s.Stop()
	s2, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s2.Stop)
	if s2.URL() != s.URL() {
		t.Errorf("restart URL %q, want %q", s2.URL(), s.URL())
	}
	nc, err = nats.Connect(s.URL(), nats.NoReconnect())
	if err != nil {
		t.Fatalf("connect after restart: %v", err)
	}
	nc.Close()
}
