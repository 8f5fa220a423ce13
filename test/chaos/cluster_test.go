package chaos

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/app/refapp"
)

// TestChaosCluster runs intents through three workers (three ingresses, three
// consumers, two relays) on one database and a three-node JetStream cluster of
// real nats-server processes, the stream R3, while the cluster is hurt in one run:
// the stream's leader is killed -9 and later restarted on its store; the next
// leader is SIGSTOPped for twice as long as the others take to elect a new one,
// then SIGCONTinued; every node is restarted in turn. Each fault waits on
// conditions (a new leader in the stream's cluster info, charges flowing again,
// the node current again), and the load runs until the last fault is over. Every
// intent must take effect exactly once.
func TestChaosCluster(t *testing.T) {
	cfg := loadConfig(t)
	t.Parallel()
	cfg = cfg.clusterRun()
	cfg.name = "cluster"
	f := runChaos(t, cfg)
	for _, p := range f.problems() {
		t.Errorf("chaos: %s", p)
	}
	for _, p := range f.missingFaults(cfg) {
		t.Errorf("chaos: %s", p)
	}
}

// clusterRate is the short cluster run's pace: presses per second over all lanes.
const clusterRate = 6

// clusterLoadCap is how long the load's plan reaches beyond the soak's duration
// (the short run: beyond 0). The load stops as soon as the cluster faults are
// over, which takes about a minute; a run whose faults outlast the plan fails,
// saying so.
const clusterLoadCap = 4 * time.Minute

// clusterWait bounds each condition a cluster fault waits on: a leader elected, a
// node current again, charges flowing.
const clusterWait = 90 * time.Second

// clusterFlow is how many new ledger rows count as "charges flowing": each went
// through an ingress, the outbox, a relay, a quorum of the stream and a consumer.
const clusterFlow = 10

// clusterRun is c made a cluster run: the cluster topology, three nodes and an R3
// stream, and only the cluster's faults besides the workers' fault points (no
// random kills: their restart of the single nats-server has no meaning here;
// nothing published around the outbox, no Postgres outage, no oversize presses:
// TestChaos has them). The short run makes one round of the three faults; a soak
// (IDEM_CHAOS_DURATION) repeats the round until its duration has passed, at the
// pace IDEM_CHAOS_INTENTS over IDEM_CHAOS_DURATION gives.
func (c config) clusterRun() config {
	c.cluster = true
	c.slots = clusterTopology()
	c.noInjections = true
	c.outages, c.oversize, c.rawOversize, c.copies, c.burst, c.panicDeadLetter = 0, 0, 0, 0, 0, false
	c.randomFaults = 0
	rate := float64(clusterRate)
	c.faultsFor = 0
	if c.soak {
		rate = float64(c.intents) / c.duration.Seconds()
		c.faultsFor = c.duration
	}
	c.duration = c.faultsFor + clusterLoadCap
	c.intents = max(1, int(rate*c.duration.Seconds()))
	if os.Getenv("IDEM_CHAOS_SETTLE") == "" {
		c.settle = c.settleDeadline()
	}
	return c
}

// clusterTopology: three workers with the ingress and the consumers, two of them
// with the relay. external.after-perform is left out of their fault points: its
// 30s email lease would only lengthen the settling, and TestChaos has it.
func clusterTopology() []workerSpec {
	return []workerSpec{
		{"w1", "ingress,relay,consumers", []string{"effect.before-commit", "relay.after-publish", "consumer.after-commit", "ingress.after-commit"}},
		{"w2", "ingress,relay,consumers", []string{"relay.after-publish", "consumer.after-commit", "effect.before-commit", "ingress.after-commit"}},
		{"w3", "ingress,consumers", []string{"consumer.after-commit", "ingress.after-commit", "effect.before-commit"}},
	}
}

// The cluster faults, as faultsByKind counts them.
const (
	killNATSLeader  = "kill-nats-stream-leader" // kill -9 of the stream leader's process, restarted on its store
	stopNATSLeader  = "stop-nats-stream-leader" // SIGSTOP of the stream leader beyond a new election, then SIGCONT
	restartNATSNode = "restart-nats-node"       // one node of the rolling restart: SIGTERM, and a start on its store
)

// clusterState is the run's cluster and what its faults did.
type clusterState struct {
	nats *natsCluster

	mu     sync.Mutex
	faults []clusterFault
	stale  int // stream info answers naming a resumed node leader with a leader_since from before its stop
}

// clusterFault is one fault that happened, described with the nodes' names.
type clusterFault struct {
	kind string
	desc string
}

