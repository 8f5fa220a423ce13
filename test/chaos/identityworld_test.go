package chaos

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/wire"
)

// The identity cases (identity_test.go) run the purpose-built worker idworker
// (./idworker): a topology of their own over the stream idStream, with an effect
// that is one row of chaos_effects per delivery. This file is their world: a
// private Postgres (a database per installation), a nats-server, supervised
// idworker slots, and the checker.

// idStream is the identity cases' stream; idSubjects its subjects.
const (
	idStream   = "CHAOSID"
	idSubjects = "id.>"
)

// idAckWait is the identity workers' AckWait: a batch held by a killed worker comes
// back after it.
const idAckWait = 2 * time.Second

// idSettle is how long an identity case waits for a state before it gives up and
// lets the checker count what is missing.
const idSettle = 90 * time.Second

// idSchema is the effect table (no unique constraint: a second effect is a second
// row) and the keys whose handler fails, created in every installation's database.
const idSchema = `
CREATE TABLE chaos_effects (
  id       bigserial PRIMARY KEY,
  consumer text NOT NULL,
  key      text NOT NULL,
  message  text NOT NULL,
  payload  bytea,
  at       timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE chaos_broken (key text PRIMARY KEY);`

// idConfig is what the environment says of an identity case: skipped under
// -short, the seed (IDEM_CHAOS_SEED), where logs go (IDEM_CHAOS_LOGDIR).
func idConfig(t *testing.T) uint64 {
	if testing.Short() {
		t.Skip("chaos: skipped under -short: builds binaries and runs real processes under faults")
	}
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	if v := os.Getenv("IDEM_CHAOS_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("chaos: IDEM_CHAOS_SEED=%q: %v", v, err)
		}
		return s
	}
	return uint64(time.Now().UnixNano())
}

// idWorld is one identity case: its processes, its databases and its counts.
type idWorld struct {
	t        *testing.T
	name     string
	seed     uint64
	rng      *rand.Rand
	start    time.Time
	dir      string
	procs    *procs
	pg       *privatePG
	dbs      []*chaosDB // one per installation: idem_chaos, then idem_chaos_b
	nats     *natsServer
	nc       *nats.Conn
	js       jetstream.JetStream
	switches string // the negative control's switch, armed in every incarnation of every slot

	ctx      context.Context // lives as long as the case
	slots    []*idSlot
	durables []string // the durable consumers the case waits on

	mu    sync.Mutex
	kills map[string]int // SIGKILLs from outside, by kind (random, hold)
}

// newIDWorld starts a case's Postgres (with installations databases), its
// nats-server and the checker's connection. A negative control passes the switch
// it arms in every worker it starts.
func newIDWorld(t *testing.T, name string, installations int, negative bool, switchPoint faults.Point) *idWorld {
	seed := idConfig(t)
	if negative {
		name += "-negative-control"
	}
	w := &idWorld{t: t, name: name, seed: seed, start: time.Now(), dir: t.TempDir(),
		rng: rand.New(rand.NewPCG(splitmix(seed), splitmix(^seed))), kills: map[string]int{}}
	if negative && switchPoint != "" {
		w.switches = string(switchPoint) + "=on"
	}
	logDir := filepath.Join(w.dir, "logs")
	if v := os.Getenv("IDEM_CHAOS_LOGDIR"); v != "" {
		logDir = filepath.Join(v, fmt.Sprintf("%s-%d", name, seed))
	}
	w.procs = newProcs(t, logDir)
	w.logf("seed=%d (replay with IDEM_CHAOS_SEED=%d); in every worker: IDEM_FAULTS=%s; logs in %s", seed, seed, w.switches, logDir)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	w.ctx = ctx

	ports, err := freePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	pg, db, err := startPG(ctx, w.procs, filepath.Join(w.dir, "postgres"), ports[1])
	if pg != nil {
		w.pg = pg
		t.Cleanup(func() {
			if err := pg.shutdown(context.Background()); err != nil {
				t.Logf("chaos: %v", err)
			}
		})
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Pool.Close)
	w.dbs = append(w.dbs, db)
	for i := 1; i < installations; i++ {
		other, err := w.createDatabase(ctx, fmt.Sprintf("%s_%c", databaseName, 'a'+i))
		if err != nil {
			t.Fatal(err)
		}
		w.dbs = append(w.dbs, other)
	}
	for _, db := range w.dbs {
		if _, err := db.Pool.Exec(ctx, idSchema); err != nil {
			t.Fatalf("chaos: create the effect table in %s: %v", db.Name, err)
		}
	}
	if w.nats, err = startNATS(w.procs, filepath.Join(w.dir, "nats"), ports[0], false); err != nil {
		t.Fatal(err)
	}
	w.nc, err = nats.Connect(w.nats.URL(), nats.Name("idem-chaos-checker"), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatalf("chaos: connect to nats-server: %v", err)
	}
	t.Cleanup(w.nc.Close)
	if w.js, err = jetstream.New(w.nc); err != nil {
		t.Fatal(err)
	}
	w.logf("Postgres (%d databases) and nats-server ready", len(w.dbs))
	return w
}

