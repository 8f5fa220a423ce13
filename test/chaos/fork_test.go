package chaos

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faults"
)

// A physical copy of the installation's database (a restored base backup, a
// snapshot), taken after its consumers first bound their durables, carries the
// installation's token. The original binds again after the copy; the copy's
// workers, on the same stream with the same consumer names, are refused at start
// (ErrForkedDatabase: the durables record a later epoch than the copy holds), and
// every intent takes effect once, in the original.
func TestChaosRestoredCopy(t *testing.T) {
	t.Parallel()
	f, wrong := restoredCopy(t, false)
	reportPositive(t, f)
	for _, p := range wrong {
		t.Errorf("chaos: %s", p)
	}
}

// The negative control (consumer.ignore-epoch in every worker): the copy binds
// the original's durables and takes a share of their messages, running them in
// its own database; the original's reconciler reads those acks as its own
// consumers' and re-drives what its inbox lacks: effects in both databases,
// doubled > 0.
func TestChaosRestoredCopyNegativeControl(t *testing.T) {
	t.Parallel()
	f, _ := restoredCopy(t, true)
	if f.doubled == 0 {
		t.Errorf("chaos: negative control reported doubled=0 with a restored copy bound to the original's durables: the copy took nothing, or the checker cannot see an effect in both databases")
	}
	if f.lost > 0 {
		t.Errorf("chaos: negative control lost %d deliveries: a copy sharing a durable must double effects here, not lose them", f.lost)
	}
}

// restoredCopy returns the figures and, in the case, what was wrong with the
// copy's refusal.
func restoredCopy(t *testing.T, negative bool) (idFigures, []string) {
	w := newIDWorld(t, "restored-copy", 1, negative, faults.IgnoreEpoch)
	a := w.dbs[0]
	cons := consumersArgs("ledger=id.pay.charge", "notify=id.pay.>")
	r1 := w.slot("a-r1", a, faults.RelayAfterPublish, "--roles", "relay")
	c1 := w.slot("a-c1", a, faults.EffectBeforeCommit, cons...)
	c2 := w.slot("a-c2", a, faults.ConsumerAfterCommit, cons...)
	w.durables = []string{"ledger", "notify"}
	w.startSlots(r1, c1, c2)

	const first, second = 8, 16
	const msg = "id.pay.charge"
	keys := w.produce(a, "pay", 0, first, idPace, msg)
	e := newExpectation()
	e.add("ledger", true, keys, msg)
	e.add("notify", true, keys, msg)
	w.waitSettledBy(e)

	// The copy: the original's workers down (a template copy needs its source
	// idle), the file copy, the original up again, binding anew.
	for _, s := range []*idSlot{r1, c1, c2} {
		s.hold()
	}
	cp, err := w.copyDatabase(w.ctx, databaseName+"_copy")
	if err != nil {
		t.Fatal(err)
	}
	// What the copy holds of the past is the original's; only what it does after
	// the copy counts.
	if _, err := cp.Pool.Exec(w.ctx, `TRUNCATE chaos_effects`); err != nil {
		t.Fatal(err)
	}
	w.dbs = append(w.dbs, cp)
	w.logf("copied %s to %s", a.Name, cp.Name)
	for _, s := range []*idSlot{r1, c1, c2} {
		s.release()
	}
	w.waitUp(r1, c1, c2)

	b1 := w.slot("copy-c1", cp, "", cons...)
	b2 := w.slot("copy-c2", cp, "", cons...)
	b1.oneShot, b2.oneShot = true, true
	b1.run()
	b2.run()
	if negative {
		w.waitUp(b1, b2)
	} else {
		err := w.waitFor(time.Minute, "the copy's workers to exit", func() (bool, string, error) {
			_, e1 := b1.up()
			_, e2 := b2.up()
			return e1 && e2, "still running", nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	w.logf("the copy started: %s", map[bool]string{true: "bound the durables (negative control)", false: "its workers exited"}[negative])
	kill := w.killWhen(w.publishedAtLeast(first, second), c1, c2, r1)
	more := w.produce(a, "pay", first, second, idPace, msg)
	keys = append(keys, more...)
	e.add("ledger", true, more, msg)
	e.add("notify", true, more, msg)
	w.logf("produced %d intents; random fault: %s", len(keys), kill())

	if negative {
		// The copy has taken its share. It stops, and the original's consumers
		// bind again, so that the original's re-drives of what the copy took
		// reach the original's workers.
		w.waitRest()
		b1.kill()
		b2.kill()
		c1.kill()
		c2.kill()
	}
	w.waitSettled(e)

	var wrong []string
	nRefused := 0
	for _, s := range []*idSlot{b1, b2} {
		refusal := w.procs.firstLine("idworker-"+s.name, "bound the durable consumer since")
		s.mu.Lock()
		outcomes := s.outcomes
		s.mu.Unlock()
		switch {
		case negative:
		case len(outcomes) != 1 || outcomes[0] != "exit status 1":
			wrong = append(wrong, fmt.Sprintf("%s of the copy ended %v, want one exit with status 1", s.name, outcomes))
		case !strings.Contains(refusal, "worker installation adopt"):
			wrong = append(wrong, fmt.Sprintf("%s's refusal is not ErrForkedDatabase saying what to do: %q", s.name, refusal))
		default:
			nRefused++
		}
	}
	if nRefused > 0 {
		w.logf("refused: %s", w.procs.firstLine("idworker-copy-c1", "bound the durable consumer since"))
	}
	f := w.check(e, len(keys), func(f *idFigures) {
		var inCopy int
		if err := cp.Pool.QueryRow(w.ctx, `SELECT count(*) FROM chaos_effects`).Scan(&inCopy); err != nil {
			t.Fatal(err)
		}
		f.extra = fmt.Sprintf("refused=%d effects_in_copy=%d %s", nRefused, inCopy, w.proofLine())
		if !negative && inCopy > 0 {
			wrong = append(wrong, fmt.Sprintf("%d effects in the copy's database", inCopy))
		}
	})
	return f, wrong
}
