package chaos

import (
	"fmt"
	"testing"

	"github.com/idemkit/idem/internal/faults"
)

// A key lifetime raised between deploys. charges settles every intent under a
// 30h lifetime while audit, which reads the same subject, is down; charges is then
// redeployed with 400h. 31 hours later its inbox has expired the keys, by the 30h
// they were settled under, and the stream has lost the messages. The reconciler
// judges the intents by the lifetime each settlement was written under: a copy
// kept for the stream's MaxAge could outlive it, so it alerts them (a dead letter
// for each consumer it cannot prove) and re-drives nothing. charges forgets its
// keys and comes back: every intent is charged once.
func TestChaosLifetimeRaised(t *testing.T) {
	t.Parallel()
	f, n := lifetimeRaised(t, false)
	reportPositive(t, f)
	if f.deadLetters != 2*n {
		t.Errorf("chaos: %d dead letters, want %d: one alert per intent for each of charges and audit", f.deadLetters, 2*n)
	}
}

// The negative control (reconcile.registered-lifetime): the reconciler judges by
// the 400h registered today, re-drives the intents to charges and audit, and
// charges, having forgotten the keys, runs them again: doubled > 0.
func TestChaosLifetimeRaisedNegativeControl(t *testing.T) {
	t.Parallel()
	f, _ := lifetimeRaised(t, true)
	if f.doubled == 0 {
		t.Errorf("chaos: negative control reported doubled=0 with horizons from the raised lifetime: the re-drives did not reach charges, or the checker cannot see a double")
	}
	if f.lost > 0 {
		t.Errorf("chaos: negative control lost %d deliveries: re-drives must double effects, not lose them", f.lost)
	}
}

func lifetimeRaised(t *testing.T, negative bool) (idFigures, int) {
	w := newIDWorld(t, "lifetime-raised", 1, negative, faults.RegisteredLifetime)
	db := w.dbs[0]
	const msg = "id.pay.charge"
	lifetime := func(d string, specs ...string) []string { return append(consumersArgs(specs...), "--key-lifetime", d) }
	r1 := w.slot("r1", db, faults.RelayAfterPublish, "--roles", "relay")
	c1 := w.slot("charges1", db, faults.EffectBeforeCommit, lifetime("30h", "charges="+msg)...)
	c2 := w.slot("charges2", db, faults.ConsumerAfterCommit, lifetime("30h", "charges="+msg)...)
	a1 := w.slot("audit", db, "", lifetime("72h", "audit=id.pay.>")...)
	w.durables = []string{"charges", "audit"}
	w.startSlots(r1, c1, c2, a1)
	a1.hold() // audit is down: every intent waits for it

	const n = 16
	kill := w.killWhen(w.publishedAtLeast(0, n), c1, c2)
	all := w.produce(db, "pay", 0, n, idPace, msg)
	w.logf("produced %d intents; random fault: %s", len(all), kill())
	settled := newExpectation()
	settled.add("charges", true, all, msg)
	w.durables = []string{"charges"}
	w.waitSettledBy(settled)

	// The redeploy: charges comes back with a 400h lifetime, and registers it.
	c1.hold()
	c2.hold()
	d1 := w.slot("charges-400h", db, faults.EffectBeforeCommit, lifetime("400h", "charges="+msg)...)
	w.startSlots(d1)
	w.waitCount("charges to register its raised lifetime", 1, `SELECT count(*) FROM idem_consumers WHERE name = 'charges' AND key_lifetime = '400 hours'`)
	d1.hold()

	// 31 hours pass: the intents are that old, charges's inbox has expired their
	// keys (30h), and the stream has lost them.
	w.exec(`UPDATE idem_outbox SET created_at = now() - interval '31 hours' WHERE key = ANY($1)`, all)
	w.exec(`UPDATE idem_inbox SET expires_at = now() - interval '1 hour' WHERE consumer = 'charges'`)
	w.loseMessages(w.seqsOf(`key = ANY($1)`, all))
	w.waitCount("the reconciler to re-drive or alert every lost intent", len(all),
		`SELECT count(*) FROM `+outboxView+` WHERE key = ANY($1) AND (alerted_at IS NOT NULL OR (generation > 0 AND published_at IS NOT NULL))`, all)
	forgot := w.exec(`DELETE FROM idem_inbox WHERE consumer = 'charges' AND expires_at < now()`)
	w.logf("the reconciler judged the lost intents (%s); charges forgot %d keys", w.proofLine(), forgot)
	d1.release()
	a1.release()
	w.durables = []string{"charges", "audit"}
	w.waitUp(d1, a1)

	e := newExpectation()
	e.add("charges", true, all, msg)
	e.add("audit", negative, all, msg) // alerted, never re-driven; the negative control re-drives them
	if negative {
		w.waitRest()
	} else {
		w.waitSettled(e)
	}
	f := w.check(e, len(all), func(f *idFigures) {
		redriven := w.count1(`SELECT count(*) FROM idem_outbox WHERE generation > 0 AND key = ANY($1)`, all)
		f.extra = fmt.Sprintf("intents=%d redriven=%d charges_forgot=%d %s", len(all), redriven, forgot, w.proofLine())
		if !negative && redriven != 0 {
			t.Errorf("chaos: %d intents re-driven, want 0: each was settled by charges under a lifetime that has passed", redriven)
		}
	})
	return f, len(all)
}