// createDatabase creates another installation's database in the case's cluster
// and migrates idem's tables into it.
func (w *idWorld) createDatabase(ctx context.Context, name string) (*chaosDB, error) {
	if _, err := w.pg.exec(ctx, "CREATE DATABASE "+name); err != nil {
		return nil, err
	}
	db, err := w.openDatabase(ctx, name)
	if err != nil {
		return nil, err
	}
	if _, err := migrations.Apply(ctx, db.Pool, migrations.Config{}); err != nil {
		return nil, fmt.Errorf("chaos: migrate %s: %w", name, err)
	}
	return db, nil
}

// copyDatabase makes name a physical copy of the first installation's database
// (CREATE DATABASE ... TEMPLATE: a file copy inside the cluster, as a restored base
// backup or a snapshot is one of the whole cluster). Nothing may be connected to
// the original meanwhile: the caller holds its workers down; the checker's
// connections are closed here, and leftovers of killed processes ended.
func (w *idWorld) copyDatabase(ctx context.Context, name string) (*chaosDB, error) {
	w.dbs[0].Pool.Reset()
	src := w.dbs[0].Name
	err := w.waitFor(time.Minute, "no connection to "+src, func() (bool, string, error) {
		if _, err := w.pg.exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '"+src+"' AND pid <> pg_backend_pid()"); err != nil {
			return false, "", err
		}
		_, err := w.pg.exec(ctx, "CREATE DATABASE "+name+" TEMPLATE "+src)
		return err == nil, fmt.Sprint(err), nil
	})
	if err != nil {
		return nil, err
	}
	return w.openDatabase(ctx, name)
}

// openDatabase opens the checker's pool on the database name of the case's
// cluster.
func (w *idWorld) openDatabase(ctx context.Context, name string) (*chaosDB, error) {
	u, err := url.Parse(w.dbs[0].URL)
	if err != nil {
		return nil, err
	}
	u.Path = "/" + name
	db := &chaosDB{URL: u.String(), Name: name}
	pcfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		return nil, err
	}
	pcfg.MaxConns = 4
	pcfg.ConnConfig.RuntimeParams["application_name"] = "idem-chaos-checker"
	if db.Pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return nil, fmt.Errorf("chaos: open pool: %w", err)
	}
	w.t.Cleanup(db.Pool.Close)
	return db, nil
}

func (w *idWorld) logf(format string, args ...any) {
	w.t.Logf("[%s %6.2fs] %s", w.name, time.Since(w.start).Seconds(), fmt.Sprintf(format, args...))
}

// idSlot is one supervised idworker: one process at a time, restarted after every
// death until the case ends, unless held (or oneShot: not restarted at all).
type idSlot struct {
	w         *idWorld
	name      string
	db        *chaosDB
	args      []string // idworker run's flags beyond the database, the broker and the stream
	point     string   // the fault point its first incarnation is armed with ("point=kill@K"), or ""
	consumers int      // how many consumers it runs: it is up once each has started
	oneShot   bool     // never restarted: an installation whose start must be refused
	log       *os.File

	mu          sync.Mutex
	cur         *proc
	curFrom     int64 // the log's size when the current incarnation started
	incarnation int
	held        bool
	released    chan struct{}
	outcomes    []string // how each incarnation ended
}