// clusterFigures are the cluster run's figures besides the usual ones.
type clusterFigures struct {
	faults []clusterFault
	stale  int
	final  string // the stream's cluster at the end, as its leader describes it
	healed bool   // at the end: a leader, and every other replica current
}

// record notes a fault that happened.
func (r *run) record(kind, desc string) {
	r.cluster.mu.Lock()
	r.cluster.faults = append(r.cluster.faults, clusterFault{kind: kind, desc: desc})
	r.cluster.mu.Unlock()
	r.logf("cluster: %s", desc)
}

// clusterFaults runs the cluster's faults in turn, each waiting on conditions,
// while the load runs; it returns when they are over (the caller then stops the
// load) or when one failed. Waits run on load: a load that ends first (its plan
// too short for a slow machine) fails the run. Restarts and SIGCONTs run whatever
// happened, so the run never settles a node short.
func (r *run) clusterFaults(ctx, load context.Context, start time.Time) error {
	if err := r.waitCharges(load, 2*clusterFlow, "charges flowing before the first cluster fault"); err != nil {
		return r.clusterErr(load, err)
	}
	for round := 1; ; round++ {
		for _, fault := range []func(ctx, load context.Context) error{r.killStreamLeader, r.stopStreamLeader, r.rollingRestart} {
			if err := fault(ctx, load); err != nil {
				return r.clusterErr(load, err)
			}
		}
		if time.Since(start) >= r.cfg.faultsFor {
			r.logf("cluster: %d round(s) of faults over %s into the load; the load stops", round, time.Since(start).Round(time.Millisecond))
			return nil
		}
	}
}

func (r *run) clusterErr(load context.Context, err error) error {
	if load.Err() != nil {
		return fmt.Errorf("chaos: cluster: the load's plan (%s) ended before the cluster faults were done: %w", r.cfg.duration, err)
	}
	return fmt.Errorf("chaos: cluster: %w", err)
}

// killStreamLeader kills -9 the stream leader's process, waits for another node
// to lead the stream and for charges to flow without it, then restarts it on its
// store and waits until it is current again.
func (r *run) killStreamLeader(ctx, load context.Context) error {
	leader, _, err := r.waitStreamLeader(load, "the stream to have a leader")
	if err != nil {
		return err
	}
	n, meta := r.cluster.nats.node(leader), r.metaLeader(load)
	on := slotNames(r.workersOn(n))
	r.logf("fault: kill -9 nats-server %s, the stream's leader (meta leader %s; workers connected to it: %s)", leader, meta, on)
	t0 := time.Now()
	n.kill9()
	next, si, err := r.waitStreamLeader(load, "a new stream leader after kill -9 of "+leader, leader)
	elected := electedAfter(si, t0, time.Since(t0))
	if err == nil {
		err = r.waitCharges(load, clusterFlow, "charges flowing without "+leader)
	}
	down := time.Since(t0)
	// Back on its store even when a wait failed.
	if serr := n.start(); serr != nil {
		return errors.Join(err, serr)
	}
	if err != nil {
		return err
	}
	current, _, err := r.waitCurrent(load, n, t0)
	if err != nil {
		return err
	}
	r.record(killNATSLeader, fmt.Sprintf("kill -9 stream leader %s (meta leader %s; workers on it: %s): %s led the stream (%s), charges flowed; %s restarted on its store after %s down, current %s after its start",
		leader, meta, on, next, elected, leader, round(down), round(current)))
	return nil
}

