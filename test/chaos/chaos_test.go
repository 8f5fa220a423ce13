package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/smtptest"
)

// TestChaos runs intents through the real client, ingress, outbox, relay, JetStream
// and consumers while processes are killed at random moments and at deterministic
// fault points, then checks that every intent took effect exactly once and that
// every poison message, and nothing else, is a dead letter.
func TestChaos(t *testing.T) {
	cfg := loadConfig(t)
	t.Parallel()
	cfg.name = "faults"
	f := runChaos(t, cfg)
	for _, p := range f.problems() {
		t.Errorf("chaos: %s", p)
	}
	if f.folded == 0 {
		t.Errorf("chaos: duplicates_folded=0 although %.0f%% of the intents dropped their first response: is the folding not logged any more?", cfg.dropShare*100)
	}
	for _, p := range f.missingFaults(cfg) {
		t.Errorf("chaos: %s", p)
	}
}

// TestChaosNegativeControl is the same run with the consumers' inbox claim switched
// off (IDEM_FAULTS=consumer.skip-inbox-claim=on). The checker must see doubled
// effects; if it does not, it is blind and TestChaos proves nothing.
func TestChaosNegativeControl(t *testing.T) {
	cfg := loadConfig(t)
	t.Parallel()
	if cfg.soak {
		// The control shows the checker can see a failure; it need not soak.
		cfg = cfg.shortSized()
	}
	cfg.name, cfg.negative = "negative-control", true
	f := runChaos(t, cfg)
	if f.doubled == 0 {
		t.Errorf("chaos: negative control reported doubled=0 with the inbox claim off: the checker cannot see a double effect")
	}
	if f.lost > 0 {
		t.Errorf("chaos: negative control lost %d intents: switching the claim off must double effects, never lose them", f.lost)
	}
	for _, p := range f.missingFaults(cfg) {
		t.Errorf("chaos: %s", p)
	}
}

// config is one run's size and schedule.
type config struct {
	name         string
	seed         uint64
	intents      int           // presses over all lanes
	duration     time.Duration // length of the load phase
	lanes        int           // client devices, one journal each
	randomFaults int           // faults injected at random moments
	armPerSlot   int           // fault-point incarnations per worker slot (-1: re-arm on restarts)
	maxK         int           // fault points fire at a random @K in [2, maxK]
	dropShare    float64       // share of intents sent with --drop-response
	emailShare   float64       // share of intents that are emails (the rest are charges)
	copies       int           // re-published copies of intents (must be folded)
	burst        int           // charges published straight to the stream around the marked messages
	outages      int           // Postgres outages of 15-20s during the load
	oversize     int           // presses with a body the broker could never carry (must get 413)
	rawOversize  int           // outbox rows over max_payload written around Enqueue (must become relay dead letters)
	settle       time.Duration // deadline for the run to come to rest after the load
	// panicDeadLetter: the run waits for the panicking message's dead letter. Its
	// ten attempts are spaced by the consumer's default backoff (1s doubling to
	// 1m: about four minutes in all), longer than the whole short run, which
	// therefore checks that it is still being retried, charged, and never took
	// effect; a soak waits for the dead letter.
	panicDeadLetter bool
	soak            bool
	negative        bool

	// The store runs (store_test.go) set these; their zero values are the other
	// runs'.
	natsSyncDefault bool          // nats-server at JetStream's default sync interval, not sync_interval: always
	reconcileAfter  string        // the workers' --reconcile-after ("": the worker's default; "off": no reconciler)
	storeFaults     int           // JetStream store damages during the load: wipe, truncate and live wipe in turn (storefault_test.go)
	noInjections    bool          // no messages published straight to the stream: no poison, marked messages, burst or copies; no raw outbox rows
	slots           []workerSpec  // the worker topology (nil: topology())
	lossControl     bool          // the run must lose intents: settle waits for quiescence, not for every effect
	holdFor         time.Duration // (store runs) how long the consumers may stay down for a backlog to build

	// The cluster runs (cluster_test.go) set these.
	cluster   bool          // three nats-server nodes, an R3 stream, the cluster faults; the load stops when they are over
	faultsFor time.Duration // (cluster soak) rounds of cluster faults start until this much of the load has passed
}