// slot adds a supervised idworker on db. point ("" for none) arms its first
// incarnation at a random K in [2, 4]: SIGKILL at that point's K-th hit.
func (w *idWorld) slot(name string, db *chaosDB, point faults.Point, args ...string) *idSlot {
	s := &idSlot{w: w, name: name, db: db, args: args}
	for i, a := range args {
		if a == "--consumer" && i+1 < len(args) {
			s.consumers++
		}
	}
	if point != "" {
		s.point = fmt.Sprintf("%s=kill@%d", point, 2+w.rng.IntN(3))
	}
	log, err := w.procs.openLog("idworker-" + name)
	if err != nil {
		w.t.Fatal(err)
	}
	s.log = log
	w.slots = append(w.slots, s)
	return s
}

// run starts the slot's supervisor.
func (s *idSlot) run() {
	done := make(chan struct{})
	ctx, cancel := context.WithCancel(s.w.ctx)
	go func() { defer close(done); s.supervise(ctx) }()
	s.w.t.Cleanup(func() { cancel(); <-done })
}

func (s *idSlot) supervise(ctx context.Context) {
	for ctx.Err() == nil {
		if !s.waitReleased(ctx) {
			return
		}
		p, err := s.startOne()
		if errors.Is(err, errHeld) {
			continue
		}
		if err != nil {
			s.w.logf("idworker %s: %v", s.name, err)
		} else {
			select {
			case <-p.done:
			case <-ctx.Done():
				p.kill()
				<-p.done
				return
			}
			s.mu.Lock()
			s.outcomes = append(s.outcomes, p.outcome())
			s.mu.Unlock()
			if s.oneShot {
				return
			}
			if ctx.Err() != nil {
				return
			}
		}
		// How long the slot stays down: part of the fault schedule, not a wait
		// for some state.
		select {
		case <-time.After(time.Duration(100+rand.IntN(300)) * time.Millisecond):
		case <-ctx.Done():
		}
	}
}

func (s *idSlot) startOne() (*proc, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held {
		return nil, errHeld
	}
	s.incarnation++
	var spec []string
	if s.w.switches != "" {
		spec = append(spec, s.w.switches)
	}
	if s.incarnation == 1 && s.point != "" {
		spec = append(spec, s.point)
	}
	fspec := strings.Join(spec, ",")
	s.curFrom = s.logSize()
	fmt.Fprintf(s.log, "=== chaos: idworker %s incarnation #%d IDEM_FAULTS=%s\n", s.name, s.incarnation, fspec)
	args := append([]string{"run", "--database-url", s.db.URL, "--nats-url", s.w.nats.URL(),
		"--stream", idStream, "--subjects", idSubjects, "--ack-wait", idAckWait.String(), "--relay", relayMode()}, s.args...)
	p, err := s.w.procs.start("idworker-"+s.name, s.log, nil, []string{faults.EnvVar + "=" + fspec}, idworkerBin, args...)
	if err != nil {
		return nil, err
	}
	s.cur = p
	return p, nil
}

// up reports whether the current incarnation runs with every consumer started
// (for a relay alone: the worker started), and whether it has exited.
func (s *idSlot) up() (up, exited bool) {
	s.mu.Lock()
	p, from := s.cur, s.curFrom
	s.mu.Unlock()
	if p == nil {
		return false, false
	}
	if p.exited() {
		return false, true
	}
	tail := s.logSince(from)
	if s.consumers == 0 {
		return strings.Contains(tail, "idworker: started"), false
	}
	return strings.Count(tail, "consumer started") >= s.consumers, false
}

// kill SIGKILLs the running incarnation (its supervisor restarts it); false when
// none runs.
func (s *idSlot) kill() bool {
	s.mu.Lock()
	p := s.cur
	s.mu.Unlock()
	if p == nil || p.exited() {
		return false
	}
	p.kill()
	<-p.done
	return true
}

// hold SIGKILLs the running incarnation and keeps the slot down until release.
func (s *idSlot) hold() {
	s.mu.Lock()
	if !s.held {
		s.held, s.released = true, make(chan struct{})
	}
	p := s.cur
	s.mu.Unlock()
	if p != nil && !p.exited() {
		p.kill()
		<-p.done
		s.w.count("hold")
	}
}

func (s *idSlot) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held {
		s.held = false
		close(s.released)
	}
}

func (s *idSlot) waitReleased(ctx context.Context) bool {
	s.mu.Lock()
	held, released := s.held, s.released
	s.mu.Unlock()
	if !held {
		return true
	}
	select {
	case <-released:
		return true
	case <-ctx.Done():
		return false
	}
}

