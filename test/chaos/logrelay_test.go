package chaos

import (
	"fmt"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faults"
)

// The log relay's cases: it reads committed outbox rows from a logical replication
// slot, and the slot's confirmed position is all it remembers. Each case ends
// lost=0 doubled=0 with real processes, and its negative control brings back one
// way a relay of the log would lose rows (README.md, "The log relay's cases").
// They need the log relay, so they skip in the suite's polling pass.

var logMessages = []string{"id.log.created"}

// logWorld is a case's world: one installation, relays and one consumer.
func logWorld(t *testing.T, name string, negative bool, control faults.Point) *idWorld {
	if relayMode() != "log" {
		t.Skip("chaos: IDEM_TEST_RELAY=poll: the workers run the polling relay")
	}
	return newIDWorld(t, name, 1, negative, control)
}

// audit is the cases' consumer: one effect per intent.
func logAudit() []string { return consumersArgs("audit=id.log.>") }

// finish waits for the case (or, for a negative control, for rest) and counts.
func (w *idWorld) finish(e *expectation, intents int, negative bool) idFigures {
	if negative {
		w.waitSlotRest()
	} else {
		w.waitSettled(e)
	}
	return w.check(e, intents, func(f *idFigures) { f.extra = w.proofLine() })
}

// waitSlotRest waits, for a negative control that loses rows the slot will never
// stream again, until nothing is left in flight: the slot confirmed past all the
// WAL written so far, no row left to the polling relay, and the durables with
// nothing pending or unacknowledged. (waitRest would wait for the lost rows to
// be published.)
func (w *idWorld) waitSlotRest() {
	end := w.walNow()
	err := w.waitFor(idSettle, "the case to come to rest", func() (bool, string, error) {
		if confirmed, _ := w.slotPosition(); !w.lsnAtLeast(confirmed, end) {
			return false, "the slot confirmed " + confirmed + ", not yet " + end, nil
		}
		var polled int
		if err := w.dbs[0].Pool.QueryRow(w.ctx, `SELECT count(*) FROM idem_outbox WHERE relay IS NULL AND published_at IS NULL AND dead_lettered_at IS NULL`).Scan(&polled); err != nil {
			return false, "", err
		}
		if polled > 0 {
			return false, fmt.Sprintf("%d rows wait for the polling relay", polled), nil
		}
		b := w.busy()
		return b == "", b, nil
	})
	if err != nil {
		w.t.Errorf("%v", err)
	}
}

// slotPosition is the replication slot's confirmed position and the position the
// walsender has sent its reader, as "confirmed sent" LSNs ("" when unknown).
func (w *idWorld) slotPosition() (confirmed, sent string) {
	_ = w.dbs[0].Pool.QueryRow(w.ctx, `
SELECT COALESCE(s.confirmed_flush_lsn::text, ''), COALESCE(r.sent_lsn::text, '')
FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.database = current_database()`).Scan(&confirmed, &sent)
	return confirmed, sent
}

// walNow is the server's WAL insert position.
func (w *idWorld) walNow() string {
	var lsn string
	if err := w.dbs[0].Pool.QueryRow(w.ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn); err != nil {
		w.t.Fatal(err)
	}
	return lsn
}

// lsnAtLeast reports whether a is at or past b (both pg_lsn text).
func (w *idWorld) lsnAtLeast(a, b string) bool {
	if a == "" {
		return false
	}
	var ok bool
	if err := w.dbs[0].Pool.QueryRow(w.ctx, `SELECT $1::pg_lsn >= $2::pg_lsn`, a, b).Scan(&ok); err != nil {
		w.t.Fatal(err)
	}
	return ok
}

// The log relay killed with -9 mid-stream: two relays, one reading and one
// standing by, killed at random while intents stream; then, with the broker not
// answering (paused), every relay is killed after its slot sent it a stretch of
// rows whose PubAcks cannot come, and the broker dies with what it was sent.
// The slot was never confirmed past them, so the relay that starts next reads
// them again.
func TestChaosLogRelayKilled(t *testing.T) {
	t.Parallel()
	reportPositive(t, logRelayKilled(t, false))
}

// The negative control (relay.confirm-on-read): the relay confirms each
// transaction as it reads it; the stretch the broker never stored is lost.
func TestChaosLogRelayKilledNegativeControl(t *testing.T) {
	t.Parallel()
	f := logRelayKilled(t, true)
	if f.lost == 0 {
		t.Errorf("chaos: negative control reported lost=0 with positions confirmed before their PubAcks: the relays were not killed mid-stream, or the checker cannot see a loss")
	}
}

