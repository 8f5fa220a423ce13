package chaos

import (
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/registry"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/installation"
)

// The five cases of a delivery's identity: what names a delivery (installation,
// consumer, key, message) under real processes and real SIGKILLs, each ending
// lost=0 doubled=0, each with a negative control that brings back the old
// behaviour and must show the failure. See README.md, "The identity cases".

// idPace is the producers' pause between intents: the load spreads over a second
// or two, so that the kills land while deliveries are in flight.
const idPace = 30 * time.Millisecond

// One intent, four messages, one consumer: two subjects under its wildcard filter
// (id.orders.created, id.orders.paid) and two named messages on one subject
// (id.orders.line line-1 and line-2). Each is its own delivery: four effects per
// intent, each proven by its own settlement.
func TestChaosTwoMessages(t *testing.T) {
	t.Parallel()
	f := twoMessages(t, false)
	reportPositive(t, f)
	if f.deadLetters != 0 {
		t.Errorf("chaos: %d dead letters, want none (a second message of an intent is no changed payload)", f.deadLetters)
	}
}

// The negative control: consumers that name a delivery by its key alone
// (consumer.key-only-identity) fold an intent's later messages into its first, or
// dead-letter them as a changed payload: lost > 0.
func TestChaosTwoMessagesNegativeControl(t *testing.T) {
	t.Parallel()
	f := twoMessages(t, true)
	if f.lost == 0 {
		t.Errorf("chaos: negative control reported lost=0 with key-only identity: the case does not send two messages of one intent to one consumer, or the checker cannot see a loss")
	}
	if f.doubled > 0 || f.stray > 0 {
		t.Errorf("chaos: negative control doubled %d and strayed %d: key-only identity must lose messages, not double them", f.doubled, f.stray)
	}
}

var orderMessages = []string{"id.orders.created", "id.orders.paid", "id.orders.line:line-1", "id.orders.line:line-2"}

func twoMessages(t *testing.T, negative bool) idFigures {
	w := newIDWorld(t, "two-messages", 1, negative, faults.KeyOnlyIdentity)
	db := w.dbs[0]
	audit := consumersArgs("audit=id.orders.>")
	r1 := w.slot("r1", db, faults.RelayAfterPublish, "--roles", "relay")
	c1 := w.slot("c1", db, faults.EffectBeforeCommit, audit...)
	c2 := w.slot("c2", db, faults.ConsumerAfterCommit, audit...)
	w.durables = []string{"audit"}
	w.startSlots(r1, c1, c2)

	const n = 24
	kill := w.killWhen(w.publishedAtLeast(0, n*len(orderMessages)), c1, c2, r1)
	keys := w.produce(db, "order", 0, n, idPace, orderMessages...)
	w.logf("produced %d intents of %d messages; random fault: %s", len(keys), len(orderMessages), kill())

	e := newExpectation()
	e.add("audit", true, keys, orderMessages...)
	if negative {
		w.waitRest()
	} else {
		w.waitSettled(e)
	}
	return w.check(e, len(keys), func(f *idFigures) { f.extra = w.proofLine() })
}

// Two installations (two databases) on one stream with the same consumer names.
// The second installation's workers are refused at start, naming both
// installations; the first's intents take effect exactly once across both
// databases, and its reconciler proves every one.
func TestChaosTwoInstallations(t *testing.T) {
	t.Parallel()
	f, wrong := twoInstallations(t, false)
	reportPositive(t, f)
	for _, p := range wrong {
		t.Errorf("chaos: %s", p)
	}
}

// The negative control (consumer.any-installation in every worker): the second
// installation binds the first's durables and takes a share of its messages; the
// first's reconciler reads those acks as its own consumers' and re-drives what
// its inbox lacks: effects in both databases, doubled > 0.
func TestChaosTwoInstallationsNegativeControl(t *testing.T) {
	t.Parallel()
	f, _ := twoInstallations(t, true)
	if f.doubled == 0 {
		t.Errorf("chaos: negative control reported doubled=0 with two installations on one durable: the second installation took nothing, or the checker cannot see an effect in both databases")
	}
	if f.lost > 0 {
		t.Errorf("chaos: negative control lost %d deliveries: sharing a durable must double effects here, not lose them", f.lost)
	}
}