func (w *idWorld) count(kind string) {
	w.mu.Lock()
	w.kills[kind]++
	w.mu.Unlock()
}

// startSlots starts the supervisors of slots and waits until each is up.
func (w *idWorld) startSlots(slots ...*idSlot) {
	w.t.Helper()
	for _, s := range slots {
		s.run()
	}
	w.waitUp(slots...)
}

// waitUp waits until every slot's current incarnation is up.
func (w *idWorld) waitUp(slots ...*idSlot) {
	w.t.Helper()
	err := w.waitFor(time.Minute, "the workers to be up", func() (bool, string, error) {
		var down []string
		for _, s := range slots {
			if ok, _ := s.up(); !ok {
				down = append(down, s.name)
			}
		}
		return len(down) == 0, "not up: " + strings.Join(down, ","), nil
	})
	if err != nil {
		w.t.Fatal(err)
	}
}

// waitFor polls cond every 100ms until it holds or timeout passes.
func (w *idWorld) waitFor(timeout time.Duration, what string, cond func() (bool, string, error)) error {
	deadline := time.Now().Add(timeout)
	nextReport := time.Now().Add(10 * time.Second)
	for {
		ok, missing, err := cond()
		if err != nil {
			ok, missing = false, err.Error() // a failed read is tried again, like a state not reached
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("chaos: timed out after %s waiting for %s: %s", timeout, what, missing)
		}
		if time.Now().After(nextReport) {
			w.logf("still waiting for %s: %s", what, missing)
			nextReport = time.Now().Add(10 * time.Second)
		}
		select {
		case <-time.After(100 * time.Millisecond): // poll interval
		case <-w.ctx.Done():
			return w.ctx.Err()
		}
	}
}

// produce runs idworker produce against db: count intents with keys prefix-from
// .. prefix-(from+count-1), each with one message per spec (SUBJECT or
// SUBJECT:NAME), one transaction each, paced. It returns the keys, which the
// producer printed after their commits.
func (w *idWorld) produce(db *chaosDB, prefix string, from, count int, pace time.Duration, messages ...string) []string {
	w.t.Helper()
	args := []string{"produce", "--database-url", db.URL, "--stream", idStream, "--subjects", idSubjects,
		"--key-prefix", prefix, "--from", strconv.Itoa(from), "--count", strconv.Itoa(count), "--pace", pace.String()}
	for _, m := range messages {
		args = append(args, "--message", m)
	}
	cmd := exec.CommandContext(w.ctx, idworkerBin, args...)
	cmd.Env = childEnv(nil)
	out, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		w.t.Fatalf("chaos: idworker produce: %v\n%s", err, stderr)
	}
	var keys []string
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		if k, ok := strings.CutPrefix(sc.Text(), "produced "); ok {
			keys = append(keys, k)
		}
	}
	if len(keys) != count {
		w.t.Fatalf("chaos: idworker produce printed %d keys, want %d", len(keys), count)
	}
	return keys
}

// killWhen SIGKILLs one of slots, drawn at random among those running, once when
// holds: a random moment of the load, chosen by a condition rather than a clock.
// The returned function waits for it and says what it killed.
func (w *idWorld) killWhen(when func() bool, slots ...*idSlot) func() string {
	rng := rand.New(rand.NewPCG(w.rng.Uint64(), w.rng.Uint64()))
	done := make(chan string, 1)
	go func() {
		err := w.waitFor(idSettle, "the moment of a kill", func() (bool, string, error) { return when(), "", nil })
		if err != nil {
			done <- "no kill (" + err.Error() + ")"
			return
		}
		for _, i := range rng.Perm(len(slots)) {
			if slots[i].kill() {
				w.count("sigkill")
				done <- "SIGKILL " + slots[i].name
				return
			}
		}
		done <- "no kill (every target was down)"
	}()
	return func() string { return <-done }
}

// delivery names one delivery as the checker counts it: the consumer (after
// aliases: a renamed consumer's two names are one), the intent's key and its
// message (wire.MessageOf).
type delivery struct{ consumer, key, message string }

// expectation is what a case must end with: for each delivery, whether it must
// take effect exactly once (true) or never (false). A delivery not listed must
// never take effect either.
type expectation struct {
	want  map[delivery]bool
	alias map[string]string // consumer name -> the name its effects count under
}