// stopStreamLeader SIGSTOPs the stream leader's process, waits for another node to
// lead the stream, keeps it stopped until twice the time the election took has
// passed (well beyond the election timeout that fired), then SIGCONTs it and waits
// until it is current again and charges flow. It counts the answers in which the
// resumed node still called itself leader since before its stop.
//
// Charges must also flow during the stop when a relay and a consumer worker are
// connected to other nodes. A worker connected to the stopped node is stuck with
// it: its TCP connection stays open, so its NATS client notices only by its pings
// (nats.go's default: every 2 minutes, 2 outstanding), long after the stop ends.
// When every relay or every consumer is on the stopped node, nothing can flow
// until the SIGCONT, and the fault records that instead.
func (r *run) stopStreamLeader(ctx, load context.Context) error {
	leader, _, err := r.waitStreamLeader(load, "the stream to have a leader")
	if err != nil {
		return err
	}
	n, meta := r.cluster.nats.node(leader), r.metaLeader(load)
	stuck := r.workersOn(n)
	r.logf("fault: SIGSTOP nats-server %s, the stream's leader (meta leader %s; workers connected to it: %s)", leader, meta, slotNames(stuck))
	before, err := r.ledgerRows(load)
	if err != nil {
		return err
	}
	t0 := time.Now()
	if err := n.freeze(); err != nil {
		return err
	}
	defer n.thaw() // on every path; harmless once thawed
	next, si, err := r.waitStreamLeader(load, "a new stream leader while "+leader+" is stopped", leader)
	elected := time.Since(t0) // observed: the stop lasts twice as long
	flow := "nothing could flow: every " + cutOff(r.workers, stuck) + " was connected to it"
	if err == nil && cutOff(r.workers, stuck) == "" {
		err = r.waitCharges(load, clusterFlow, "charges flowing while "+leader+" is stopped")
		flow = "charges flowed"
	}
	if err == nil {
		// The stop's length, measured against the observed election: part of the
		// fault, not a wait for some state.
		select {
		case <-time.After(time.Until(t0.Add(2 * elected))):
		case <-load.Done():
			err = load.Err()
		}
	}
	held := time.Since(t0)
	during, lerr := r.ledgerRows(load)
	if terr := n.thaw(); terr != nil {
		return errors.Join(err, terr)
	}
	if err = errors.Join(err, lerr); err != nil {
		return err
	}
	current, stale, err := r.waitCurrent(load, n, t0)
	if err == nil {
		err = r.waitCharges(load, clusterFlow, "charges flowing after "+leader+" resumed")
	}
	if err != nil {
		return err
	}
	r.cluster.mu.Lock()
	r.cluster.stale += stale
	r.cluster.mu.Unlock()
	r.record(stopNATSLeader, fmt.Sprintf("SIGSTOP stream leader %s (meta leader %s; workers on it: %s) for %s: %s led the stream (%s), %s (%d ledger rows during the stop); SIGCONT, %s current %s after it (%d answers still naming it leader), charges flowed",
		leader, meta, slotNames(stuck), round(held), next, electedAfter(si, t0, elected), flow, during-before, leader, round(current), stale))
	return nil
}

// cutOff says which role no worker outside stuck has ("relay", "consumer", or
// ""): the role nothing can do while stuck's node is stopped.
func cutOff(all, stuck []*worker) string {
	var relay, consumer bool
	for _, w := range all {
		if slices.Contains(stuck, w) {
			continue
		}
		relay = relay || strings.Contains(w.spec.roles, "relay")
		consumer = consumer || w.consumes()
	}
	switch {
	case !relay:
		return "relay"
	case !consumer:
		return "consumer"
	}
	return ""
}

// slotNames is "w1 (roles), w2 (roles)", or "none".
func slotNames(ws []*worker) string {
	if len(ws) == 0 {
		return "none"
	}
	var names []string
	for _, w := range ws {
		names = append(names, w.spec.name+" ("+w.spec.roles+")")
	}
	return strings.Join(names, ", ")
}

// rollingRestart restarts every node in turn with SIGTERM (nats-server's graceful
// shutdown hands over the groups it leads), each time waiting for a meta leader, a
// stream leader among the others and charges flowing without the node, then for
// the node to be current again on its store and for charges to flow before the
// next.
func (r *run) rollingRestart(ctx, load context.Context) error {
	for _, n := range r.cluster.nats.nodes {
		if err := r.restartNode(load, n); err != nil {
			return err
		}
	}
	return nil
}

func (r *run) restartNode(load context.Context, n *natsNode) error {
	leader, _, err := r.waitStreamLeader(load, "the stream to have a leader")
	if err != nil {
		return err
	}
	meta := r.metaLeader(load)
	r.logf("fault: rolling restart: SIGTERM nats-server %s (stream leader %s, meta leader %s)", n.name, leader, meta)
	t0 := time.Now()
	err = n.term()
	var next, nextMeta string
	if err == nil {
		nextMeta, err = r.waitMetaLeader(load, n)
	}
	if err == nil {
		next, _, err = r.waitStreamLeader(load, "a stream leader other than "+n.name, n.name)
	}
	if err == nil {
		// Two nodes of three serve on their own: a graceful shutdown hands the
		// leadership over at once, and the restart must not come before the
		// others have shown it.
		err = r.waitCharges(load, clusterFlow, "charges flowing while "+n.name+" is down")
	}
	down := time.Since(t0)
	if serr := n.start(); serr != nil {
		return errors.Join(err, serr)
	}
	if err != nil {
		return err
	}
	current, _, err := r.waitCurrent(load, n, t0)
	if err == nil {
		err = r.waitCharges(load, clusterFlow, "charges flowing after restarting "+n.name)
	}
	if err != nil {
		return err
	}
	r.record(restartNATSNode, fmt.Sprintf("SIGTERM %s (stream leader %s -> %s, meta leader %s -> %s), charges flowed, down %s, current %s after its start, charges flowed",
		n.name, leader, next, meta, nextMeta, round(down), round(current)))
	return nil
}