// twoInstallations returns the figures and, in the case, what was wrong with the
// second installation's refusal.
func twoInstallations(t *testing.T, negative bool) (idFigures, []string) {
	w := newIDWorld(t, "two-installations", 2, negative, faults.AnyInstallation)
	a, b := w.dbs[0], w.dbs[1]
	cons := consumersArgs("ledger=id.pay.charge", "notify=id.pay.>")
	r1 := w.slot("a-r1", a, faults.RelayAfterPublish, "--roles", "relay")
	c1 := w.slot("a-c1", a, faults.EffectBeforeCommit, cons...)
	c2 := w.slot("a-c2", a, faults.ConsumerAfterCommit, cons...)
	b1 := w.slot("b-c1", b, "", cons...)
	b2 := w.slot("b-c2", b, "", cons...)
	b1.oneShot, b2.oneShot = true, true
	w.durables = []string{"ledger", "notify"}
	w.startSlots(r1, c1, c2)

	const first, second = 8, 16
	const msg = "id.pay.charge"
	keys := w.produce(a, "pay", 0, first, idPace, msg)
	// The second installation starts, with the same consumer names.
	b1.run()
	b2.run()
	if negative {
		w.waitUp(b1, b2)
	} else {
		err := w.waitFor(time.Minute, "the second installation's workers to exit", func() (bool, string, error) {
			_, e1 := b1.up()
			_, e2 := b2.up()
			return e1 && e2, "still running", nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	w.logf("second installation started: %s", map[bool]string{true: "bound the durables (negative control)", false: "its workers exited"}[negative])
	kill := w.killWhen(w.publishedAtLeast(first, second), c1, c2, r1)
	keys = append(keys, w.produce(a, "pay", first, second, idPace, msg)...)
	w.logf("produced %d intents; random fault: %s", len(keys), kill())

	e := newExpectation()
	e.add("ledger", true, keys, msg)
	e.add("notify", true, keys, msg)
	if negative {
		// B has taken its share. It stops, so that the first installation's
		// re-drives of what B took reach the first's workers: while B runs, each
		// copy goes to whichever installation pulls first, and the chase can
		// take dozens of generations.
		w.waitRest()
		b1.kill()
		b2.kill()
	}
	w.waitSettled(e)

	// Each of B's workers must have exited 1, refused, naming both installations.
	var wrong []string
	instA, errA := installation.Of(w.ctx, a.Pool, "")
	instB, errB := installation.Of(w.ctx, b.Pool, "")
	if errA != nil || errB != nil {
		t.Fatal(errA, errB)
	}
	nRefused := 0
	for _, s := range []*idSlot{b1, b2} {
		refusal := w.procs.firstLine("idworker-"+s.name, "belongs to another installation")
		s.mu.Lock()
		outcomes := s.outcomes
		s.mu.Unlock()
		switch {
		case negative:
		case len(outcomes) != 1 || outcomes[0] != "exit status 1":
			wrong = append(wrong, fmt.Sprintf("%s of the second installation ended %v, want one exit with status 1", s.name, outcomes))
		case !strings.Contains(refusal, "("+instA+")") || !strings.Contains(refusal, "("+instB+")"):
			wrong = append(wrong, fmt.Sprintf("%s's refusal does not name both installations (%s, %s): %q", s.name, instA, instB, refusal))
		default:
			nRefused++
		}
	}
	if nRefused > 0 {
		w.logf("refused: %s", w.procs.firstLine("idworker-b-c1", "belongs to another installation"))
	}
	f := w.check(e, len(keys), func(f *idFigures) {
		var inB int
		if err := b.Pool.QueryRow(w.ctx, `SELECT count(*) FROM chaos_effects`).Scan(&inB); err != nil {
			t.Fatal(err)
		}
		f.extra = fmt.Sprintf("refused=%d effects_in_second_installation=%d %s", nRefused, inB, w.proofLine())
		if !negative && inB > 0 {
			wrong = append(wrong, fmt.Sprintf("%d effects in the second installation's database", inB))
		}
	})
	return f, wrong
}

// A consumer renamed on a stream that holds history keeps its inbox
// (consumer.Rename): the new name re-reads the history and folds all of it.
// Deployed first without Rename, the new name is refused (ErrLikelyRenamed) and
// runs nothing. A consumer added with the default start (backfill) reads the
// history once; one added with StartNew reads only what is published after it
// registered.
func TestChaosRename(t *testing.T) {
	t.Parallel()
	f, wrong := rename(t, false)
	reportPositive(t, f)
	for _, w := range wrong {
		t.Errorf("chaos: %s", w)
	}
}

// The negative control (consumer.rename-backfills in every worker): the new name
// deployed without Rename backfills instead of being refused, and runs the
// history again as fresh keys: doubled > 0.
func TestChaosRenameNegativeControl(t *testing.T) {
	t.Parallel()
	f, _ := rename(t, true)
	if f.doubled == 0 {
		t.Errorf("chaos: negative control reported doubled=0 for a rename without Rename: the new name did not re-read the history, or the checker cannot see a double")
	}
	if f.lost > 0 || f.stray > 0 {
		t.Errorf("chaos: negative control lost %d and strayed %d: a rename without Rename must double the history, nothing else", f.lost, f.stray)
	}
}

// rename returns the figures and, in the case, what was wrong: the new name
// deployed without Rename was not refused, or its durable did not read the whole
// history after Rename.
func rename(t *testing.T, negative bool) (idFigures, []string) {
	w := newIDWorld(t, "rename", 1, negative, faults.RenameBackfills)
	db := w.dbs[0]
	const msg = "id.pay.charge"
	r1 := w.slot("r1", db, faults.RelayAfterPublish, "--roles", "relay")
	c1 := w.slot("charges1", db, faults.EffectBeforeCommit, consumersArgs("charges="+msg)...)
	c2 := w.slot("charges2", db, faults.ConsumerAfterCommit, consumersArgs("charges="+msg)...)
	w.durables = []string{"charges"}
	w.startSlots(r1, c1, c2)

	const n = 16
	kill := w.killWhen(w.publishedAtLeast(0, n), c1, c2)
	hist := w.produce(db, "hist", 0, n, idPace, msg)
	w.logf("history: %d intents; random fault: %s", len(hist), kill())
	before := newExpectation()
	before.add("charges", true, hist, msg)
	w.waitSettled(before)

	// The rename: every worker of the old name stops. The new name deployed
	// without Rename is refused (it backfills in the negative control); then the
	// inbox moves to the new name (not in the negative control) and the old
	// durable is deleted.
	c1.hold()
	c2.hold()
	var wrong []string
	if negative {
		w.logf("deploying ledger without registry.Rename")
	} else {
		wrong = append(wrong, w.refusedRename(db, msg)...)
		if err := registry.Rename(w.ctx, db.Pool, "", "charges", "ledger", true); err != nil {
			t.Fatal(err)
		}
		w.logf("renamed charges to ledger (registry.Rename)")
	}
	if err := w.js.DeleteConsumer(w.ctx, idStream, "charges"); err != nil {
		t.Fatal(err)
	}
	l1 := w.slot("ledger1", db, faults.EffectBeforeCommit, consumersArgs("ledger="+msg)...)
	l2 := w.slot("ledger2", db, faults.ConsumerAfterCommit, consumersArgs("ledger="+msg)...)
	all := w.slot("audit-all", db, faults.EffectBeforeCommit, consumersArgs("audit-all=id.pay.>")...)
	fresh := w.slot("audit-new", db, faults.ConsumerAfterCommit, append(consumersArgs("audit-new=id.pay.>"), "--start", "new")...)
	w.durables = []string{"ledger", "audit-all", "audit-new"}
	w.startSlots(l1, l2, all, fresh)

	kill = w.killWhen(w.publishedAtLeast(n, n), l1, l2, all, fresh)
	after := w.produce(db, "after", 0, n, idPace, msg)
	w.logf("after the rename: %d intents; random fault: %s", len(after), kill())

	e := newExpectation()
	e.alias["charges"] = "ledger" // one consumer under two names
	e.add("ledger", true, hist, msg)
	e.add("ledger", true, after, msg)
	e.add("audit-all", true, hist, msg)
	e.add("audit-all", true, after, msg)
	e.add("audit-new", true, after, msg)
	e.add("audit-new", false, hist, msg)
	if negative {
		w.waitRest()
	} else {
		w.waitSettled(e)
	}
	// The new name's durable starts at the stream's beginning and has acked past
	// the whole history: it read every intent its kept inbox must fold.
	histSeqs := w.seqsOf(`key = ANY($1)`, hist)
	if jc, err := w.js.Consumer(w.ctx, idStream, "ledger"); err != nil {
		wrong = append(wrong, err.Error())
	} else if info, err := jc.Info(w.ctx); err != nil {
		wrong = append(wrong, err.Error())
	} else if info.Config.DeliverPolicy != jetstream.DeliverAllPolicy || info.AckFloor.Stream < histSeqs[len(histSeqs)-1] {
		wrong = append(wrong, fmt.Sprintf("durable ledger delivers %s and acked up to %d; the history ends at %d: the renamed consumer did not re-read the history, so its kept inbox proves nothing",
			info.Config.DeliverPolicy, info.AckFloor.Stream, histSeqs[len(histSeqs)-1]))
	}
	f := w.check(e, len(hist)+len(after), func(f *idFigures) {
		f.extra = fmt.Sprintf("history=%d after=%d ledger_folded=%d %s", len(hist), len(after), f.events["ledger duplicate"], w.proofLine())
	})
	return f, wrong
}

// refusedRename deploys ledger, with charges's filter, before charges is renamed:
// its worker must exit 1 with ErrLikelyRenamed naming charges and the command to
// run, leaving ledger unregistered and without a durable.
func (w *idWorld) refusedRename(db *chaosDB, msg string) []string {
	w.t.Helper()
	l0 := w.slot("ledger0", db, "", consumersArgs("ledger="+msg)...)
	l0.oneShot = true
	l0.run()
	if err := w.waitFor(time.Minute, "ledger, deployed without Rename, to exit", func() (bool, string, error) {
		_, exited := l0.up()
		return exited, "still running", nil
	}); err != nil {
		w.t.Fatal(err)
	}
	refusal := w.procs.firstLine("idworker-ledger0", "likely renamed")
	w.logf("ledger without Rename: %s", refusal)
	l0.mu.Lock()
	outcomes := l0.outcomes
	l0.mu.Unlock()
	var wrong []string
	if len(outcomes) != 1 || outcomes[0] != "exit status 1" {
		wrong = append(wrong, fmt.Sprintf("ledger deployed without Rename ended %v, want one exit with status 1", outcomes))
	}
	if !strings.Contains(refusal, "worker consumers rename charges ledger") {
		wrong = append(wrong, fmt.Sprintf("ledger deployed without Rename was not refused as a rename of charges: %q", refusal))
	}
	if _, err := w.js.Consumer(w.ctx, idStream, "ledger"); !errors.Is(err, jetstream.ErrConsumerNotFound) {
		wrong = append(wrong, fmt.Sprintf("the refused ledger's durable: %v, want none", err))
	}
	var n int
	if err := db.Pool.QueryRow(w.ctx, `SELECT count(*) FROM idem_consumers WHERE name = 'ledger'`).Scan(&n); err != nil || n != 0 {
		wrong = append(wrong, fmt.Sprintf("the refused ledger is registered (%d, %v)", n, err))
	}
	return wrong
}

// A re-drive after a settled consumer's key expired. charges settles every intent;
// audit, which reads the same subject, is down. The stream loses the messages; the
// reconciler re-drives the young intents to audit alone (Idem-Replay-For) and
// alerts the old ones (written 60h ago: a copy kept for the stream's MaxAge could
// outlive charges's 72h key). charges forgets its keys (expired and collected),
// then reads the copies: it skips them. Every intent is charged once; audit runs
// the young ones once and has a dead letter for each old one.
func TestChaosRedriveAfterExpiry(t *testing.T) {
	t.Parallel()
	f, young, old := redriveAfterExpiry(t, false)
	reportPositive(t, f)
	if f.deadLetters != old {
		t.Errorf("chaos: %d dead letters, want %d: one alert for audit per old intent", f.deadLetters, old)
	}
	if got := f.events["charges skipped"]; got < young {
		t.Errorf("chaos: charges skipped %d copies, want at least the %d re-drives: the copies never reached the consumer that had forgotten their keys, so the case proves nothing", got, young)
	}
}

// The negative control (reconcile.redrive-to-all): the re-drives go to every
// consumer of the subject, the old ones too, and charges, having forgotten the
// keys, runs them again: doubled > 0.
func TestChaosRedriveAfterExpiryNegativeControl(t *testing.T) {
	t.Parallel()
	f, _, _ := redriveAfterExpiry(t, true)
	if f.doubled == 0 {
		t.Errorf("chaos: negative control reported doubled=0 with unaddressed re-drives: the copies did not reach charges, or the checker cannot see a double")
	}
	if f.lost > 0 {
		t.Errorf("chaos: negative control lost %d deliveries: unaddressed re-drives must double effects, not lose them", f.lost)
	}
}

func redriveAfterExpiry(t *testing.T, negative bool) (idFigures, int, int) {
	w := newIDWorld(t, "redrive-after-expiry", 1, negative, faults.RedriveToAll)
	db := w.dbs[0]
	const msg = "id.pay.charge"
	r1 := w.slot("r1", db, faults.RelayAfterPublish, "--roles", "relay")
	c1 := w.slot("charges1", db, faults.EffectBeforeCommit, consumersArgs("charges="+msg)...)
	c2 := w.slot("charges2", db, faults.ConsumerAfterCommit, consumersArgs("charges="+msg)...)
	a1 := w.slot("audit", db, "", consumersArgs("audit=id.pay.>")...)
	w.durables = []string{"charges", "audit"}
	w.startSlots(r1, c1, c2, a1)
	a1.hold() // audit is down: every intent waits for it

	const nYoung, nOld = 16, 8
	kill := w.killWhen(w.publishedAtLeast(0, nYoung+nOld), c1, c2)
	young := w.produce(db, "young", 0, nYoung, idPace, msg)
	old := w.produce(db, "old", 0, nOld, idPace, msg)
	all := append(append([]string(nil), young...), old...)
	w.logf("produced %d intents; random fault: %s", len(all), kill())
	settled := newExpectation()
	settled.add("charges", true, all, msg)
	w.durables = []string{"charges"}
	w.waitSettledBy(settled)

	// The old intents were written 60 hours ago: past the re-drive horizon (72h
	// key lifetime - 24h MaxAge - 1h margin) but not past the missing consumer's
	// own lifetime less the margin (71h), the old horizon.
	w.exec(`UPDATE idem_outbox SET created_at = now() - interval '60 hours' WHERE key = ANY($1)`, old)
	c1.hold()
	c2.hold()
	w.loseMessages(w.seqsOf(`key = ANY($1)`, all))
	w.waitCount("the reconciler to re-drive or alert every lost intent", len(all),
		`SELECT count(*) FROM `+outboxView+` WHERE key = ANY($1) AND (alerted_at IS NOT NULL OR (generation > 0 AND published_at IS NOT NULL))`, all)
	// charges forgets the keys, as its collector does once they expire.
	w.exec(`UPDATE idem_inbox SET expires_at = now() - interval '1 second' WHERE consumer = 'charges'`)
	forgot := w.exec(`DELETE FROM idem_inbox WHERE consumer = 'charges' AND expires_at < now()`)
	w.logf("the reconciler judged the lost intents (%s); charges forgot %d keys", w.proofLine(), forgot)
	c1.release()
	c2.release()
	a1.release()
	w.durables = []string{"charges", "audit"}
	w.waitUp(c1, c2, a1)

	e := newExpectation()
	e.add("charges", true, all, msg)
	e.add("audit", true, young, msg)
	e.add("audit", negative, old, msg) // alerted, never re-driven; the negative control re-drives them
	if negative {
		w.waitRest()
	} else {
		w.waitSettled(e)
	}
	f := w.check(e, len(all), func(f *idFigures) {
		addressed := w.count1(`SELECT count(*) FROM idem_outbox WHERE generation > 0 AND headers->>'Idem-Replay-For' = 'audit'`)
		f.extra = fmt.Sprintf("young=%d old=%d redriven_to_audit_only=%d charges_skipped=%d %s", len(young), len(old), addressed, f.events["charges skipped"], w.proofLine())
		if !negative && addressed != len(young) {
			t.Errorf("chaos: %d re-drives addressed to audit alone, want %d (one per young intent)", addressed, len(young))
		}
	})
	return f, len(young), len(old)
}

// A dead-letter replay the stream lost. Some intents hit a bug and are
// dead-lettered after their attempts; the reconciler proves them by their dead
// letters. The bug is fixed, the operator replays them (`worker dead-letters
// replay`) while the consumers are down, and the stream loses the replays. A
// replay is proven only by a settlement newer than itself, so the reconciler
// re-drives each lost one: every intent is charged once.
func TestChaosLostReplay(t *testing.T) {
	t.Parallel()
	f, broken := lostReplay(t, false)
	reportPositive(t, f)
	if f.deadLetters != broken {
		t.Errorf("chaos: %d dead letters, want %d: one per intent that hit the bug", f.deadLetters, broken)
	}
}

// The negative control (reconcile.old-dead-letters-prove): the dead letter a
// replay replays proves the replay settled, so the lost replays are never
// re-driven: lost > 0.
func TestChaosLostReplayNegativeControl(t *testing.T) {
	t.Parallel()
	f, _ := lostReplay(t, true)
	if f.lost == 0 {
		t.Errorf("chaos: negative control reported lost=0 with old dead letters as proof: the stream lost no replay, or the checker cannot see a loss")
	}
	if f.doubled > 0 {
		t.Errorf("chaos: negative control doubled %d deliveries: it must lose replays, not double them", f.doubled)
	}
}

func lostReplay(t *testing.T, negative bool) (idFigures, int) {
	w := newIDWorld(t, "lost-replay", 1, negative, faults.OldDeadLettersProve)
	db := w.dbs[0]
	const msg = "id.pay.charge"
	charges := append(consumersArgs("charges="+msg), "--max-deliver", "3", "--backoff", "100ms")
	r1 := w.slot("r1", db, faults.RelayAfterPublish, "--roles", "relay")
	c1 := w.slot("charges1", db, faults.EffectBeforeCommit, charges...)
	c2 := w.slot("charges2", db, faults.ConsumerAfterCommit, charges...)
	w.durables = []string{"charges"}
	w.startSlots(r1, c1, c2)

	const n = 21
	var broken []string
	for i := 0; i < n; i += 3 {
		broken = append(broken, fmt.Sprintf("pay-%d", i))
	}
	w.exec(`INSERT INTO chaos_broken SELECT unnest($1::text[])`, broken)
	kill := w.killWhen(w.publishedAtLeast(0, n), c1, c2)
	keys := w.produce(db, "pay", 0, n, idPace, msg)
	w.logf("produced %d intents, %d of them hit the handler's bug; random fault: %s", len(keys), len(broken), kill())

	w.waitCount("every intent that hit the bug to be dead-lettered", len(broken),
		`SELECT count(DISTINCT key) FROM idem_dead_letters WHERE consumer = 'charges' AND key = ANY($1)`, broken)
	good := newExpectation()
	for _, k := range keys {
		if !slices.Contains(broken, k) {
			good.add("charges", true, []string{k}, msg)
		}
	}
	w.waitSettled(good) // and the reconciler proved every row: the broken ones by their dead letters

	// The bug is fixed; the consumers are down while the operator replays the
	// dead letters with the reference binary, and the stream loses the replays.
	w.exec(`DELETE FROM chaos_broken`)
	c1.hold()
	c2.hold()
	cmd := exec.CommandContext(w.ctx, workerBin, "dead-letters", "replay", "--consumer", "charges", "--database-url", db.URL)
	cmd.Env = childEnv(nil)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("chaos: worker dead-letters replay: %v\n%s", err, out)
	}
	replayed := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		var r struct{ Action string }
		if json.Unmarshal([]byte(line), &r) == nil && r.Action == "replayed" {
			replayed++
		}
	}
	if replayed != len(broken) {
		t.Fatalf("chaos: worker dead-letters replay replayed %d, want %d:\n%s", replayed, len(broken), out)
	}
	const replays = `key = ANY($1) AND headers ? 'Idem-Replay-For'`
	w.waitCount("the replays to be published", len(broken), `SELECT count(*) FROM `+outboxView+` WHERE published_at IS NOT NULL AND `+replays, broken)
	w.loseMessages(w.seqsOf(replays, broken))
	w.waitCount("the reconciler to judge every replay", len(broken),
		`SELECT count(*) FROM `+outboxView+` WHERE (completed_at IS NOT NULL OR (generation > 0 AND published_at IS NOT NULL)) AND `+replays, broken)
	w.logf("replayed %d dead letters, the stream lost the replays; the reconciler judged them: %s", replayed, w.proofLine())
	c1.release()
	c2.release()
	w.waitUp(c1, c2)

	e := newExpectation()
	e.add("charges", true, keys, msg)
	if negative {
		w.waitRest()
	} else {
		w.waitSettled(e)
	}
	f := w.check(e, len(keys), func(f *idFigures) {
		redriven := w.count1(`SELECT count(*) FROM idem_outbox WHERE generation > 0 AND `+replays, broken)
		unreplayed := w.count1(`SELECT count(*) FROM idem_dead_letters WHERE replayed_at IS NULL`)
		f.extra = fmt.Sprintf("broken=%d replayed=%d replays_redriven=%d %s", len(broken), replayed, redriven, w.proofLine())
		if !negative && (redriven != len(broken) || unreplayed != 0) {
			t.Errorf("chaos: %d of %d lost replays re-driven, %d dead letters not marked replayed; want every replay re-driven", redriven, len(broken), unreplayed)
		}
	})
	return f, len(broken)
}
