// Package embeddednats runs a real JetStream server inside the process: the worker's
// default when NATS_URL is empty, and the broker of the test suite. It is the
// nats-server code itself, not a stand-in; its store survives restarts on the same
// directory.
//
// The server requires a token, generated at Start unless Config.Token gives one,
// and URL carries it: without one any local user of the machine could publish on
// the stream, delete it, or pull and ack a durable consumer's messages.
package embeddednats

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Config configures an embedded server. The zero value (plus StoreDir) is a server on
// a random loopback port.
type Config struct {
	// StoreDir holds JetStream's files. Required.
	StoreDir string
	// Host defaults to 127.0.0.1.
	Host string
	// Port defaults to a random free port; set it to restart a server on the port its
	// clients already know.
	Port int
	// SyncAlways fsyncs every JetStream write, as production should (the default
	// 2-minute sync interval lets a power loss drop acknowledged messages).
	SyncAlways bool
	// ReadyTimeout bounds the wait for the server to accept connections (default 10s).
	ReadyTimeout time.Duration
	// Token is the credential clients must present (URL carries it). Empty
	// generates one; set it to restart a server with the token its clients know
	// (Config returns it).
	Token string
}

// Server is a running embedded server.
type Server struct {
	*server.Server
	cfg Config
}

// Start starts a JetStream server and waits until it accepts connections.
func Start(cfg Config) (*Server, error) {
	if cfg.StoreDir == "" {
		return nil, errors.New("embeddednats: StoreDir is required")
	}
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	if cfg.ReadyTimeout == 0 {
		cfg.ReadyTimeout = 10 * time.Second
	}
	if cfg.Token == "" {
		var b [24]byte
		if _, err := rand.Read(b[:]); err != nil {
			return nil, fmt.Errorf("embeddednats: generate a token: %w", err)
		}
		cfg.Token = hex.EncodeToString(b[:])
	}
	port := cfg.Port
	if port == 0 {
		p, err := freePort(cfg.Host)
		if err != nil {
			return nil, err
		}
		port = p
	}
	opts := &server.Options{
		ServerName: "idem-embedded",
		Host:       cfg.Host,
		Port:       port,
		JetStream:  true,
		StoreDir:   cfg.StoreDir,
		// Authorization is the token every client must present.
		Authorization: cfg.Token,
		NoSigs:        true,
		NoLog:         true,
	}
	if cfg.SyncAlways {
		opts.SyncAlways = true
	}
	ns, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("embeddednats: new server: %w", err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(cfg.ReadyTimeout) {
		ns.Shutdown()
		return nil, fmt.Errorf("embeddednats: server on %s:%d not ready after %s", cfg.Host, port, cfg.ReadyTimeout)
	}
	cfg.Port = port
	return &Server{Server: ns, cfg: cfg}, nil
}

// URL is the client URL of the server, token included (nats.Connect takes a URL's
// user part without a password as the token). Treat it as a secret; Redact shows
// it without the token.
func (s *Server) URL() string {
	u := url.URL{Scheme: "nats", User: url.User(s.cfg.Token), Host: net.JoinHostPort(s.cfg.Host, strconv.Itoa(s.cfg.Port))}
	return u.String()
}

// Redact returns a NATS URL (or a comma-separated list of them, as nats.Connect
// takes) without credentials, for logs and messages.
func Redact(natsURL string) string {
	parts := strings.Split(natsURL, ",")
	for i, p := range parts {
		u, err := url.Parse(strings.TrimSpace(p))
		if err != nil {
			parts[i] = "(unparseable URL)"
			continue
		}
		u.User = nil
		parts[i] = u.String()
	}
	return strings.Join(parts, ",")
}

// Config returns the configuration the server runs with (Port and Token filled
// in), so a test can restart it on the same port and store with the same token.
func (s *Server) Config() Config { return s.cfg }

// Stop shuts the server down and waits for it to finish.
func (s *Server) Stop() {
	s.Shutdown()
	s.WaitForShutdown()
}

func freePort(host string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, fmt.Errorf("embeddednats: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