func logRelayKilled(t *testing.T, negative bool) idFigures {
	w := logWorld(t, "log-relay-killed", negative, faults.ConfirmOnRead)
	db := w.dbs[0]
	r1 := w.slot("r1", db, faults.RelayAfterPublish, "--roles", "relay")
	r2 := w.slot("r2", db, "", "--roles", "relay")
	c1 := w.slot("c1", db, faults.ConsumerAfterCommit, logAudit()...)
	w.durables = []string{"audit"}
	w.startSlots(r1, r2, c1)

	const n = 20
	kill := w.killWhen(w.publishedAtLeast(0, n), r1, r2)
	keys := w.produce(db, "log", 0, n, idPace, logMessages...)
	w.logf("produced %d intents; random fault: %s", n, kill())
	// A relay that starts while the broker is stopped cannot connect and exits, so
	// the killed relay must be back, and one of the two reading the slot, before
	// the stop: otherwise nothing reads the rows written during it.
	w.waitUp(r1, r2)
	if w.slotReader([]*idSlot{r1, r2}) == nil {
		t.Fatal("chaos: no relay reads the slot before the broker stops")
	}

	// Mid-stream, the broker stops answering: what the relay publishes now stays
	// in its connection, unacknowledged.
	w.nats.signal(syscall.SIGSTOP)
	more := w.produce(db, "log", n, n, 0, logMessages...)
	end := w.walNow()
	if err := w.waitFor(idSettle, "the slot to send the relay every row", func() (bool, string, error) {
		_, sent := w.slotPosition()
		return w.lsnAtLeast(sent, end), "sent " + sent + ", want " + end, nil
	}); err != nil {
		t.Fatal(err)
	}
	if negative {
		_ = w.waitFor(idSettle, "the control to confirm what it read", func() (bool, string, error) {
			confirmed, _ := w.slotPosition()
			return w.lsnAtLeast(confirmed, end), "confirmed " + confirmed, nil
		})
	} else if confirmed, _ := w.slotPosition(); w.lsnAtLeast(confirmed, end) {
		t.Errorf("chaos: the slot was confirmed to %s, past rows no PubAck came for (they end at %s)", confirmed, end)
	}
	r1.hold()
	r2.hold()
	if err := w.nats.crash(w.ctx, 0); err != nil { // kill -9 of the paused broker, and a restart
		t.Fatal(err)
	}
	w.count("broker-killed-mid-stream")
	r1.release()
	r2.release()
	e := newExpectation()
	e.add("audit", true, append(keys, more...), logMessages...)
	return w.finish(e, 2*n, negative)
}

// Postgres restarted under the slot: while a relay reads it, and while no relay
// does (rows written meanwhile wait in the slot across the restart).
func TestChaosLogRelayPostgresRestart(t *testing.T) {
	t.Parallel()
	reportPositive(t, logRelayPostgresRestart(t, false))
}

// The negative control (relay.temporary-slot): a slot that does not outlive its
// session or the server, from which each session starts at the server's current
// position; the rows written while no relay read it are lost.
func TestChaosLogRelayPostgresRestartNegativeControl(t *testing.T) {
	t.Parallel()
	f := logRelayPostgresRestart(t, true)
	if f.lost == 0 {
		t.Errorf("chaos: negative control reported lost=0 with a temporary slot: no row was written while no relay read, or the checker cannot see a loss")
	}
}

func logRelayPostgresRestart(t *testing.T, negative bool) idFigures {
	w := logWorld(t, "log-relay-postgres-restart", negative, faults.TemporarySlot)
	db := w.dbs[0]
	r1 := w.slot("r1", db, "", "--roles", "relay")
	c1 := w.slot("c1", db, faults.EffectBeforeCommit, logAudit()...)
	w.durables = []string{"audit"}
	w.startSlots(r1, c1)

	const n = 15
	var keys []string
	keys = append(keys, w.produce(db, "log", 0, n, idPace, logMessages...)...)
	w.restartPG(time.Second)
	keys = append(keys, w.produce(db, "log", n, n, idPace, logMessages...)...)
	r1.hold()
	keys = append(keys, w.produce(db, "log", 2*n, n, 0, logMessages...)...) // no relay reads these
	w.restartPG(time.Second)
	r1.release()
	e := newExpectation()
	e.add("audit", true, keys, logMessages...)
	return w.finish(e, len(keys), negative)
}

// restartPG stops the case's Postgres, leaves it down for down, and starts it.
func (w *idWorld) restartPG(down time.Duration) {
	w.t.Helper()
	if err := w.pg.restart(w.ctx, down); err != nil {
		w.t.Fatal(err)
	}
	w.count("postgres-restart")
	w.logf("Postgres restarted (down %s)", down)
}

// The slot dropped while intents wait in it unpublished (an operator's
// pg_drop_replication_slot, or max_slot_wal_keep_size invalidating it): the
// relay that starts next makes a new slot and hands what no window holds to the
// polling relay, which publishes it.
func TestChaosLogRelaySlotDropped(t *testing.T) {
	t.Parallel()
	reportPositive(t, logRelaySlotDropped(t, false))
}