// topology is the run's worker slots.
func (c config) topology() []workerSpec {
	if c.slots != nil {
		return c.slots
	}
	return topology()
}

// awaitsProof: the run's relays have a reconciler, and the run waits for it to
// prove every published intent settled.
func (c config) awaitsProof() bool { return c.storeFaults > 0 && c.reconcileAfter != "off" }

// ackWait is the consumers' AckWait (worker --ack-wait): short, so that a batch
// held by a killed worker, and the message that kills its worker every time, come
// back quickly. The worker checks at start that the inbox lifetime (72h) still
// outlasts the redelivery horizon it implies.
const ackWait = 3 * time.Second

// outageMin and outageMax bound a Postgres outage.
const outageMin, outageMax = 15 * time.Second, 20 * time.Second

// loadConfig reads the environment: IDEM_CHAOS_SEED replays a schedule;
// IDEM_CHAOS_INTENTS and IDEM_CHAOS_DURATION turn the run into a soak;
// IDEM_CHAOS_LANES, IDEM_CHAOS_FAULTS, IDEM_CHAOS_OUTAGES (Postgres outages) and
// IDEM_CHAOS_SETTLE (the deadline for the run to come to rest) tune it; IDEM_CHAOS_LOGDIR keeps the processes' logs. It
// skips under -short.
func loadConfig(t *testing.T) config {
	if testing.Short() {
		t.Skip("chaos: skipped under -short: builds the worker, the client and nats-server and runs real processes under faults for about a minute")
	}
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	c := config{intents: 300, duration: shortDuration, lanes: 6, armPerSlot: 1, maxK: 40, dropShare: 0.2, emailShare: 0.25,
		outages: 1, oversize: 3, rawOversize: 2}
	envInt := func(name string, dst *int) {
		if v := os.Getenv(name); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n <= 0 {
				t.Fatalf("chaos: %s=%q: want a positive integer", name, v)
			}
			*dst = n
		}
	}
	if v := os.Getenv("IDEM_CHAOS_INTENTS"); v != "" {
		envInt("IDEM_CHAOS_INTENTS", &c.intents)
		c.soak = true
	}
	if v := os.Getenv("IDEM_CHAOS_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 5*time.Second {
			t.Fatalf("chaos: IDEM_CHAOS_DURATION=%q: want a duration of at least 5s", v)
		}
		c.duration, c.soak = d, true
	}
	if c.soak {
		c.lanes, c.armPerSlot, c.maxK = 8, -1, 100
		c.outages = max(1, int(c.duration/(5*time.Minute)))
		c.oversize = max(3, int(c.duration/time.Minute)*2)
		c.rawOversize = 3
		c.panicDeadLetter = true
	}
	envInt("IDEM_CHAOS_LANES", &c.lanes)
	if v := os.Getenv("IDEM_CHAOS_OUTAGES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			t.Fatalf("chaos: IDEM_CHAOS_OUTAGES=%q: want a count, 0 or more", v)
		}
		c.outages = n
	}
	c.randomFaults = max(int(numFaultKinds)+2, int(c.duration/(4*time.Second)))
	envInt("IDEM_CHAOS_FAULTS", &c.randomFaults)
	if v := os.Getenv("IDEM_CHAOS_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("chaos: IDEM_CHAOS_SEED=%q: %v", v, err)
		}
		c.seed = s
	} else {
		c.seed = uint64(time.Now().UnixNano())
	}
	c.copies = max(10, c.intents/50)
	c.burst = max(40, c.intents/100)
	c.settle = c.settleDeadline()
	if v := os.Getenv("IDEM_CHAOS_SETTLE"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("chaos: IDEM_CHAOS_SETTLE=%q: want a positive duration", v)
		}
		c.settle = d
	}
	return c
}

