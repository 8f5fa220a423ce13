package chaos

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faults"
)

// A NATS server away for longer than the workers' reconnect budget: every worker's
// connection closes for good. Each worker must end (and its supervisor start one
// that connects anew once the broker is back), never run on unready, publishing
// nothing. See README.md, "A broker away for longer than the reconnect budget".

// awayBudget is the workers' reconnect budget: 5 attempts 200 ms apart (plus
// nats.go's jitter), about a second and a half, where nats.Connect's default is
// 60 attempts 2 s apart.
var awayBudget = []string{"--nats-max-reconnects", "5", "--nats-reconnect-wait", "200ms"}

// A relay and two consumer workers, 12 intents with the broker up, the broker
// killed and kept away until every worker's connection has closed, 12 intents
// into the outbox meanwhile, the broker back: every worker ended on its closed
// connection and its successor took the work; every intent takes effect once.
func TestChaosBrokerAway(t *testing.T) {
	t.Parallel()
	f, wrong := brokerAway(t, false)
	reportPositive(t, f)
	for _, p := range wrong {
		t.Errorf("chaos: %s", p)
	}
}

// The negative control (worker.ignore-closed-connection in every worker, the old
// behaviour): the workers run on their closed connections, never end, and never
// publish what the outage left in the outbox, although the broker is back: lost > 0.
func TestChaosBrokerAwayNegativeControl(t *testing.T) {
	t.Parallel()
	f, wrong := brokerAway(t, true)
	if f.lost == 0 {
		t.Errorf("chaos: negative control reported lost=0 with workers left on closed connections: the broker was not away long enough, or the checker cannot see a loss")
	}
	if f.doubled > 0 || f.stray > 0 {
		t.Errorf("chaos: negative control doubled %d and strayed %d: a closed connection must lose intents here, not double them", f.doubled, f.stray)
	}
	for _, p := range wrong {
		t.Errorf("chaos: %s", p)
	}
}

// brokerAway returns the figures and what was wrong with how the workers took the
// outage: in the case, a worker that did not end on its closed connection; in the
// negative control, one that ended, or a relay that published nothing because it
// never tried.
func brokerAway(t *testing.T, negative bool) (idFigures, []string) {
	w := newIDWorld(t, "broker-away", 1, negative, faults.IgnoreClosedConnection)
	db := w.dbs[0]
	const msg = "id.pay.charge"
	cons := append(consumersArgs("ledger="+msg), awayBudget...)
	// No fault points: one that fired late would restart its slot while the
	// broker is away, and the successor, connecting anew once the broker is back,
	// would hide what the case is about. The kill below happens before the outage.
	r1 := w.slot("r1", db, "", append([]string{"--roles", "relay"}, awayBudget...)...)
	c1 := w.slot("c1", db, "", cons...)
	c2 := w.slot("c2", db, "", cons...)
	slots := []*idSlot{r1, c1, c2}
	w.durables = []string{"ledger"}
	w.startSlots(slots...)

	const before, during = 12, 12
	kill := w.killWhen(w.publishedAtLeast(0, before), c1, c2, r1)
	keys := w.produce(db, "pay", 0, before, idPace, msg)
	w.logf("produced %d intents with the broker up; random fault: %s", len(keys), kill())
	w.waitUp(slots...)

	// The outage: from here, each slot's log and its incarnations' outcomes.
	marks := map[*idSlot]int64{}
	ended := map[*idSlot]int{}
	for _, s := range slots {
		marks[s] = s.logSize()
		s.mu.Lock()
		ended[s] = len(s.outcomes)
		s.mu.Unlock()
	}
	w.nats.down()
	w.count("nats-away")
	downAt := time.Now()
	err := w.waitFor(idSettle, "every worker's NATS connection to close for good", func() (bool, string, error) {
		var open []string
		for _, s := range slots {
			if !strings.Contains(s.logSince(marks[s]), "closed for good") {
				open = append(open, s.name)
			}
		}
		return len(open) == 0, "still reconnecting: " + strings.Join(open, ","), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	w.logf("every worker's connection closed %s after the broker went away", time.Since(downAt).Round(time.Millisecond))
	keys = append(keys, w.produce(db, "pay", before, during, idPace, msg)...)
	restartMark := r1.logSize()
	if err := w.nats.start(); err != nil {
		t.Fatal(err)
	}
	w.logf("produced %d intents into the outbox while the broker was away; broker back after %s", during, time.Since(downAt).Round(time.Millisecond))

	e := newExpectation()
	e.add("ledger", true, keys, msg)
	var wrong []string
	if negative {
		// The relay tries the rows the outage left, on its closed connection, and
		// fails (the polling relay's batch, the log relay's session): the moment to
		// count, for it would fail for ever.
		err := w.waitFor(idSettle, "the relay to fail a publish with the broker back", func() (bool, string, error) {
			return relayFailedOnClosed(r1.logSince(restartMark)), "no failed publish yet", nil
		})
		if err != nil {
			wrong = append(wrong, err.Error())
		}
	} else {
		w.waitSettled(e)
	}

	_, unpublished, _, err := w.outboxState()
	if err != nil {
		t.Fatal(err)
	}
	var endedOnClose []string
	for _, s := range slots {
		s.mu.Lock()
		after := s.outcomes[ended[s]:]
		s.mu.Unlock()
		closedExit := strings.Contains(s.logSince(marks[s]), "idworker: worker: nats: the connection to the broker closed for good")
		switch {
		case negative && len(after) > 0:
			wrong = append(wrong, fmt.Sprintf("%s ended %v on its closed connection with the switch on", s.name, after))
		case !negative && (len(after) == 0 || after[0] != "exit status 1" || !closedExit):
			wrong = append(wrong, fmt.Sprintf("%s did not end on its closed connection: incarnations since the outage ended %v, exit naming it %v", s.name, after, closedExit))
		case !negative:
			endedOnClose = append(endedOnClose, s.name)
		}
	}
	if negative && unpublished == 0 {
		wrong = append(wrong, "every outbox row was published: the relay on a closed connection published after all")
	}
	f := w.check(e, len(keys), func(f *idFigures) {
		f.extra = fmt.Sprintf("ended_on_closed_connection=%d unpublished=%d %s", len(endedOnClose), unpublished, w.proofLine())
	})
	return f, wrong
}

// relayFailedOnClosed reports whether log holds a relay's line (either relay's)
// that failed on a closed NATS connection.
func relayFailedOnClosed(log string) bool {
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "component=relay") && strings.Contains(line, "connection closed") {
			return true
		}
	}
	return false
}

// logSize is the size of the slot's log now, a mark for logSince.
func (s *idSlot) logSize() int64 {
	st, err := s.log.Stat()
	if err != nil {
		return 0
	}
	return st.Size()
}

// logSince is what the slot's processes wrote to its log after mark.
func (s *idSlot) logSince(mark int64) string {
	b, err := os.ReadFile(s.log.Name())
	if err != nil || int64(len(b)) < mark {
		return ""
	}
	return string(b[mark:])
}
