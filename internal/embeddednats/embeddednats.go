// Package embeddednats runs a real JetStream server inside the process: the worker's
// default when NATS_URL is empty, and the broker of the test suite. It is the
// nats-server code itself, not a stand-in; its store survives restarts on the same
// directory.
package embeddednats

import (
	"errors"
	"fmt"
	"net"
	"strconv"
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
		NoSigs:     true,
		NoLog:      true,
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

// URL is the client URL of the server.
func (s *Server) URL() string {
	return "nats://" + net.JoinHostPort(s.cfg.Host, strconv.Itoa(s.cfg.Port))
}

// Config returns the configuration the server runs with (Port filled in), so a test
// can restart it on the same port and store.
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