func newExpectation() *expectation {
	return &expectation{want: map[delivery]bool{}, alias: map[string]string{}}
}

// add expects each key's messages (subjects or SUBJECT:NAME) to take effect once
// at consumer (once: true) or never (false).
func (e *expectation) add(consumer string, once bool, keys []string, messages ...string) {
	for _, k := range keys {
		for _, m := range messages {
			subject, name, _ := strings.Cut(m, ":")
			e.want[delivery{consumer, k, wire.MessageOf(subject, name)}] = once
		}
	}
}

func (e *expectation) of(consumer string) string {
	if a, ok := e.alias[consumer]; ok {
		return a
	}
	return consumer
}

// effects counts chaos_effects rows by delivery, over every installation's
// database.
func (w *idWorld) effects(e *expectation) (map[delivery]int, int, error) {
	got := map[delivery]int{}
	total := 0
	for _, db := range w.dbs {
		rs, err := db.Pool.Query(w.ctx, `SELECT consumer, key, message, count(*) FROM chaos_effects GROUP BY 1, 2, 3`)
		if err != nil {
			return nil, 0, err
		}
		for rs.Next() {
			var d delivery
			var n int
			if err := rs.Scan(&d.consumer, &d.key, &d.message, &n); err != nil {
				rs.Close()
				return nil, 0, err
			}
			d.consumer = e.of(d.consumer)
			got[d] += n
			total += n
		}
		rs.Close()
		if err := rs.Err(); err != nil {
			return nil, 0, err
		}
	}
	return got, total, nil
}

// busy says what the case's durable consumers still have in flight, or "".
func (w *idWorld) busy() string {
	ctx, cancel := context.WithTimeout(w.ctx, 2*time.Second)
	defer cancel()
	var out []string
	for _, name := range w.durables {
		c, err := w.js.Consumer(ctx, idStream, name)
		if err != nil {
			out = append(out, fmt.Sprintf("consumer %s: %v", name, err))
			continue
		}
		info, err := c.Info(ctx)
		if err != nil {
			out = append(out, fmt.Sprintf("consumer %s: %v", name, err))
			continue
		}
		if info.NumPending > 0 || info.NumAckPending > 0 {
			out = append(out, fmt.Sprintf("consumer %s has %d pending, %d unacknowledged", name, info.NumPending, info.NumAckPending))
		}
	}
	return strings.Join(out, "; ")
}

// outboxState counts the first installation's outbox rows (the others' produce
// nothing): neither published nor dead-lettered (of the first generation only, or
// of every generation), and published but neither proven nor alerted.
func (w *idWorld) outboxState() (unpublishedFirst, unpublished, unproven int, err error) {
	err = w.dbs[0].Pool.QueryRow(w.ctx, `
SELECT count(*) FILTER (WHERE published_at IS NULL AND dead_lettered_at IS NULL AND generation = 0),
       count(*) FILTER (WHERE published_at IS NULL AND dead_lettered_at IS NULL),
       count(*) FILTER (WHERE published_at IS NOT NULL AND completed_at IS NULL AND alerted_at IS NULL)
FROM `+outboxView).Scan(&unpublishedFirst, &unpublished, &unproven)
	return
}

// waitSettled waits until every delivery e expects has its effect, the outbox is
// published and proven (each row completed or alerted), and the durables have
// nothing in flight. A case that misses it goes on: the checker says what is
// missing.
func (w *idWorld) waitSettled(e *expectation) {
	start := time.Now()
	err := w.waitFor(idSettle, "the case to settle", func() (bool, string, error) {
		got, _, err := w.effects(e)
		if err != nil {
			return false, "", err
		}
		missing := 0
		for d, once := range e.want {
			if once && got[d] == 0 {
				missing++
			}
		}
		_, unpublished, unproven, err := w.outboxState()
		if err != nil {
			return false, "", err
		}
		var why []string
		if missing > 0 {
			why = append(why, fmt.Sprintf("%d deliveries without their effect", missing))
		}
		if unpublished > 0 || unproven > 0 {
			why = append(why, fmt.Sprintf("%d outbox rows unpublished, %d unproven", unpublished, unproven))
		}
		if len(why) == 0 {
			if b := w.busy(); b != "" {
				why = append(why, b)
			}
		}
		return len(why) == 0, strings.Join(why, "; "), nil
	})
	if err != nil {
		w.t.Errorf("%v", err)
		return
	}
	w.logf("settled in %s", time.Since(start).Round(time.Millisecond))
}

