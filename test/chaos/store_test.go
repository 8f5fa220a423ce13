package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/app/refapp"
)

// TestChaosStoreLoss runs intents with JetStream at its default sync interval
// while the broker loses acknowledged messages nobody has consumed yet: its store
// is wiped (stream and durable consumers gone) and its last message block is
// truncated (acknowledged writes never fsynced), each with a backlog in the
// stream, and wiped once more under running consumers, besides the usual kills.
// The reconciler (--reconcile-after 3s) must re-drive what was lost: every intent
// takes effect exactly once, and every published row ends proven settled.
func TestChaosStoreLoss(t *testing.T) {
	cfg := loadConfig(t)
	t.Parallel()
	cfg = cfg.storeRun()
	cfg.name = "store-loss"
	f := runChaos(t, cfg)
	for _, p := range f.problems() {
		t.Errorf("chaos: %s", p)
	}
	for _, p := range f.missingFaults(cfg) {
		t.Errorf("chaos: %s", p)
	}
}

// TestChaosStoreLossNegativeControl is the same loss with --reconcile-after off.
// Nothing re-drives what the stream lost, so the checker must see lost intents; if
// it does not, the store faults lose nothing and TestChaosStoreLoss proves nothing.
func TestChaosStoreLossNegativeControl(t *testing.T) {
	cfg := loadConfig(t)
	t.Parallel()
	if cfg.soak {
		cfg = cfg.shortSized() // the control shows the loss is real; it need not soak
	}
	cfg = cfg.storeRun()
	cfg.name, cfg.reconcileAfter, cfg.lossControl = "store-loss-negative-control", "off", true
	f := runChaos(t, cfg)
	if f.lost == 0 {
		t.Errorf("chaos: store-loss negative control reported lost=0 without a reconciler: the store faults lost nothing, or the checker cannot see a loss")
	}
	// Everything else must hold: the loss must not come with doubles, strays or
	// dead letters.
	g := f
	g.lost = 0
	for _, p := range g.problems() {
		t.Errorf("chaos: %s", p)
	}
	for _, p := range f.missingFaults(cfg) {
		t.Errorf("chaos: %s", p)
	}
}

// storeReconcileAfter is the store runs' --reconcile-after: short, so that what the
// stream lost is re-driven within seconds (the reconciler's pass interval is then
// the same).
const storeReconcileAfter = 3 * time.Second

// storeDuration is the store runs' load phase in the short run: room for two store
// faults of a few seconds each with load around them.
const storeDuration = 24 * time.Second

// storeRun is c made a store run: nats-server at its default sync interval, a
// reconciler with a short --reconcile-after, store faults (a wipe, a truncation and
// a live wipe in the short run; in a soak one every 30s, in turn), the worker topology with
// the consumers apart from the ingress (so that holding the consumers down leaves
// the clients their ingress), and nothing published around the outbox: a message
// published straight to the stream has no outbox row, so nothing could re-drive it.
// There is no Postgres outage (TestChaos has it).
func (c config) storeRun() config {
	c.natsSyncDefault = true
	c.reconcileAfter = storeReconcileAfter.String()
	if !c.soak {
		c.duration = storeDuration
	}
	c.storeFaults = max(3, int(c.duration/(30*time.Second)))
	c.noInjections = true
	c.outages, c.oversize, c.rawOversize, c.copies, c.burst, c.panicDeadLetter = 0, 0, 0, 0, 0, false
	c.slots = storeTopology()
	c.holdFor = 20 * time.Second
	if os.Getenv("IDEM_CHAOS_SETTLE") == "" {
		c.settle = c.settleDeadline()
	}
	return c
}

// storeTopology: three consumer workers, and two relays (each with its
// reconciler) that take the ingress.
func storeTopology() []workerSpec {
	return []workerSpec{
		{"w1", "consumers", []string{"effect.before-commit", "consumer.after-commit", "external.after-perform"}},
		{"w2", "consumers", []string{"consumer.after-commit", "effect.before-commit", "external.after-perform"}},
		{"w3", "consumers", []string{"external.after-perform", "effect.before-commit", "consumer.after-commit"}},
		{"w4", "relay,ingress", []string{"relay.after-publish", "ingress.after-commit"}},
		{"w5", "relay,ingress", []string{"ingress.after-commit", "relay.after-publish"}},
	}
}

// storeFigures are what the checker reads of the reconciler's work in a store run.
type storeFigures struct {
	damage        []storeDamage
	lostRows      int   // distinct outbox rows the store faults that held the consumers down lost
	lostRedriven  int   // of those, rows re-driven (generation > 0)
	lostEffected  int   // of those, intents that have their effect
	redriven      int   // outbox rows re-driven at least once (generation > 0)
	maxGeneration int   // the highest generation
	unproven      int   // published rows neither proven settled nor alerted
	alerted       int   // rows the reconciler gave up on
	statsRedriven int64 // `worker stats --json`: delivery.redriven
	statsUnproven int64 // and delivery.unproven
	statsErr      string
	// stuck are consumer subscriptions that stopped for good (a diagnostic; see
	// stuckSubscriptions), stuckAtEnd those of them still running at the end.
	stuck      []string
	stuckAtEnd int
}

