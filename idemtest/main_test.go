package idemtest_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/idemkit/idem/internal/testkit/natstest"
)

// servers are the JetStream servers newServer started, stopped when the tests end.
var servers []*natstest.Server

// newServer starts a JetStream server for one Example and returns its URL; a
// user's test would start one with github.com/idemkit/idem/embeddednats. Every
// Example takes a server of its own, as every Env should: the streams one leaves
// behind would be another's.
func newServer() string {
	srv, err := natstest.Run(natstest.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	servers = append(servers, srv)
	return srv.URL()
}

func TestMain(m *testing.M) {
	code := m.Run()
	for _, s := range servers {
		s.Close()
	}
	os.Exit(code)
}
