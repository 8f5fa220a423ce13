package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/smtptest"
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
	settle       time.Duration // deadline for the run to come to rest after the load
	soak         bool
	negative     bool
}

// loadConfig reads the environment: IDEM_CHAOS_SEED replays a schedule;
// IDEM_CHAOS_INTENTS and IDEM_CHAOS_DURATION turn the run into a soak;
// IDEM_CHAOS_LANES, IDEM_CHAOS_FAULTS and IDEM_CHAOS_SETTLE (the deadline for the
// run to come to rest) tune it; IDEM_CHAOS_LOGDIR keeps the processes' logs. It
// skips under -short.
func loadConfig(t *testing.T) config {
	if testing.Short() {
		t.Skip("chaos: skipped under -short: builds the worker, the client and nats-server and runs real processes under faults for about a minute")
	}
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	c := config{intents: 300, duration: 20 * time.Second, lanes: 6, armPerSlot: 1, maxK: 40, dropShare: 0.2, emailShare: 0.25}
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
	}
	envInt("IDEM_CHAOS_LANES", &c.lanes)
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
	// The consumer's AckWait is 30s: a batch taken by a worker that died is
	// redelivered only then. The deadline leaves room for a few of those in a row.
	c.settle = 2*time.Minute + c.duration/4
	if v := os.Getenv("IDEM_CHAOS_SETTLE"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("chaos: IDEM_CHAOS_SETTLE=%q: want a positive duration", v)
		}
		c.settle = d
	}
	return c
}

// shortSized is c at the size of the default run, with c's seed.
func (c config) shortSized() config {
	c.intents, c.duration, c.lanes, c.armPerSlot, c.maxK = 300, 20*time.Second, 6, 1, 40
	c.randomFaults = int(numFaultKinds) + 2
	c.copies = 10
	c.settle = 2*time.Minute + c.duration/4
	c.soak = false
	return c
}

// run is one chaos run: its processes, its database, its schedule and its counts.
type run struct {
	t     *testing.T
	cfg   config
	dir   string
	start time.Time
	rng   *rand.Rand // the seed's stream; every goroutine gets a child of its own
	procs *procs
	db    *pgtest.DB
	nats  *natsServer
	nc    *nats.Conn // the checker's own connection (poison, copies, consumer info)
	js    jetstream.JetStream
	smtp  *smtptest.Server // the mail sink the email consumers send to

	workers []*worker
	lanes   []*lane
	plan    map[string]press // by account, one per press
	events  []event          // the random-moment faults
	faults  faultCounts

	// Set by injectPoison, read after it finished.
	poison []poison
	copied map[string]bool // keys of intents whose message was published again
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
	r.db = pgtest.New(t)

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
	lines, errs := r.finishJournals(ctx)
	for _, err := range errs {
		t.Errorf("chaos: %v", err)
	}
	j := newJournal(lines)
	r.logf("journals finished: %d intents (%d charges, %d emails) from %d presses", len(j.lines), len(j.charges), len(j.emails), cfg.intents)

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
	r.logf("duplicates folded: %d ingress replays + %d inbox folds (%d copies were published) + %d mail re-sends with the same Message-ID (%d raw mails for %d emails); dead letters: %d (%d poison published)",
		f.replays, f.folds, len(r.copied), f.resends, f.smtpDeliveries, f.emails, f.deadLetters, len(r.poison))
	if f.doubled > 0 {
		r.logf("doubled intents by cause: %v", f.doubledBy)
	}
	// One write, so the two lines stay together when both tests print at once.
	fmt.Printf("chaos: run=%s seed=%d elapsed=%s\n%s\n", cfg.name, cfg.seed, time.Since(r.start).Round(time.Second), f)
	t.Log(f.String())
	return f
}

// startWorld starts nats-server, the checker's connection and the supervised
// workers, and waits until every worker is ready.
func (r *run) startWorld(ctx, load context.Context) error {
	ports, err := freePorts(1 + len(topology())) // all at once, so no two of ours collide
	if err != nil {
		return err
	}
	if r.nats, err = startNATS(r.procs, filepath.Join(r.dir, "nats"), ports[0]); err != nil {
		return err
	}
	r.nc, err = nats.Connect(r.nats.URL(), nats.Name("idem-chaos-checker"), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
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

	for i, spec := range topology() {
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
	r.events = planFaults(r.child(), r.cfg.randomFaults, r.cfg.duration, len(r.workers), len(r.lanes))
	for _, e := range r.events {
		r.logf("schedule: %s", e)
	}
	return nil
}

// driveLoad runs the lanes, the fault schedule and the poison injection side by
// side, and returns when the lanes have made every press.
func (r *run) driveLoad(ctx, load context.Context, endLoad func()) []error {
	poisonRNG := r.child()
	poisonAt := r.cfg.duration/4 + time.Duration(r.rng.Int64N(int64(r.cfg.duration/2)))
	r.logf("schedule: @%s poison and copies", poisonAt.Round(time.Millisecond))

	var errs errList
	start := time.Now()
	var lanes, others sync.WaitGroup
	for _, l := range r.lanes {
		lanes.Add(1)
		go func() { defer lanes.Done(); errs.add(l.runLoad(ctx, start)) }()
	}
	others.Add(2)
	go func() { defer others.Done(); errs.add(r.inject(load, start, r.events)) }()
	go func() {
		defer others.Done()
		select {
		case <-time.After(time.Until(start.Add(poisonAt))):
			errs.add(r.injectPoison(ctx, poisonRNG))
		case <-ctx.Done():
		}
	}()
	lanes.Wait()
	endLoad()
	others.Wait()
	r.logf("load done in %s; finishing the journals", time.Since(start).Round(time.Millisecond))
	return errs.list()
}

// finishJournals has every lane resume until its journal is done, then lists it
// through the client.
func (r *run) finishJournals(ctx context.Context) ([]intentLine, []error) {
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
	wg.Wait()
	return journal, errs.list()
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