// waitRest waits, for a negative control that must lose or double deliveries,
// until nothing is left in flight: every intent's first publish done, and the
// durables with nothing pending and nothing unacknowledged. Every original
// message has then been taken and settled, one way or another; re-drives may
// still come and go (a negative control's reconciler may chase what it cannot
// prove), but they take no effect the checker would miss.
func (w *idWorld) waitRest() {
	start := time.Now()
	err := w.waitFor(idSettle, "the case to come to rest", func() (bool, string, error) {
		unpublishedFirst, _, _, err := w.outboxState()
		if err != nil {
			return false, "", err
		}
		if unpublishedFirst > 0 {
			return false, fmt.Sprintf("%d outbox rows never published", unpublishedFirst), nil
		}
		b := w.busy()
		return b == "", b, nil
	})
	if err != nil {
		w.t.Errorf("%v", err)
		return
	}
	w.logf("at rest in %s", time.Since(start).Round(time.Millisecond))
}

// idFigures are what one identity case measured: its figures line.
type idFigures struct {
	name        string
	intents     int
	deliveries  int // deliveries expected to take effect once
	faults      int // fault points that fired + SIGKILLs from outside (random moments, holds)
	effects     int // chaos_effects rows over every installation
	folded      int // deliveries the inboxes folded (the consumers' "duplicate" outcome)
	skipped     int // copies meant for other consumers, acked without an effect
	deadLetters int
	lost        int // deliveries expected once, without an effect
	doubled     int // deliveries expected once, with more than one
	stray       int // effects of deliveries expected never to take effect
	extra       string

	lostOnes, doubledOnes, strayOnes []string
	faultsByKind                     map[string]int
	events                           map[string]int // "name outcome" -> count, from the workers' logs
}

func (f idFigures) String() string {
	s := fmt.Sprintf("chaos: identity=%s intents=%d deliveries=%d faults=%d effects=%d duplicates_folded=%d skipped=%d dead_letters=%d lost=%d doubled=%d stray=%d",
		f.name, f.intents, f.deliveries, f.faults, f.effects, f.folded, f.skipped, f.deadLetters, f.lost, f.doubled, f.stray)
	if f.extra != "" {
		s += " " + f.extra
	}
	return s
}

// check counts, reading the databases (and, for what the workers did beyond
// effects, their logs), and prints the figures line.
func (w *idWorld) check(e *expectation, intents int, extra func(*idFigures)) idFigures {
	w.t.Helper()
	f := idFigures{name: w.name, intents: intents}
	got, total, err := w.effects(e)
	if err != nil {
		w.t.Fatalf("chaos: check: %v", err)
	}
	f.effects = total
	for d, once := range e.want {
		if once {
			f.deliveries++
		}
		switch n := got[d]; {
		case once && n == 0:
			f.lost++
			f.lostOnes = append(f.lostOnes, fmt.Sprintf("%s %s %q", d.consumer, d.key, d.message))
		case once && n > 1:
			f.doubled++
			f.doubledOnes = append(f.doubledOnes, fmt.Sprintf("%s %s %q x%d", d.consumer, d.key, d.message, n))
		case !once && n > 0:
			f.stray++
			f.strayOnes = append(f.strayOnes, fmt.Sprintf("%s %s %q x%d", d.consumer, d.key, d.message, n))
		}
	}
	for d, n := range got {
		if _, ok := e.want[d]; !ok {
			f.stray++
			f.strayOnes = append(f.strayOnes, fmt.Sprintf("%s %s %q x%d (no such delivery)", d.consumer, d.key, d.message, n))
		}
	}
	for _, db := range w.dbs {
		var n int
		if err := db.Pool.QueryRow(w.ctx, `SELECT count(*) FROM idem_dead_letters`).Scan(&n); err != nil {
			w.t.Fatalf("chaos: check: %v", err)
		}
		f.deadLetters += n
	}
	f.faultsByKind = map[string]int{}
	w.mu.Lock()
	for k, n := range w.kills {
		f.faultsByKind[k] = n
	}
	w.mu.Unlock()
	fired, err := w.procs.countInLogs("idworker-", pointsFired()...)
	if err != nil {
		w.t.Fatal(err)
	}
	for needle, n := range fired {
		if n > 0 {
			f.faultsByKind[strings.TrimSuffix(strings.TrimPrefix(needle, "faults: "), " fired")] = n
		}
	}
	for _, n := range f.faultsByKind {
		f.faults += n
	}
	if f.events, err = w.events(); err != nil {
		w.t.Fatal(err)
	}
	for k, n := range f.events {
		switch {
		case strings.HasSuffix(k, " duplicate"):
			f.folded += n
		case strings.HasSuffix(k, " skipped"):
			f.skipped += n
		}
	}
	if extra != nil {
		extra(&f)
	}
	sort.Strings(f.lostOnes)
	sort.Strings(f.doubledOnes)
	sort.Strings(f.strayOnes)
	w.logf("faults by kind: %v; worker events: %v", f.faultsByKind, f.events)
	if len(f.lostOnes) > 0 {
		w.logf("lost: %s", abbreviate(f.lostOnes, 6))
	}
	if len(f.doubledOnes) > 0 {
		w.logf("doubled: %s", abbreviate(f.doubledOnes, 6))
	}
	if len(f.strayOnes) > 0 {
		w.logf("stray: %s", abbreviate(f.strayOnes, 6))
	}
	line := f.String()
	// One write, so the lines stay together when several tests print at once.
	fmt.Printf("chaos: run=identity-%s seed=%d elapsed=%s\n%s\n", w.name, w.seed, time.Since(w.start).Round(time.Second), line)
	w.t.Log(line)
	return f
}