// shortDuration is the load phase of the short run: long enough for an outage of
// 15-20s to fall in its middle with load on either side.
const shortDuration = 30 * time.Second

// shortSized is c at the size of the default run, with c's seed.
func (c config) shortSized() config {
	c.intents, c.duration, c.lanes, c.armPerSlot, c.maxK = 300, shortDuration, 6, 1, 40
	c.randomFaults = int(numFaultKinds) + 2
	c.copies, c.burst = 10, 40
	c.outages, c.oversize, c.rawOversize = 1, 3, 2
	c.soak, c.panicDeadLetter = false, false
	c.settle = c.settleDeadline()
	return c
}

// settleDeadline is how long the run may take to come to rest after the load: room
// for a few redeliveries after the ack wait, an email lease (30s) left by a killed
// worker and, when the run waits for it, the whole backoff of the panicking message
// (injected early in the load) with an outage on top.
func (c config) settleDeadline() time.Duration {
	d := 2*time.Minute + c.duration/4
	if c.panicDeadLetter {
		d = max(d, panicHorizon()+2*time.Minute+time.Duration(c.outages)*outageMax-c.duration*3/4)
	}
	return d
}

// panicHorizon is how long a message whose handler always fails takes to be
// dead-lettered from its first delivery: the consumer's default backoff after
// each of its MaxDeliver-1 failed attempts, and an ack wait each.
func panicHorizon() time.Duration {
	var d time.Duration
	for n := 1; n < consumer.DefaultMaxDeliver; n++ {
		d += consumer.DefaultBackoff(n) + ackWait
	}
	return d
}

// run is one chaos run: its processes, its database, its schedule and its counts.
type run struct {
	t     *testing.T
	cfg   config
	dir   string
	start time.Time
	rng   *rand.Rand // the seed's stream; every goroutine gets a child of its own
	procs *procs
	pg    *privatePG // the run's own Postgres cluster
	db    *chaosDB   // the run's database in it
	nats  *natsServer
	nc    *nats.Conn // the checker's own connection (poison, copies, consumer info)
	js    jetstream.JetStream
	smtp  *smtptest.Server // the mail sink the email consumers send to

	cluster *clusterState // instead of nats in a cluster run (cluster_test.go)

	workers  []*worker
	lanes    []*lane
	oversize *lane            // the presses whose body the broker could never carry
	plan     map[string]press // by account, one per press
	events   []event          // the random-moment faults and the outages
	faults   faultCounts

	// Set by the injections, read after they finished.
	poison []poison
	copied map[string]bool // keys of intents whose message was published again
	direct []directCharge  // charges published straight to the stream

	storeMu sync.Mutex
	damage  []storeDamage // what the store faults did (storefault_test.go)
}