// waitStreamLeader waits until the stream's info ($JS.API.STREAM.INFO, through a
// node that is up) names a leader that is none of not, and returns it.
func (r *run) waitStreamLeader(ctx context.Context, what string, not ...string) (string, *jetstream.StreamInfo, error) {
	var leader string
	var info *jetstream.StreamInfo
	err := r.waitFor(ctx, clusterWait, what, func() (bool, string, error) {
		si, err := r.cluster.nats.streamInfoVia(ctx, refapp.StreamName)
		if err != nil {
			return false, err.Error(), nil
		}
		switch {
		case si.Cluster == nil || si.Cluster.Leader == "":
			return false, "the stream has no leader", nil
		case slices.Contains(not, si.Cluster.Leader):
			return false, "the stream's leader is still " + si.Cluster.Leader, nil
		}
		leader, info = si.Cluster.Leader, si
		return true, "", nil
	})
	return leader, info, err
}

// waitMetaLeader waits until a node that is up, not, sees a JetStream meta leader
// that is up too (not is down), and returns it.
func (r *run) waitMetaLeader(ctx context.Context, not *natsNode) (string, error) {
	var leader string
	err := r.waitFor(ctx, clusterWait, "a meta leader other than "+not.name, func() (bool, string, error) {
		var why []string
		for _, n := range r.cluster.nats.nodes {
			if n == not || !n.up() {
				continue
			}
			l, err := n.metaLeader(ctx)
			if err != nil {
				why = append(why, err.Error())
				continue
			}
			if m := r.cluster.nats.node(l); m != nil && m != not && m.up() {
				leader = l
				return true, "", nil
			}
			why = append(why, fmt.Sprintf("%s sees meta leader %q", n.name, l))
		}
		return false, strings.Join(why, "; "), nil
	})
	return leader, err
}

// metaLeader is the meta leader as the first node that answers sees it, for the
// log ("?" when none answers).
func (r *run) metaLeader(ctx context.Context) string {
	for _, n := range r.cluster.nats.nodes {
		if !n.up() {
			continue
		}
		if l, err := n.metaLeader(ctx); err == nil && l != "" {
			return l
		}
	}
	return "?"
}

// waitCurrent waits until node n has caught up, three polls in a row: its own
// /healthz says its meta layer and every replica it holds (the stream, both
// durable consumers) are current, and the stream's info, asked through another
// node, names n leader (elected after since) or lists it as a current replica. It
// returns how long that took, and how many answers named n leader since before
// since: a node stopped as leader and resumed answering as if it still were.
func (r *run) waitCurrent(ctx context.Context, n *natsNode, since time.Time) (time.Duration, int, error) {
	start := time.Now()
	ok, stale := 0, 0
	err := r.waitFor(ctx, clusterWait, n.name+" to be current again", func() (bool, string, error) {
		missing := r.notCurrent(ctx, n, since, &stale)
		if missing != "" {
			ok = 0
			return false, missing, nil
		}
		ok++
		return ok >= 3, "current for a moment only", nil
	})
	return time.Since(start), stale, err
}

// notCurrent says why n is not current, or "".
func (r *run) notCurrent(ctx context.Context, n *natsNode, since time.Time, stale *int) string {
	if err := n.healthz(ctx); err != nil {
		return err.Error()
	}
	si, err := r.cluster.nats.streamInfoVia(ctx, refapp.StreamName, n)
	if err != nil {
		return err.Error()
	}
	c := si.Cluster
	switch {
	case c == nil || c.Leader == "":
		return "the stream has no leader"
	case c.Leader == n.name && c.LeaderSince != nil && c.LeaderSince.Before(since):
		*stale++
		return fmt.Sprintf("%s still answers as the stream's leader since %s, from before its stop", n.name, c.LeaderSince.Format(time.RFC3339Nano))
	case c.Leader == n.name:
		return ""
	}
	for _, p := range c.Replicas {
		if p.Name == n.name {
			if p.Current && !p.Offline {
				return ""
			}
			return fmt.Sprintf("leader %s lists %s current=%v offline=%v lag=%d", c.Leader, n.name, p.Current, p.Offline, p.Lag)
		}
	}
	return fmt.Sprintf("leader %s does not list %s among its replicas", c.Leader, n.name)
}

