package worker

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/internal/relay"
)

// LiveHandler answers 200 while the process can answer at all: for a liveness probe
// that restarts a wedged process, not one that waits for dependencies.
func (w *Worker) LiveHandler() http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = rw.Write([]byte("ok\n"))
	})
}

// ReadyHandler answers 200 only while the worker can do its work: started, no
// component failed, Postgres answering, NATS connected, the stream and every
// durable consumer present (or recreated), and the lifetime invariant holding for
// the stream's current MaxAge and every registered consumer. Otherwise 503, with one line
// per problem that names the dependency but never echoes a driver's error (which
// would show user, host and database to whoever can reach the port); the errors
// are logged.
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

// Ready returns what keeps the worker from being ready, or nil.
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
	if st := w.js.Conn().Status(); st != nats.CONNECTED {
		problems = append(problems, "nats: "+strings.ToLower(st.String()))
	} else {
		// A missing stream or durable consumer, or a broken lifetime invariant,
		// names itself: no driver error in these, only the names and numbers the
		// operators configured.
		if err := w.keeper.Health(); err != nil {
			problems = append(problems, err.Error())
		}
		if problem := w.slotHealth(ctx); problem != "" {
			problems = append(problems, problem)
		}
		for _, c := range w.consumers {
			if err := c.Health(); err != nil {
				problems = append(problems, fmt.Sprintf("consumer %s: its durable consumer on stream %s is missing and cannot be recreated", c.Config().Name, w.inst.Stream().Name))
			}
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
	r, err := relay.ReadState(ctx, w.pool, w.inst.Store(), w.inst.Schema())
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