// logf logs with the time since the run started.
func (r *run) logf(format string, args ...any) {
	r.t.Logf("[%s %6.2fs] %s", r.cfg.name, time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
}

// child is a new random stream drawn from the seed's. Children are drawn in a fixed
// order during set-up, so a seed replays the same schedule.
func (r *run) child() *rand.Rand { return rand.New(rand.NewPCG(r.rng.Uint64(), r.rng.Uint64())) }

// ingressURL picks one of the ingress workers.
func (r *run) ingressURL(rng *rand.Rand) string {
	var ws []*worker
	for _, w := range r.workers {
		if w.ingress() {
			ws = append(ws, w)
		}
	}
	return ws[rng.IntN(len(ws))].url()
}

// runChaos runs one whole scenario: start the world, drive the load under faults,
// let the clients finish, wait for the run to settle, check. It prints the figures
// line and returns the figures; the caller decides what must hold.
func runChaos(t *testing.T, cfg config) figures {
	r := &run{t: t, cfg: cfg, dir: t.TempDir(), start: time.Now(), rng: rand.New(rand.NewPCG(splitmix(cfg.seed), splitmix(^cfg.seed)))}
	r.logf("seed=%d (replay the schedule with IDEM_CHAOS_SEED=%d) intents=%d duration=%s lanes=%d random_faults=%d",
		cfg.seed, cfg.seed, cfg.intents, cfg.duration, cfg.lanes, cfg.randomFaults)
	logDir := filepath.Join(r.dir, "logs")
	if v := os.Getenv("IDEM_CHAOS_LOGDIR"); v != "" {
		logDir = filepath.Join(v, fmt.Sprintf("%s-%d", cfg.name, cfg.seed)) // kept after the test
	}
	r.procs = newProcs(t, logDir)
	r.logf("logs in %s", logDir)

	// ctx lives as long as the run; load ends with the load phase (no more faults,
	// restarted workers come up unarmed).
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	load, endLoad := context.WithCancel(ctx)
	defer endLoad()

	if err := r.startWorld(ctx, load); err != nil {
		t.Fatal(err)
	}
	if err := r.planLoad(); err != nil {
		t.Fatal(err)
	}
	for _, err := range r.driveLoad(ctx, load, endLoad) {
		t.Errorf("chaos: %v", err)
	}
	lines, big, errs := r.finishJournals(ctx)
	for _, err := range errs {
		t.Errorf("chaos: %v", err)
	}
	j := newJournal(lines)
	j.oversize = big
	for _, d := range r.direct {
		j.direct = append(j.direct, d.key)
	}
	// The charges published straight to the stream are intents too: each must
	// take effect exactly once.
	j.charges = append(j.charges, j.direct...)
	r.logf("journals finished: %d intents (%d charges, %d emails) from %d presses; %d oversize presses; %d charges published straight to the stream",
		len(j.lines), len(j.charges)-len(j.direct), len(j.emails), cfg.intents, len(j.oversize), len(j.direct))

	settleStart := time.Now()
	if err := r.settle(ctx, j); err != nil {
		t.Errorf("chaos: %v", err) // the checker still runs: it says what is missing
	} else {
		r.logf("settled in %s", time.Since(settleStart).Round(time.Millisecond))
	}

	f, err := r.check(ctx, j)
	if err != nil {
		t.Fatalf("chaos: check: %v", err)
	}
	r.logf("faults by kind: %v", f.faultsByKind)
	r.logf("duplicates folded: %d ingress replays + %d inbox folds (%d copies were published) + %d mail re-sends with the same Message-ID (%d raw mails for %d emails); dead letters: %d (%d poison injected) %v",
		f.replays, f.folds, len(r.copied), f.resends, f.smtpDeliveries, f.emails, f.deadLetters, len(r.poison), f.deadByConsumer)
	for _, s := range f.marked {
		r.logf("marked: %s", s)
	}
	r.logf("oversize: %d presses rejected with 413 and without effect; %d raw outbox rows over max_payload dead-lettered by the relay", f.rejected, f.rawDead)
	if f.relayCharged > 0 {
		r.logf("relay: %d rows were published only after failed publishes charged to them (at most %d publishes)", f.relayCharged, f.relayMostTries)
	}
	if f.doubled > 0 {
		r.logf("doubled intents by cause: %v", f.doubledBy)
	}
	store := ""
	if cfg.storeFaults > 0 {
		for _, sf := range f.store.damage {
			r.logf("store: %s", sf)
		}
		if len(f.store.stuck) > 0 {
			r.logf("store: %d consumer subscriptions stopped for good after a failed recreate (%d of them in incarnations still running at the end; the other workers did their work): %s",
				len(f.store.stuck), f.store.stuckAtEnd, strings.Join(f.store.stuck, "; "))
		}
		store = f.storeLine() + "\n"
	}
	if cfg.cluster {
		store += f.clusterLine() + "\n"
	}
	// One write, so the lines stay together when several tests print at once.
	fmt.Printf("chaos: run=%s seed=%d elapsed=%s\n%s\n%s", cfg.name, cfg.seed, time.Since(r.start).Round(time.Second), f, store)
	t.Log(f.String())
	if cfg.storeFaults > 0 {
		t.Log(f.storeLine())
	}
	if cfg.cluster {
		t.Log(f.clusterLine())
	}
	return f
}

// startWorld starts the run's Postgres, nats-server, the checker's connection and
// the supervised workers, and waits until every worker is ready.
func (r *run) startWorld(ctx, load context.Context) error {
	nPorts := 2 + len(r.cfg.topology())
	if r.cfg.cluster {
		nPorts += clusterSize*portsPerNode - 1 // the first node's client port is ports[0]
	}
	ports, err := freePorts(nPorts) // all at once, so no two of ours collide
	if err != nil {
		return err
	}
	pgStart := time.Now()
	r.pg, r.db, err = startPG(ctx, r.procs, filepath.Join(r.dir, "postgres"), ports[len(ports)-1])
	if r.pg != nil {
		// Runs after the supervisors have stopped the workers (cleanups run
		// last-registered first).
		r.t.Cleanup(func() {
			if err := r.pg.shutdown(context.Background()); err != nil {
				r.t.Logf("chaos: %v", err)
			}
		})
	}
	if err != nil {
		return err
	}
	r.t.Cleanup(r.db.Pool.Close)
	r.logf("private Postgres ready in %s (port %d)", time.Since(pgStart).Round(100*time.Millisecond), ports[len(ports)-1])
	if r.cfg.cluster {
		natsPorts := append([]int{ports[0]}, ports[1+len(r.cfg.topology()):len(ports)-1]...)
		if err := r.startCluster(ctx, filepath.Join(r.dir, "nats"), natsPorts); err != nil {
			return err
		}
	} else if r.nats, err = startNATS(r.procs, filepath.Join(r.dir, "nats"), ports[0], r.cfg.natsSyncDefault); err != nil {
		return err
	}
	if r.cfg.natsSyncDefault {
		r.logf("nats-server at JetStream's default sync interval (no sync_interval: always)")
	}
	r.nc, err = nats.Connect(r.natsURL(), nats.Name("idem-chaos-checker"), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		return fmt.Errorf("chaos: connect to nats-server: %w", err)
	}
	r.t.Cleanup(r.nc.Close)
	if r.js, err = jetstream.New(r.nc); err != nil {
		return fmt.Errorf("chaos: jetstream: %w", err)
	}
	if r.smtp, err = smtptest.New(); err != nil {
		return err
	}
	r.t.Cleanup(r.smtp.Close)

	for i, spec := range r.cfg.topology() {
		w, err := newWorker(r, spec, ports[1+i], r.child())
		if err != nil {
			return err
		}
		r.workers = append(r.workers, w)
	}
	sctx, stopSupervisors := context.WithCancel(ctx)
	var supervisors sync.WaitGroup
	for _, w := range r.workers {
		supervisors.Add(1)
		go func() { defer supervisors.Done(); w.supervise(sctx, load) }()
	}
	// Runs before the database is dropped (cleanups run last-registered first).
	r.t.Cleanup(func() {
		stopSupervisors() // each kills its worker and returns
		supervisors.Wait()
	})
	err = r.waitFor(ctx, time.Minute, "every worker to be ready", func() (bool, string, error) {
		var down []string
		for _, w := range r.workers {
			if !w.ready(ctx) {
				down = append(down, w.spec.name)
			}
		}
		return len(down) == 0, "not ready: " + strings.Join(down, ","), nil
	})
	if err != nil {
		return err
	}
	r.logf("nats-server and %d workers ready", len(r.workers))
	if line := r.procs.firstLine("worker-w1", "key lifetimes checked"); line != "" {
		r.logf("w1 at start: %s", line)
	}
	return nil
}

// planLoad draws the presses (spread evenly over the load phase, round-robin over
// the lanes) and the fault schedule from the seed.
func (r *run) planLoad() error {
	r.plan = map[string]press{}
	perLane := make([][]press, r.cfg.lanes)
	for i := range r.cfg.intents {
		ln := i % r.cfg.lanes
		p := press{
			at:      r.cfg.duration * time.Duration(i) / time.Duration(r.cfg.intents),
			email:   r.rng.Float64() < r.cfg.emailShare,
			account: fmt.Sprintf("acct-%02d-%06d", ln, i),
			cents:   100 + r.rng.Int64N(99_900),
			drop:    r.rng.Float64() < r.cfg.dropShare,
		}
		r.plan[p.account] = p
		perLane[ln] = append(perLane[ln], p)
	}
	for i := range r.cfg.lanes {
		l, err := newLane(r, i, perLane[i], r.child())
		if err != nil {
			return err
		}
		r.lanes = append(r.lanes, l)
	}
	big, err := newLane(r, r.cfg.lanes, nil, r.child())
	if err != nil {
		return err
	}
	r.oversize = big
	r.events = planFaults(r.child(), r.cfg.randomFaults, r.cfg.duration, len(r.workers), len(r.lanes))
	r.events = append(r.events, planOutages(r.child(), r.cfg.outages, r.cfg.duration)...)
	if r.cfg.storeFaults > 0 {
		r.events = append(r.events, planStoreFaults(r.child(), r.cfg.storeFaults, r.cfg.duration)...)
	}
	slices.SortFunc(r.events, func(a, b event) int { return int(a.at - b.at) })
	for _, e := range r.events {
		r.logf("schedule: %s", e)
	}
	return nil
}

// driveLoad runs the lanes, the oversize presses, the fault schedule and the poison
// injections side by side, and returns when the lanes have made every press.
func (r *run) driveLoad(ctx, load context.Context, endLoad func()) []error {
	poisonRNG, markedRNG := r.child(), r.child()
	poisonAt := r.cfg.duration/4 + time.Duration(r.rng.Int64N(int64(r.cfg.duration/2)))
	// The marked messages go early: the one that kills its worker needs ten ack
	// waits to use up its attempts, the panicking one ten backoffs.
	markedAt := r.cfg.duration/20 + time.Duration(r.rng.Int64N(int64(r.cfg.duration/20)))
	bigAt := make([]time.Duration, r.cfg.oversize)
	for i := range bigAt {
		bigAt[i] = r.cfg.duration * time.Duration(2*i+1) / time.Duration(2*len(bigAt))
	}
	if !r.cfg.noInjections {
		r.logf("schedule: @%s marked messages (Idem-Fault: panic, kill) in a burst of %d charges", markedAt.Round(time.Millisecond), r.cfg.burst)
		r.logf("schedule: @%s poison, copies and %d raw oversize outbox rows", poisonAt.Round(time.Millisecond), r.cfg.rawOversize)
	}
	if len(bigAt) > 0 {
		r.logf("schedule: oversize presses (%d bytes) at %v", oversizeBodyBytes, bigAt)
	}

	var errs errList
	start := time.Now()
	var lanes, others sync.WaitGroup
	if r.cfg.cluster {
		// The load runs until the cluster faults are over: the lanes stop at their
		// next press once clusterFaults returns.
		faultsOver := make(chan struct{})
		for _, l := range r.lanes {
			l.until = faultsOver
		}
		others.Add(1)
		go func() {
			defer others.Done()
			defer close(faultsOver)
			errs.add(r.clusterFaults(ctx, load, start))
		}()
	}
	for _, l := range r.lanes {
		lanes.Add(1)
		go func() { defer lanes.Done(); errs.add(l.runLoad(ctx, start)) }()
	}
	lanes.Add(1)
	go func() { defer lanes.Done(); errs.add(r.oversize.runOversize(ctx, start, bigAt)) }()
	var mu sync.Mutex
	r.copied = map[string]bool{}
	injected := func(ps []poison, copied map[string]bool, err error) {
		errs.add(err)
		mu.Lock()
		defer mu.Unlock()
		r.poison = append(r.poison, ps...)
		for k := range copied {
			r.copied[k] = true
		}
	}
	injectedDirect := func(ps []poison, direct []directCharge, err error) {
		injected(ps, nil, err)
		mu.Lock()
		defer mu.Unlock()
		r.direct = append(r.direct, direct...)
		for _, d := range direct {
			r.plan[d.account] = press{account: d.account, cents: d.cents}
		}
	}
	at := func(d time.Duration, fn func()) {
		defer others.Done()
		select {
		case <-time.After(time.Until(start.Add(d))):
			fn()
		case <-ctx.Done():
		}
	}
	others.Add(1)
	go func() { defer others.Done(); errs.add(r.inject(ctx, load, start, r.events)) }()
	if !r.cfg.noInjections {
		others.Add(2)
		go at(poisonAt, func() { injected(r.injectPoison(ctx, poisonRNG)) })
		go at(markedAt, func() { injectedDirect(r.injectMarked(ctx, markedRNG)) })
	}
	lanes.Wait()
	endLoad()
	others.Wait()
	r.logf("load done in %s; finishing the journals", time.Since(start).Round(time.Millisecond))
	return errs.list()
}

// finishJournals has every lane resume until its journal is done, then lists it
// through the client; the oversize presses' journal comes back apart.
func (r *run) finishJournals(ctx context.Context) ([]intentLine, []intentLine, []error) {
	fctx, cancel := context.WithTimeout(ctx, r.cfg.settle)
	defer cancel()
	var (
		errs    errList
		mu      sync.Mutex
		journal []intentLine
		wg      sync.WaitGroup
	)
	for _, l := range r.lanes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs.add(l.finish(fctx))
			lines, err := l.list(ctx)
			errs.add(err)
			mu.Lock()
			journal = append(journal, lines...)
			mu.Unlock()
		}()
	}
	var big []intentLine
	wg.Add(1)
	go func() {
		defer wg.Done()
		errs.add(r.oversize.finishOversize(fctx))
		var err error
		big, err = r.oversize.list(ctx)
		errs.add(err)
	}()
	wg.Wait()
	return journal, big, errs.list()
}