// pointsFired are the log lines of the fault points the identity workers are
// armed with.
func pointsFired() []string {
	var out []string
	for _, p := range []faults.Point{faults.EffectBeforeCommit, faults.ConsumerAfterCommit, faults.RelayAfterPublish} {
		out = append(out, "faults: "+string(p)+" fired")
	}
	return out
}

var eventLine = regexp.MustCompile(`msg="idworker: event" component=\S+ name=(?:""|(\S+)) outcome=(\S+) count=(\d+)`)

// events sums the outcomes the workers logged ("idworker: event"), by "name
// outcome".
func (w *idWorld) events() (map[string]int, error) {
	out := map[string]int{}
	for _, s := range w.slots {
		b, err := os.ReadFile(s.log.Name())
		if err != nil {
			return nil, err
		}
		for _, m := range eventLine.FindAllStringSubmatch(string(b), -1) {
			n, _ := strconv.Atoi(m[3])
			name := m[1]
			if name == "" {
				name = "(reconciler)"
			}
			out[name+" "+m[2]] += n
		}
	}
	return out, nil
}

// problems are the ways a positive case broke "exactly once".
func (f idFigures) problems() []string {
	var ps []string
	if f.lost > 0 {
		ps = append(ps, fmt.Sprintf("%d deliveries lost: %s", f.lost, abbreviate(f.lostOnes, 10)))
	}
	if f.doubled > 0 {
		ps = append(ps, fmt.Sprintf("%d deliveries doubled: %s", f.doubled, abbreviate(f.doubledOnes, 10)))
	}
	if f.stray > 0 {
		ps = append(ps, fmt.Sprintf("%d effects that must not be: %s", f.stray, abbreviate(f.strayOnes, 10)))
	}
	if f.faults == 0 {
		ps = append(ps, "no fault happened")
	}
	return ps
}

// seqsOf is the stream sequences of the first installation's outbox rows with
// these keys.
func (w *idWorld) seqsOf(where string, args ...any) []uint64 {
	w.t.Helper()
	rs, err := w.dbs[0].Pool.Query(w.ctx, `SELECT stream_seq FROM `+outboxView+` WHERE stream_seq IS NOT NULL AND `+where, args...)
	if err != nil {
		w.t.Fatal(err)
	}
	defer rs.Close()
	var seqs []uint64
	for rs.Next() {
		var s int64
		if err := rs.Scan(&s); err != nil {
			w.t.Fatal(err)
		}
		seqs = append(seqs, uint64(s))
	}
	if err := rs.Err(); err != nil {
		w.t.Fatal(err)
	}
	slices.Sort(seqs)
	return seqs
}

