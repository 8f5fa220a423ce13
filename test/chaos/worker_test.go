package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// workerSpec is one worker slot of the topology: its roles, and the deterministic
// fault points its incarnations may be armed with (the first armed incarnation
// takes points[0], later ones a random one).
type workerSpec struct {
	name   string
	roles  string
	points []string
}

// topology is the scale-out under test: three workers share the durable consumers
// "charges" and "emails", two relays drain one outbox, three of them take HTTP
// ingress.
func topology() []workerSpec {
	return []workerSpec{
		{"w1", "ingress,consumers", []string{"effect.before-commit", "consumer.after-commit", "external.after-perform", "ingress.after-commit"}},
		{"w2", "ingress,consumers", []string{"consumer.after-commit", "effect.before-commit", "external.after-perform", "ingress.after-commit"}},
		{"w3", "consumers", []string{"external.after-perform", "effect.before-commit", "consumer.after-commit"}},
		{"w4", "relay", []string{"relay.after-publish"}},
		{"w5", "relay,ingress", []string{"ingress.after-commit", "relay.after-publish"}},
	}
}

// worker is a supervised slot: one process at a time, restarted after every death
// (a fault point firing, a SIGKILL from the schedule, an exit after losing its
// database or broker) until the run stops.
type worker struct {
	r        *run
	spec     workerSpec
	httpAddr string
	dataDir  string
	log      *os.File
	rng      *rand.Rand // used by the supervisor goroutine only

	mu          sync.Mutex
	cur         *proc
	incarnation int
	armed       int           // incarnations started with a fault point
	held        bool          // hold: the slot stays down until release
	released    chan struct{} // closed by release

	// Used by the supervisor goroutine only: the fault point the running
	// incarnation was armed with ("point=kill@K", or ""), how often the slot's log
	// said it fired before that incarnation started, and a point to arm again
	// because its incarnation died (killed by the schedule or by a marked
	// message) before reaching it.
	armedWith   string
	firedBefore int
	carry       string
}

func newWorker(r *run, spec workerSpec, port int, rng *rand.Rand) (*worker, error) {
	w := &worker{
		r: r, spec: spec, rng: rng,
		httpAddr: fmt.Sprintf("127.0.0.1:%d", port),
		dataDir:  filepath.Join(r.dir, "workers", spec.name),
	}
	if err := os.MkdirAll(w.dataDir, 0o755); err != nil {
		return nil, fmt.Errorf("chaos: worker %s data dir: %w", spec.name, err)
	}
	log, err := r.procs.openLog("worker-" + spec.name)
	if err != nil {
		return nil, err
	}
	w.log = log
	return w, nil
}

func (w *worker) consumes() bool { return strings.Contains(w.spec.roles, "consumers") }
func (w *worker) ingress() bool  { return strings.Contains(w.spec.roles, "ingress") }

// url is the worker's HTTP base URL (ingress and health).
func (w *worker) url() string { return "http://" + w.httpAddr }

// nextFaults is IDEM_FAULTS for the next incarnation. While the load runs, an
// incarnation may be armed with one fault point at a random @K (a count of batches,
// publishes or requests); once the load is over, restarts come up unarmed so the run
// can settle. The negative control keeps its consumers without the inbox claim in
// every incarnation.
//
// Every incarnation of a consumer worker has consumer.marked-messages on, during the
// load and after it: a marked message is a valid charge, and a worker without the
// switch would let it take effect. An incarnation that died before its fault point
// fired hands the point on to the next one, while the load runs, so that the
// marked message's restart loop and the schedule's kills do not swallow the
// deterministic faults.
func (w *worker) nextFaults(loadRunning bool) string {
	var spec []string
	if w.r.cfg.negative && w.consumes() {
		spec = append(spec, "consumer.skip-inbox-claim=on")
	}
	if w.consumes() {
		spec = append(spec, "consumer.marked-messages=on")
	}
	w.armedWith = ""
	if loadRunning && w.carry != "" {
		w.armedWith, w.carry = w.carry, ""
		return strings.Join(append(spec, w.armedWith), ",")
	}
	w.carry = ""
	arm := loadRunning && (w.r.cfg.armPerSlot < 0 || w.armed < w.r.cfg.armPerSlot)
	if arm && w.armed > 0 {
		arm = w.rng.IntN(2) == 0 // after the first, re-arm one restart in two
	}
	if arm {
		point := w.spec.points[0]
		if w.armed > 0 {
			point = w.spec.points[w.rng.IntN(len(w.spec.points))]
		}
		maxK := w.r.cfg.maxK
		if point == "external.after-perform" { // hit once per email sent: a quarter of the load
			maxK = max(3, int(float64(maxK)*w.r.cfg.emailShare))
		}
		k := 2 + w.rng.IntN(maxK-1)
		w.armedWith = fmt.Sprintf("%s=kill@%d", point, k)
		spec = append(spec, w.armedWith)
		w.armed++
	}
	return strings.Join(spec, ",")
}

