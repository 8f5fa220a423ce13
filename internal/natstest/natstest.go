// Package natstest starts a real, embedded JetStream server for one test.
package natstest

import (
	"testing"

	"github.com/idemkit/idem/internal/embeddednats"
)

// Start runs a JetStream server with its store in t.TempDir() and stops it at cleanup.
func Start(t testing.TB) *embeddednats.Server {
	t.Helper()
	s, err := embeddednats.Start(embeddednats.Config{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatalf("natstest: %v", err)
	}
	t.Cleanup(s.Stop)
	return s
}

// Restart stops s and starts a server on the same port and store, as after a crash
// of the broker (JetStream's files are what survives).
func Restart(t testing.TB, s *embeddednats.Server) *embeddednats.Server {
	t.Helper()
	cfg := s.Config()
	s.Stop()
	ns, err := embeddednats.Start(cfg)
	if err != nil {
		t.Fatalf("natstest: restart: %v", err)
	}
	t.Cleanup(ns.Stop)
	return ns
}
