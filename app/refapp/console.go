package refapp

import (
	"fmt"
	"net"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/app/console"
	"github.com/idemkit/idem/deadletter"
	"github.com/idemkit/idem/internal/ops"
	"github.com/idemkit/idem/worker"
)

// ConsolePath is where the operator console is served: part of the public
// contract.
const ConsolePath = "/console"

// newConsole is the operator console of the application: ops with the
// application's effects (payments, emails, ledger rows) and totals, the dead
// letters, the stream and the worker's counters.
func newConsole(pool *pgxpool.Pool, w *worker.Worker, reg *prometheus.Registry, cfg Config, addr net.Addr) (http.Handler, error) {
	if !loopback(addr) {
		if cfg.Console.Token == "" && cfg.Console.BasicUser == "" {
			return nil, fmt.Errorf("refapp: console: %s is not a loopback address: set a console token or basic auth to serve the console there", addr)
		}
		if !cfg.Console.AllowPlainHTTP {
			return nil, fmt.Errorf("refapp: console: %s is not a loopback address, and the console's token or password would cross the network in plain HTTP (the worker serves no TLS): "+
				"serve the console on loopback (--metrics-addr 127.0.0.1:PORT) and reach it through an SSH tunnel or a TLS-terminating proxy on the same host; "+
				"or, when such a proxy or a network you trust is the only way to %s, allow it with --console-allow-plain-http (IDEM_CONSOLE_ALLOW_PLAIN_HTTP)", addr, addr)
		}
	}
	r, err := ops.New(pool, ops.Config{Schema: cfg.Schema, Effects: InspectEffects, Counts: Counts})
	if err != nil {
		return nil, fmt.Errorf("refapp: console: %w", err)
	}
	dls := deadletter.New(w.Installation())
	h, err := console.New(console.Config{
		Ops: r, DeadLetters: dls, JetStream: w.Installation().JetStream(), Stream: StreamName, Lag: ops.LagOf(w), Metrics: reg,
		Logger: cfg.Logger, Prefix: ConsolePath,
		Token: cfg.Console.Token, BasicUser: cfg.Console.BasicUser, BasicPassword: cfg.Console.BasicPassword,
	})
	if err != nil {
		return nil, fmt.Errorf("refapp: %w", err)
	}
	return h, nil
}

func mountConsole(mux *http.ServeMux, h http.Handler) {
	if h == nil {
		return
	}
	mux.Handle(ConsolePath, h)
	mux.Handle(ConsolePath+"/", h)
}

// loopback reports whether addr only accepts local connections.
func loopback(addr net.Addr) bool {
	tcp, ok := addr.(*net.TCPAddr)
	return ok && tcp.IP.IsLoopback()
}