// fired counts the lines of the slot's log saying the fault point of spec
// ("point=kill@K") fired.
func (w *worker) fired(spec string) int {
	point, _, _ := strings.Cut(spec, "=")
	b, err := os.ReadFile(w.log.Name())
	if err != nil {
		return 0
	}
	return strings.Count(string(b), "faults: "+point+" fired")
}

// supervise runs incarnations until ctx ends; load is done when the load phase is
// over (no more arming). While the slot is held it starts nothing.
func (w *worker) supervise(ctx, load context.Context) {
	for ctx.Err() == nil {
		if !w.waitReleased(ctx) {
			return
		}
		faults := w.nextFaults(load.Err() == nil)
		if w.armedWith != "" {
			w.firedBefore = w.fired(w.armedWith)
		}
		p, err := w.start(faults)
		if errors.Is(err, errHeld) {
			w.carry = w.armedWith // held between the wait and the start: arm the next one
			continue
		}
		if err != nil {
			w.r.logf("worker %s: %v", w.spec.name, err)
			w.carry = w.armedWith
		} else {
			select {
			case <-p.done:
			case <-ctx.Done():
				p.kill()
				<-p.done
				return
			}
			if ctx.Err() != nil {
				return
			}
			if w.armedWith != "" && w.fired(w.armedWith) == w.firedBefore {
				w.carry = w.armedWith
			}
			w.r.logf("worker %s #%d (%s) %s; restarting", w.spec.name, w.incarnation, orNone(faults), p.outcome())
		}
		// The pause before a restart is part of the fault schedule (how long the
		// slot stays down), not a wait for some state.
		select {
		case <-time.After(time.Duration(100+w.rng.IntN(400)) * time.Millisecond):
		case <-ctx.Done():
		}
	}
}

// errHeld: the slot is held; start started nothing.
var errHeld = errors.New("chaos: worker slot held")

func (w *worker) start(faults string) (*proc, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.held {
		return nil, errHeld
	}
	w.incarnation++
	fmt.Fprintf(w.log, "=== chaos: worker %s incarnation #%d roles=%s IDEM_FAULTS=%s\n", w.spec.name, w.incarnation, w.spec.roles, faults)
	args := []string{
		"--database-url", w.r.db.URL,
		"--nats-url", w.r.natsURL(),
		"--http-addr", w.httpAddr,
		"--data-dir", w.dataDir,
		"--roles", w.spec.roles,
		"--smtp-url", "smtp+insecure://" + w.r.smtp.Addr(), // the email consumer runs where consumers do
		"--log-level", "debug", // duplicates folded and replays are logged at debug
		"--shutdown-timeout", "5s",
		"--ack-wait", ackWait.String(),
		"--relay", relayMode(),
	}
	if w.r.cfg.cluster {
		args = append(args, "--stream-replicas", strconv.Itoa(clusterSize))
	}
	if w.r.cfg.reconcileAfter != "" {
		args = append(args, "--reconcile-after", w.r.cfg.reconcileAfter)
	}
	p, err := w.r.procs.start("worker-"+w.spec.name, w.log, nil,
		[]string{"IDEM_FAULTS=" + faults}, workerBin, args...)
	if err != nil {
		return nil, err
	}
	w.cur = p
	return p, nil
}

// kill SIGKILLs the running incarnation; false when none is running.
func (w *worker) kill() bool {
	w.mu.Lock()
	p := w.cur
	w.mu.Unlock()
	if p == nil || p.exited() {
		return false
	}
	p.kill()
	return true
}

// hold SIGKILLs the running incarnation, if any, and keeps the slot down until
// release: the supervisor starts nothing meanwhile. It returns once no incarnation
// of the slot is alive, and whether it killed one.
func (w *worker) hold() bool {
	w.mu.Lock()
	if !w.held {
		w.held, w.released = true, make(chan struct{})
	}
	p := w.cur
	w.mu.Unlock()
	if p == nil || p.exited() {
		return false
	}
	p.kill()
	<-p.done
	return true
}

// release lets the supervisor start the slot again.
func (w *worker) release() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.held {
		w.held = false
		close(w.released)
	}
}

// waitReleased returns true at once when the slot is not held, else when it is
// released; false when ctx ends first.
func (w *worker) waitReleased(ctx context.Context) bool {
	w.mu.Lock()
	held, released := w.held, w.released
	w.mu.Unlock()
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

// ready reports whether the worker answers /readyz (Postgres and NATS reachable).
func (w *worker) ready(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.url()+"/readyz", nil)
	if err != nil {
		return false
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func orNone(s string) string {
	if s == "" {
		return "no faults"
	}
	return "IDEM_FAULTS=" + s
}
