package worker

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/relay"
)

// LiveHandler answers 200 while the process can answer at all: for a liveness probe
// that restarts a wedged process, not one that waits for dependencies. Its body is
// "ok" and then the detail an operator wants at a glance, one line each: the NATS
// connection's state (and for how long it has been away), and for a worker with an
// ingress what readiness leaves out of its answer because the ingress does not need
// it (a missing stream or durable consumer). Like ReadyHandler it names
// dependencies, never a driver's error.
func (w *Worker) LiveHandler() http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		rw.Header().Set("Content-Type", "text/plain; charset=utf-8")
		lines := append([]string{"ok", w.brokerLine()}, w.brokerProblems()...)
		if w.ingress == nil {
			lines = lines[:2] // readiness reports them
		} else if problem := w.slotHealth(r.Context()); problem != "" {
			lines = append(lines, problem)
		}
		_, _ = fmt.Fprintln(rw, strings.Join(lines, "\n"))
	})
}

// ReadyHandler answers 200 while the process can take its traffic (see Ready), 503
// otherwise, with one line per problem that names the dependency but never echoes
// a driver's error (which would show user, host and database to whoever can reach
// the port); the errors are logged.
func (w *Worker) ReadyHandler() http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		problems := w.Ready(r.Context())
		rw.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if len(problems) > 0 {
			rw.WriteHeader(http.StatusServiceUnavailable)
			_, _ = fmt.Fprintln(rw, strings.Join(problems, "\n"))
			return
		}
		_, _ = rw.Write([]byte("ready\n"))
	})
}

// Ready returns what keeps the worker from taking its traffic, or nil. Readiness
// follows the roles the worker runs:
//
//   - Every worker: started, no component failed (a NATS connection closed for
//     good is one), Postgres answering, the lifetime invariant holding for the
//     stream's current MaxAge and every registered consumer.
//   - A worker with an ingress takes HTTP requests, and a request needs Postgres
//     only: its intent waits in the outbox while the broker is away. So it stays
//     ready through a broker outage, which is the outage the outbox exists to
//     absorb; LiveHandler, the metrics and the log show the broker's state.
//   - A worker without an ingress (consumers, relay) works on the broker: it is
//     ready only while NATS is connected and the stream and every durable
//     consumer exist (or were recreated), and, where it runs the log relay, while
//     the slot is neither lost nor holding more WAL than RelayConfig.MaxSlotLag
//     (for a worker with an ingress, LiveHandler says so).
func (w *Worker) Ready(ctx context.Context) []string {
	var problems []string
	w.mu.Lock()
	started, failed := w.started, w.err
	w.mu.Unlock()
	switch {
	case !started:
		problems = append(problems, "worker: not started")
	case failed != nil:
		problems = append(problems, "worker: a component failed (see the log)")
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := w.pool.Ping(ctx); err != nil {
		w.log.WarnContext(ctx, "readiness: postgres does not answer", "err", err)
		problems = append(problems, "postgres: not answering")
	}
	// A broken lifetime invariant names itself: no driver error in it, only the
	// names and numbers the operators configured.
	if err := w.keeper.Health(); err != nil {
		problems = append(problems, err.Error())
	}
	if w.ingress == nil {
		// The relay's own readiness: a slot lost, or past its lag bound. An ingress
		// stays ready (the slot's lag grows with a broker outage too, which the
		// outbox absorbs); LiveHandler and the metrics show it.
		if problem := w.slotHealth(ctx); problem != "" {
			problems = append(problems, problem)
		}
		if st, _ := w.broker.state(); st != nats.CONNECTED {
			problems = append(problems, w.brokerLine())
		}
		problems = append(problems, w.brokerProblems()...)
	}
	return problems
}

// brokerLine is the NATS connection's state, for /healthz and /readyz.
func (w *Worker) brokerLine() string {
	st, away := w.broker.state()
	line := "nats: " + strings.ToLower(st.String())
	if away > 0 {
		line += fmt.Sprintf(" (away for %s)", away.Round(time.Second))
	}
	return line
}

// brokerProblems are what keeps the broker's side of the worker from working while
// it is connected: a stream that is missing and could not be recreated, a durable
// consumer likewise. While it is not connected they cannot be known.
func (w *Worker) brokerProblems() []string {
	if st, _ := w.broker.state(); st != nats.CONNECTED {
		return nil
	}
	var problems []string
	if err := w.keeper.StreamHealth(); err != nil {
		problems = append(problems, err.Error())
	}
	for _, c := range w.consumers {
		if err := c.Health(); err != nil {
			problems = append(problems, fmt.Sprintf("consumer %s: its durable consumer on stream %s is missing and cannot be recreated", c.Config().Name, w.inst.Stream().Name))
		}
	}
	return problems
}

// slotHealth is what keeps a worker running the log relay from being ready: its
// slot lost, or holding more WAL than RelayConfig.MaxSlotLag (the relays are that
// far behind the outbox).
func (w *Worker) slotHealth(ctx context.Context) string {
	if w.logRelay == nil {
		return ""
	}
	r, err := relay.ReadState(ctx, w.pool, parts.Of(w.inst).Store, w.inst.Schema())
	switch {
	case err != nil:
		w.log.WarnContext(ctx, "readiness: reading the relay's slot failed", "err", err)
		return "relay: its slot cannot be read"
	case r.Mode != relay.ModeLog:
		return ""
	case r.SlotLost:
		return fmt.Sprintf("relay: slot %s lost WAL it needed (max_slot_wal_keep_size)", r.Slot)
	case r.SlotLagBytes > w.cfg.Relay.MaxSlotLag:
		return fmt.Sprintf("relay: slot %s holds %d bytes of WAL, more than Relay.MaxSlotLag %d: the log relay is behind", r.Slot, r.SlotLagBytes, w.cfg.Relay.MaxSlotLag)
	}
	return ""
}