// loseMessages deletes the messages at seqs from the stream: what a purge, a
// store loss or an operator's `nats stream rmm` does to messages nobody has
// consumed yet.
func (w *idWorld) loseMessages(seqs []uint64) {
	w.t.Helper()
	st, err := w.js.Stream(w.ctx, idStream)
	if err != nil {
		w.t.Fatal(err)
	}
	for _, seq := range seqs {
		if err := st.DeleteMsg(w.ctx, seq); err != nil {
			w.t.Fatalf("chaos: delete message %d from the stream: %v", seq, err)
		}
	}
	w.count("stream-lost")
	w.logf("the stream lost %d messages (sequences %d..%d)", len(seqs), seqs[0], seqs[len(seqs)-1])
}

// exec runs one statement on the first installation's database.
func (w *idWorld) exec(sql string, args ...any) int64 {
	w.t.Helper()
	tag, err := w.dbs[0].Pool.Exec(w.ctx, sql, args...)
	if err != nil {
		w.t.Fatalf("chaos: %s: %v", sql, err)
	}
	return tag.RowsAffected()
}

// count1 runs a count on the first installation's database.
func (w *idWorld) count1(sql string, args ...any) int {
	w.t.Helper()
	var n int
	if err := w.dbs[0].Pool.QueryRow(w.ctx, sql, args...).Scan(&n); err != nil {
		w.t.Fatalf("chaos: %s: %v", sql, err)
	}
	return n
}

// publishedAtLeast holds once the first installation's relays have published a
// share (drawn from [0.2, 0.6)) of rows outbox rows beyond base: a random moment
// of the load that a negative control reaches as surely as the case.
func (w *idWorld) publishedAtLeast(base, rows int) func() bool {
	n := base + int(float64(rows)*(0.2+0.4*w.rng.Float64()))
	return func() bool {
		var c int
		err := w.dbs[0].Pool.QueryRow(w.ctx, `SELECT count(*) FROM `+outboxView+` WHERE published_at IS NOT NULL OR generation > 0`).Scan(&c)
		return err == nil && c >= n
	}
}

// waitCount waits until the count sql gives (on the first installation's
// database) is want.
func (w *idWorld) waitCount(what string, want int, sql string, args ...any) {
	w.t.Helper()
	err := w.waitFor(idSettle, what, func() (bool, string, error) {
		var n int
		if err := w.dbs[0].Pool.QueryRow(w.ctx, sql, args...).Scan(&n); err != nil {
			return false, "", err
		}
		return n == want, fmt.Sprintf("%d of %d", n, want), nil
	})
	if err != nil {
		w.t.Fatal(err)
	}
}

// proofLine is the outbox's proof, for the figures line: rows, completed,
// alerted and re-driven rows.
func (w *idWorld) proofLine() string {
	var rows, completed, alerted, redriven int
	err := w.dbs[0].Pool.QueryRow(w.ctx, `SELECT count(*), count(completed_at), count(alerted_at), count(*) FILTER (WHERE generation > 0) FROM idem_outbox`).
		Scan(&rows, &completed, &alerted, &redriven)
	if err != nil {
		return "outbox=" + err.Error()
	}
	return fmt.Sprintf("outbox_rows=%d completed=%d alerted=%d redriven=%d", rows, completed, alerted, redriven)
}

func consumersArgs(specs ...string) []string {
	args := []string{"--roles", "consumers"}
	for _, s := range specs {
		args = append(args, "--consumer", s)
	}
	return args
}

func reportPositive(t *testing.T, f idFigures) {
	for _, p := range f.problems() {
		t.Errorf("chaos: %s", p)
	}
}

// waitSettledBy waits until every delivery e expects has its effect and the
// case's durables have nothing in flight (the outbox need not be proven: a
// consumer is down).
func (w *idWorld) waitSettledBy(e *expectation) {
	w.t.Helper()
	err := w.waitFor(idSettle, "the running consumers to settle", func() (bool, string, error) {
		got, _, err := w.effects(e)
		if err != nil {
			return false, "", err
		}
		missing := 0
		for d, once := range e.want {
			if once && got[d] == 0 {
				missing++
			}
		}
		if missing > 0 {
			return false, fmt.Sprintf("%d deliveries without their effect", missing), nil
		}
		b := w.busy()
		return b == "", b, nil
	})
	if err != nil {
		w.t.Fatal(err)
	}
}