// waitCharges waits until n more ledger rows exist than when it was called.
func (r *run) waitCharges(ctx context.Context, n int, what string) error {
	base, err := r.ledgerRows(ctx)
	if err != nil {
		return err
	}
	return r.waitFor(ctx, clusterWait, what, func() (bool, string, error) {
		rows, err := r.ledgerRows(ctx)
		if err != nil {
			return false, "", err
		}
		return rows >= base+n, fmt.Sprintf("%d of %d new ledger rows", rows-base, n), nil
	})
}

func (r *run) ledgerRows(ctx context.Context) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var n int
	if err := r.db.Pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entries`).Scan(&n); err != nil {
		return 0, fmt.Errorf("chaos: cluster: count ledger rows: %w", err)
	}
	return n, nil
}

// clusterFigures fills in what the cluster faults did, and the stream's state at
// the end: the leader's view of every replica.
func (r *run) clusterFigures(ctx context.Context, f *figures) {
	r.cluster.mu.Lock()
	f.cluster = clusterFigures{faults: slices.Clone(r.cluster.faults), stale: r.cluster.stale}
	r.cluster.mu.Unlock()
	for _, cf := range f.cluster.faults {
		f.faultsByKind[cf.kind]++
	}
	si, err := r.cluster.nats.streamInfoVia(ctx, refapp.StreamName)
	if err != nil || si.Cluster == nil {
		f.cluster.final = fmt.Sprintf("no stream info: %v", err)
		return
	}
	parts := []string{"leader " + si.Cluster.Leader}
	current := 0
	for _, p := range si.Cluster.Replicas {
		parts = append(parts, fmt.Sprintf("%s current=%v", p.Name, p.Current && !p.Offline))
		if p.Current && !p.Offline {
			current++
		}
	}
	f.cluster.final = strings.Join(parts, ", ")
	f.cluster.healed = si.Cluster.Leader != "" && current == clusterSize-1 && si.Config.Replicas == clusterSize
}

// clusterLine is the cluster run's figures line.
func (f figures) clusterLine() string {
	var descs []string
	for _, cf := range f.cluster.faults {
		descs = append(descs, cf.desc)
	}
	return fmt.Sprintf("cluster chaos: workers=3 relays=2 nodes=%d intents=%d faults=%d effects=%d duplicates_folded=%d dead_letters=%d lost=%d doubled=%d stale_leader_answers=%d at_end=[%s] cluster_faults=%q",
		clusterSize, f.intents, f.faults, f.effects, f.folded, f.deadLetters, f.lost, f.doubled, f.cluster.stale, f.cluster.final, descs)
}

// clusterMissing lists what a cluster run was to do and did not.
func (f figures) clusterMissing(cfg config) []string {
	if !cfg.cluster {
		return nil
	}
	var ps []string
	for kind, n := range map[string]int{killNATSLeader: 1, stopNATSLeader: 1, restartNATSNode: clusterSize} {
		if got := f.faultsByKind[kind]; got < n {
			ps = append(ps, fmt.Sprintf("%d of at least %d %s faults happened", got, n, kind))
		}
	}
	if !f.cluster.healed {
		ps = append(ps, "at the end the stream is not R3 with a leader and every other replica current: "+f.cluster.final)
	}
	return ps
}

func round(d time.Duration) time.Duration { return d.Round(100 * time.Millisecond) }

// electedAfter is how long after t0 the stream's leader was elected, by the
// leader_since of its info (the same machine's clock), or observed when the info
// has none. observed is coarser: a poll while no leader answers waits out its 2s
// request timeout.
func electedAfter(si *jetstream.StreamInfo, t0 time.Time, observed time.Duration) string {
	if si == nil || si.Cluster == nil || si.Cluster.LeaderSince == nil {
		return fmt.Sprintf("observed after %s", round(observed))
	}
	return fmt.Sprintf("elected %s after, observed after %s", round(si.Cluster.LeaderSince.Sub(t0)), round(observed))
}

// startCluster starts the run's cluster (startWorld, before any worker: the
// workers connect to it).
func (r *run) startCluster(ctx context.Context, dir string, ports []int) error {
	c, err := startNATSCluster(ctx, r, dir, ports)
	if err != nil {
		return err
	}
	r.cluster = &clusterState{nats: c}
	r.logf("nats-server cluster ready: %s (%s)", clusterNames(c), c.urls())
	return nil
}

func clusterNames(c *natsCluster) string {
	var ns []string
	for _, n := range c.nodes {
		ns = append(ns, n.name)
	}
	return strings.Join(ns, ",")
}