// storeLine is the store run's second figures line.
func (f figures) storeLine() string {
	var parts []string
	for _, d := range f.store.damage {
		p := fmt.Sprintf("%s backlog=%d lost=%d", d.kind, d.backlog, d.lost)
		if d.kind == truncateStore {
			p += fmt.Sprintf(" block=%d->%d", d.blockFrom, d.blockTo)
		}
		last := fmt.Sprint(d.lastAfter)
		if d.noStream {
			last = "none"
		}
		parts = append(parts, p+fmt.Sprintf(" last_seq=%d->%s", d.lastBefore, last))
	}
	s := f.store
	return fmt.Sprintf("chaos: store: %s; redriven=%d (of the lost with the consumers held: %d of %d, %d with effect) max_generation=%d unproven=%d alerted=%d stats.delivery.redriven=%d stuck_subscriptions=%d",
		strings.Join(parts, "; "), s.redriven, s.lostRedriven, s.lostRows, s.lostEffected, s.maxGeneration, s.unproven, s.alerted, s.statsRedriven, len(s.stuck))
}

// storeMissing lists what a store run was to show and did not.
func (f figures) storeMissing(cfg config) []string {
	if cfg.storeFaults == 0 {
		return nil
	}
	s := f.store
	var ps []string
	want := map[faultKind]int{}
	for i := range cfg.storeFaults {
		want[[...]faultKind{wipeStore, truncateStore, wipeStoreLive}[i%3]]++
	}
	for kind, n := range want {
		if got := f.faultsByKind[kind.String()]; got < n {
			ps = append(ps, fmt.Sprintf("%d of %d %s faults happened", got, n, kind))
		}
	}
	for _, d := range s.damage {
		switch {
		case d.kind.holdsConsumers() && d.lost == 0:
			ps = append(ps, fmt.Sprintf("store fault %s lost none of the %d acknowledged, unconsumed messages in the stream: it proves nothing", d.kind, d.backlog))
		case d.kind != truncateStore && !d.storeGone:
			ps = append(ps, "store wipe: the store directory still existed when nats-server started again")
		case d.kind == truncateStore && d.blockTo >= d.blockFrom:
			ps = append(ps, fmt.Sprintf("block truncation: %s was not cut (%d -> %d bytes)", d.block, d.blockFrom, d.blockTo))
		}
	}
	if cfg.awaitsProof() {
		if s.redriven == 0 {
			ps = append(ps, "the reconciler re-drove nothing (no outbox row with generation > 0)")
		}
		if s.lostRedriven < s.lostRows {
			ps = append(ps, fmt.Sprintf("%d of the %d rows the stream lost while no consumer ran were never re-driven", s.lostRows-s.lostRedriven, s.lostRows))
		}
		if s.unproven > 0 || s.alerted > 0 {
			ps = append(ps, fmt.Sprintf("at the end %d published rows are unproven and %d alerted", s.unproven, s.alerted))
		}
		if s.statsErr != "" {
			ps = append(ps, "worker stats --json: "+s.statsErr)
		} else if s.statsRedriven != int64(s.redriven) || s.statsUnproven != int64(s.unproven) {
			ps = append(ps, fmt.Sprintf("worker stats --json says delivery.redriven=%d unproven=%d, the database %d and %d", s.statsRedriven, s.statsUnproven, s.redriven, s.unproven))
		}
	}
	if s.stuckAtEnd > 0 {
		ps = append(ps, fmt.Sprintf("%d consumers still running at the end stopped receiving after a failed recreate: %s", s.stuckAtEnd, strings.Join(s.stuck, "; ")))
	}
	if cfg.lossControl {
		if s.redriven > 0 {
			ps = append(ps, fmt.Sprintf("%d rows were re-driven although no reconciler ran", s.redriven))
		}
		if s.lostEffected > 0 {
			ps = append(ps, fmt.Sprintf("%d intents whose messages the stream lost took effect although nothing re-drove them", s.lostEffected))
		}
	}
	return ps
}

