package chaos

import (
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/idemkit/idem/internal/faults"
)

// The hard stop during an external effect. One worker runs the external consumer
// mail, whose effect (a row written outside the inbox, on a connection of its own)
// takes 1.5s and, like an SMTP DATA already sent, completes even when cancelled.
// While an effect is in flight the worker gets SIGTERM with a 300ms shutdown
// timeout: Stop cancels the work context at 300ms, the effect completes anyway,
// and its record must not be thrown away with the context; the worker exits and
// its supervisor starts a successor. Every intent is mailed once.
func TestChaosHardStopDuringEffect(t *testing.T) {
	t.Parallel()
	f, cancelled := hardStopDuringEffect(t, false)
	reportPositive(t, f)
	if cancelled == 0 {
		t.Errorf("chaos: no effect completed after its context was cancelled: the hard stop did not land during an effect, so the case proves nothing")
	}
}

// The negative control (consumer.record-on-work-context): the record runs on the
// cancelled work context and fails; once the lease expires the successor performs
// the effect again: doubled > 0.
func TestChaosHardStopDuringEffectNegativeControl(t *testing.T) {
	t.Parallel()
	f, _ := hardStopDuringEffect(t, true)
	if f.doubled == 0 {
		t.Errorf("chaos: negative control reported doubled=0 with the record on the cancelled work context: the stop did not land during an effect, or the checker cannot see a double")
	}
	if f.lost > 0 {
		t.Errorf("chaos: negative control lost %d deliveries: an unrecorded effect must be performed again, not lost", f.lost)
	}
}

func hardStopDuringEffect(t *testing.T, negative bool) (idFigures, int) {
	w := newIDWorld(t, "hard-stop-during-effect", 1, negative, faults.RecordOnWorkContext)
	db := w.dbs[0]
	const msg = "id.mail.send"
	r1 := w.slot("r1", db, "", "--roles", "relay")
	m1 := w.slot("mail", db, "", append(consumersArgs("mail="+msg),
		"--external", "1500ms", "--lease-for", "4s", "--shutdown-timeout", "300ms")...)
	w.durables = []string{"mail"}
	w.startSlots(r1, m1)

	const n, stops = 6, 2
	all := w.produce(db, "mail", 0, n, idPace, msg)
	w.logf("produced %d intents", len(all))
	for i := range stops {
		w.waitCount(fmt.Sprintf("an effect in flight (hard stop %d)", i+1), 1,
			`SELECT least(count(*), 1) FROM idem_inbox WHERE consumer = 'mail' AND status = 'leased'`)
		m1.term()
		w.logf("hard stop %d: SIGTERM to mail with an effect in flight", i+1)
		w.waitUp(m1)
	}

	e := newExpectation()
	e.add("mail", true, all, msg)
	if negative {
		w.waitRest()
	} else {
		w.waitSettled(e)
	}
	cancelled := m1.logCount("external effect performed", "cancelled=true")
	f := w.check(e, len(all), func(f *idFigures) {
		f.extra = fmt.Sprintf("hard_stops=%d performed_after_cancel=%d %s", stops, cancelled, w.proofLine())
	})
	return f, cancelled
}

// term sends the slot's current incarnation SIGTERM, a graceful stop with the
// worker's shutdown timeout, and waits for it to exit; the supervisor starts the
// next one.
func (s *idSlot) term() {
	s.mu.Lock()
	p := s.cur
	s.mu.Unlock()
	if p == nil || p.exited() {
		s.w.t.Fatalf("chaos: %s: no process to stop", s.name)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		s.w.t.Fatalf("chaos: SIGTERM %s: %v", s.name, err)
	}
	<-p.done
	s.w.count("sigterm")
}

// logCount counts the lines of the slot's log, over every incarnation, that hold
// every one of parts.
func (s *idSlot) logCount(parts ...string) int {
	b, err := os.ReadFile(s.log.Name())
	if err != nil {
		s.w.t.Fatalf("chaos: read %s's log: %v", s.name, err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			n++
		}
	}
	return n
}