// The negative control (relay.skip-slot-hand-over): the new slot streams only
// what comes after it; what the dropped one held is lost.
func TestChaosLogRelaySlotDroppedNegativeControl(t *testing.T) {
	t.Parallel()
	f := logRelaySlotDropped(t, true)
	if f.lost == 0 {
		t.Errorf("chaos: negative control reported lost=0 without the hand-over: the dropped slot held nothing unpublished, or the checker cannot see a loss")
	}
}

func logRelaySlotDropped(t *testing.T, negative bool) idFigures {
	w := logWorld(t, "log-relay-slot-dropped", negative, faults.SkipSlotHandOver)
	db := w.dbs[0]
	r1 := w.slot("r1", db, "", "--roles", "relay")
	c1 := w.slot("c1", db, faults.ConsumerAfterCommit, logAudit()...)
	w.durables = []string{"audit"}
	w.startSlots(r1, c1)

	const n = 15
	keys := w.produce(db, "log", 0, n, idPace, logMessages...)
	r1.hold()
	keys = append(keys, w.produce(db, "log", n, n, 0, logMessages...)...)
	if got := w.exec(`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database() AND NOT active`); got != 1 {
		t.Fatalf("chaos: dropped %d slots, want the log relay's one", got)
	}
	w.count("slot-dropped")
	w.logf("dropped the slot with %d intents unpublished in it", n)
	r1.release()
	e := newExpectation()
	e.add("audit", true, keys, logMessages...)
	return w.finish(e, len(keys), negative)
}

// A relay failover: two relays; the one reading the slot is killed and kept
// down, again and again, while intents stream, so the other takes the slot over
// each time from its confirmed position.
func TestChaosLogRelayFailover(t *testing.T) {
	t.Parallel()
	f, failovers := logRelayFailover(t, false)
	reportPositive(t, f)
	if failovers < 2 {
		t.Errorf("chaos: %d failovers, want 2", failovers)
	}
}

// The negative control (relay.temporary-slot): the slot dies with its reader,
// and the relay that takes over starts at the server's current position; what
// was written between the two is lost.
func TestChaosLogRelayFailoverNegativeControl(t *testing.T) {
	t.Parallel()
	f, _ := logRelayFailover(t, true)
	if f.lost == 0 {
		t.Errorf("chaos: negative control reported lost=0 with a slot that dies with its reader: nothing was written during a failover, or the checker cannot see a loss")
	}
}

func logRelayFailover(t *testing.T, negative bool) (idFigures, int) {
	w := logWorld(t, "log-relay-failover", negative, faults.TemporarySlot)
	db := w.dbs[0]
	relays := []*idSlot{w.slot("r1", db, "", "--roles", "relay"), w.slot("r2", db, "", "--roles", "relay")}
	c1 := w.slot("c1", db, "", logAudit()...)
	w.durables = []string{"audit"}
	w.startSlots(append(relays, c1)...)

	const n = 10
	var keys []string
	failovers := 0
	for round := range 3 {
		keys = append(keys, w.produce(db, "log", round*n, n, idPace, logMessages...)...)
		if round == 2 {
			break
		}
		reader := w.slotReader(relays)
		if reader == nil {
			t.Fatal("chaos: no relay reads the slot")
		}
		reader.hold()
		failovers++
		w.logf("failover %d: killed %s, the relay reading the slot, and keep it down", failovers, reader.name)
		// Written while the other takes over.
		keys = append(keys, w.produce(db, "log", 100+round*n, n, 0, logMessages...)...)
		reader.release()
	}
	e := newExpectation()
	e.add("audit", true, keys, logMessages...)
	return w.finish(e, len(keys), negative), failovers
}

// slotReader is the relay slot whose process streams the slot now: the walsender
// names its reader's pid (relay.LogRelay's application_name).
func (w *idWorld) slotReader(relays []*idSlot) *idSlot {
	var reader *idSlot
	_ = w.waitFor(idSettle, "a relay to read the slot", func() (bool, string, error) {
		var app string
		err := w.dbs[0].Pool.QueryRow(w.ctx, `SELECT application_name FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.database = current_database()`).Scan(&app)
		if err != nil {
			return false, "no reader", nil
		}
		for _, s := range relays {
			s.mu.Lock()
			p := s.cur
			s.mu.Unlock()
			if p != nil && !p.exited() && app == "idem log relay (pid "+strconv.Itoa(p.cmd.Process.Pid)+")" {
				reader = s
				return true, "", nil
			}
		}
		return false, fmt.Sprintf("reader %q is no live relay slot", app), nil
	})
	return reader
}