// checkStore reads what became of the rows the store faults lost, and the
// reconciler's counts, from the database and from `worker stats --json`.
func (r *run) checkStore(ctx context.Context, f *figures) error {
	r.storeMu.Lock()
	s := storeFigures{damage: append([]storeDamage(nil), r.damage...)}
	r.storeMu.Unlock()
	// Only the faults that held the consumers down: a live wipe's backlog may
	// include messages a running consumer had already received, which it settles
	// without a re-drive.
	lost := map[int64]bool{}
	var ids []int64
	for _, d := range s.damage {
		if !d.kind.holdsConsumers() {
			continue
		}
		for _, id := range d.lostIDs {
			if !lost[id] {
				lost[id] = true
				ids = append(ids, id)
			}
		}
	}
	s.lostRows = len(ids)
	rows, err := r.db.Pool.Query(ctx, `
SELECT o.key, o.subject, o.generation,
       (SELECT count(*) FROM ledger_entries l WHERE l.idempotency_key = o.key)
FROM idem_outbox o WHERE o.id = ANY($1)`, ids)
	if err != nil {
		return fmt.Errorf("read the lost rows: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var key, subject string
		var gen, ledger int
		if err := rows.Scan(&key, &subject, &gen, &ledger); err != nil {
			return fmt.Errorf("read the lost rows: %w", err)
		}
		if gen > 0 {
			s.lostRedriven++
		}
		if ledger > 0 || subject == refapp.SubjectEmail && r.smtp.DeliveriesOf(refapp.MessageID(key)) > 0 {
			s.lostEffected++
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read the lost rows: %w", err)
	}
	err = r.db.Pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM idem_outbox WHERE generation > 0),
       (SELECT COALESCE(max(generation), 0) FROM idem_outbox),
       (SELECT count(*) FROM `+outboxView+` WHERE published_at IS NOT NULL AND completed_at IS NULL AND alerted_at IS NULL),
       (SELECT count(*) FROM idem_outbox WHERE alerted_at IS NOT NULL)`).Scan(&s.redriven, &s.maxGeneration, &s.unproven, &s.alerted)
	if err != nil {
		return fmt.Errorf("read the reconciler's counts: %w", err)
	}
	if st, err := r.workerStats(ctx); err != nil {
		s.statsErr = err.Error()
	} else {
		s.statsRedriven, s.statsUnproven = st.Delivery.Redriven, st.Delivery.Unproven
	}
	// A subscription stopped by a failed recreate is resumed at the consumer's
	// next check of its durable (every CheckInterval, 5s): one that failed just
	// before the run ended is given three checks to resume before it counts.
	for deadline := time.Now().Add(3*5*time.Second + 2*time.Second); ; time.Sleep(250 * time.Millisecond) {
		if s.stuck, s.stuckAtEnd, err = r.stuckSubscriptions(); err != nil {
			return err
		}
		if s.stuckAtEnd == 0 || time.Now().After(deadline) {
			break
		}
	}
	f.store = s
	return nil
}

// stuckSubscriptions finds, in the consumer workers' logs, consumers that stopped
// receiving for good: within one incarnation, the last word of a consumer about
// its durable consumer is "recreating it failed" (its stream was missing), with no
// "resumed it" after it. Such a consumer once stopped its subscription before the
// failed attempt and, once another worker had recreated the shared durable
// consumer, found it present at every check and never subscribed again, while
// reporting itself healthy. The fix (fetcher.watch resumes a stopped subscription)
// is checked here: an incarnation still running at the end must not be stuck. One
// killed right after a failed attempt is listed but not counted.
func (r *run) stuckSubscriptions() (stuck []string, atEnd int, err error) {
	const (
		failed    = `msg="consumer: durable consumer missing; recreating it failed"`
		recreated = `msg="consumer: subscription was stopped (its durable consumer went missing); resumed it`
		started   = `msg="consumer started"`
	)
	for _, w := range r.workers {
		if !w.consumes() {
			continue
		}
		b, err := os.ReadFile(w.log.Name())
		if err != nil {
			return nil, 0, fmt.Errorf("chaos: read %s: %w", w.log.Name(), err)
		}
		incarnations := strings.Split(string(b), "=== chaos: worker "+w.spec.name+" incarnation #")
		for i, inc := range incarnations {
			last := map[string]string{} // consumer -> its last lifecycle line
			for _, line := range strings.Split(inc, "\n") {
				if !strings.Contains(line, failed) && !strings.Contains(line, recreated) && !strings.Contains(line, started) {
					continue
				}
				_, rest, ok := strings.Cut(line, " consumer=")
				if !ok {
					continue
				}
				name, _, _ := strings.Cut(rest, " ")
				last[name] = line
			}
			for name, line := range last {
				if strings.Contains(line, failed) {
					ts, _, _ := strings.Cut(line, " ")
					stuck = append(stuck, fmt.Sprintf("%s incarnation #%d consumer %s (%s)", w.spec.name, i, name, strings.TrimPrefix(ts, "time=")))
					if i == len(incarnations)-1 {
						atEnd++
					}
				}
			}
		}
	}
	return stuck, atEnd, nil
}

// statsJSON is the part of `worker stats --json` the checker reads.
type statsJSON struct {
	Delivery struct {
		Unproven int64 `json:"unproven"`
		Redriven int64 `json:"redriven"`
		Alerted  int64 `json:"alerted"`
	} `json:"delivery"`
}

// workerStats runs `worker stats --json`, the operator's view, against the run's
// database and broker.
func (r *run) workerStats(ctx context.Context) (statsJSON, error) {
	var st statsJSON
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, workerBin, "stats", "--json", "--database-url", r.db.URL, "--nats-url", r.nats.URL())
	cmd.Env = childEnv(nil)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return st, fmt.Errorf("%w: %s", err, strings.TrimSpace(stderr.String()))
	}
	if err := json.Unmarshal(stdout.Bytes(), &st); err != nil {
		return st, fmt.Errorf("parse its output %q: %w", abbreviateBytes(stdout.Bytes(), 200), err)
	}
	return st, nil
}