// errList collects errors from goroutines.
type errList struct {
	mu   sync.Mutex
	errs []error
}

func (e *errList) add(err error) {
	if err != nil {
		e.mu.Lock()
		e.errs = append(e.errs, err)
		e.mu.Unlock()
	}
}

func (e *errList) list() []error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]error(nil), e.errs...)
}

// splitmix scrambles a seed, so that seeds close to each other (two runs started in
// the same second) still draw unrelated schedules.
func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// freePorts reserves n distinct loopback ports and releases them for the children.
// They are drawn below the kernel's ephemeral range: a worker killed and restarted
// binds its port again, and an ephemeral port can meanwhile be taken as the local end
// of some outgoing connection (any test's), which would keep the restarted worker
// from listening for as long as that connection lives.
func freePorts(n int) ([]int, error) {
	low := ephemeralLow()
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	ports := make([]int, 0, n)
	for tries := 0; len(ports) < n; tries++ {
		if tries > 1000 {
			return nil, fmt.Errorf("chaos: no %d free ports below %d", n, low)
		}
		port := 20000 + rand.IntN(max(low-20000, 1000))
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue // taken: draw another
		}
		ls = append(ls, l)
		ports = append(ports, port)
	}
	return ports, nil
}

// ephemeralLow is the first port of the kernel's ephemeral range (Linux's default
// is 32768).
func ephemeralLow() int {
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil && v > 21000 {
				return v
			}
		}
	}
	return 32768
}
