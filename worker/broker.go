package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/internal/faults"
)

// brokerPoll is how often the broker watch reads the connection's status besides
// the changes nats.go announces: a change it announced while the watch's buffer
// was full is not missed for longer.
const brokerPoll = time.Second

// brokerWatch follows the installation's NATS connection. It logs each disconnect
// and reconnect (nats.go logs nothing by itself), keeps the connection's state for
// readiness, /healthz and the metrics, and ends the worker when the connection
// closes for good: a closed *nats.Conn never reconnects, so a worker left on it
// would run unready forever while its ingress took intents that no relay
// publishes. Ended, it exits non-zero and its supervisor starts a new process,
// which connects anew.
type brokerWatch struct {
	nc  *nats.Conn
	log *slog.Logger

	mu        sync.Mutex
	status    nats.Status // as last seen
	since     time.Time   // when the connection last left CONNECTED; zero while connected
	lastError string      // the error it was lost with, for the log
}

func newBrokerWatch(nc *nats.Conn, log *slog.Logger) *brokerWatch {
	return &brokerWatch{nc: nc, log: log, status: nats.CONNECTED}
}

// errConnectionClosed is the failure of a connection that closed for good.
var errConnectionClosed = errors.New("the connection to the broker closed for good, and a closed connection never reconnects")

func (b *brokerWatch) run(ctx context.Context) error {
	changes := b.nc.StatusChanged()
	defer b.nc.RemoveStatusListener(changes)
	t := time.NewTicker(brokerPoll)
	defer t.Stop()
	status := b.nc.Status() // whatever happened before the listener was there
	for {
		if closed := b.observe(ctx, status); closed {
			if faults.From(ctx).On(faults.IgnoreClosedConnection) {
				b.log.WarnContext(ctx, "worker: fault switch on: running on a closed NATS connection", "switch", faults.IgnoreClosedConnection)
				<-ctx.Done()
				return nil
			}
			return b.closedError()
		}
		select {
		case <-ctx.Done():
			return nil
		case status = <-changes:
		case <-t.C:
			status = b.nc.Status()
		}
	}
}

// observe records status and logs the change it makes; it reports whether the
// connection is closed.
func (b *brokerWatch) observe(ctx context.Context, status nats.Status) (closed bool) {
	b.mu.Lock()
	prev := b.status
	b.status = status
	since := b.since
	switch {
	case status == prev:
	case status == nats.CONNECTED:
		b.since = time.Time{}
	case prev == nats.CONNECTED:
		b.since = time.Now()
		if err := b.nc.LastError(); err != nil {
			b.lastError = err.Error()
		}
	}
	lastError := b.lastError
	b.mu.Unlock()
	if status == prev {
		return status == nats.CLOSED
	}
	switch status {
	case nats.RECONNECTING, nats.DISCONNECTED:
		if prev == nats.CONNECTED {
			b.log.WarnContext(ctx, "nats: disconnected from the broker; reconnecting (the relay and the consumers wait, an ingress keeps taking intents into the outbox)",
				"status", strings.ToLower(status.String()), "err", lastError)
		}
	case nats.CONNECTED:
		if !since.IsZero() {
			b.log.InfoContext(ctx, "nats: reconnected to the broker", "server", b.nc.ConnectedUrlRedacted(),
				"away", time.Since(since).Round(time.Millisecond), "reconnects", b.nc.Stats().Reconnects)
		}
	case nats.CLOSED:
		b.log.ErrorContext(ctx, "nats: the connection to the broker closed for good (its reconnect attempts ran out, or it was closed); ending the worker",
			"err", lastError, "fix", "connect with nats.MaxReconnects(-1) to reconnect for as long as the broker is away")
	}
	return status == nats.CLOSED
}

func (b *brokerWatch) closedError() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	cause := ""
	if b.lastError != "" {
		cause = " (last error: " + b.lastError + ")"
	}
	return fmt.Errorf("%w%s: restart the process; connect with nats.MaxReconnects(-1) to reconnect for as long as the broker is away", errConnectionClosed, cause)
}

// state is the connection's status now, and how long it has been away from
// CONNECTED as far as the watch has seen (0 while connected).
func (b *brokerWatch) state() (status nats.Status, away time.Duration) {
	status = b.nc.Status()
	b.mu.Lock()
	since := b.since
	b.mu.Unlock()
	if status != nats.CONNECTED && !since.IsZero() {
		away = time.Since(since)
	}
	return status, away
}
