package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// faultKind is a fault the schedule injects from outside the processes. The fault
// points inside the worker (IDEM_FAULTS) are armed by the supervisors instead.
type faultKind int

const (
	killWorker    faultKind = iota // SIGKILL one worker (its supervisor restarts it)
	restartNATS                    // kill -9 nats-server, restart it on the same port and store
	terminatePG                    // pg_terminate_backend on every idem-worker connection
	killClient                     // SIGKILL a lane's next enqueue mid-request, then it resumes
	numFaultKinds                  // the kinds drawn at random; the ones below are planned apart
)

// outagePG stops the run's Postgres server for 15-20s in the middle of the load and
// starts it again (planOutages). wipeStore and truncateStore damage the JetStream
// store while nats-server is dead, with a backlog of unconsumed messages in it;
// wipeStoreLive wipes it under running consumers (planStoreFaults,
// storefault_test.go).
const (
	outagePG      = numFaultKinds
	wipeStore     = numFaultKinds + 1
	truncateStore = numFaultKinds + 2
	wipeStoreLive = numFaultKinds + 3 // a wipe with the consumers running: they must recreate their durable consumers themselves
)

func (k faultKind) String() string {
	return [...]string{"kill-worker", "restart-nats", "terminate-pg", "kill-client", "outage-pg", "wipe-nats-store", "truncate-nats-block", "wipe-nats-store-live"}[k]
}

// holdsConsumers: the store fault holds the consumers down for a backlog first.
func (k faultKind) holdsConsumers() bool { return k == wipeStore || k == truncateStore }

// event is one scheduled fault.
type event struct {
	at     time.Duration // offset into the load phase
	kind   faultKind
	target int           // worker or lane index
	pause  time.Duration // nats or Postgres downtime, or delay before killing a client
}

func (e event) String() string {
	switch e.kind {
	case restartNATS:
		return fmt.Sprintf("@%s %s (down %s)", e.at.Round(time.Millisecond), e.kind, e.pause)
	case outagePG:
		return fmt.Sprintf("@%s %s (Postgres down %s, back @%s)", e.at.Round(time.Millisecond), e.kind, e.pause.Round(time.Millisecond), (e.at + e.pause).Round(time.Millisecond))
	case killClient:
		return fmt.Sprintf("@%s %s lane %d (%s after start)", e.at.Round(time.Millisecond), e.kind, e.target, e.pause)
	case killWorker:
		return fmt.Sprintf("@%s %s #%d", e.at.Round(time.Millisecond), e.kind, e.target)
	case wipeStore, truncateStore:
		return fmt.Sprintf("@%s %s (consumers held down for a backlog first)", e.at.Round(time.Millisecond), e.kind)
	case wipeStoreLive:
		return fmt.Sprintf("@%s %s (consumers running)", e.at.Round(time.Millisecond), e.kind)
	}
	return fmt.Sprintf("@%s %s", e.at.Round(time.Millisecond), e.kind)
}

// planFaults draws the schedule from the seed: n faults at uniformly random moments
// in the middle 90% of the load. Every kind appears at least once; with more than
// numFaultKinds the rest are drawn at random.
func planFaults(rng *rand.Rand, n int, load time.Duration, workers, lanes int) []event {
	events := make([]event, 0, n)
	for i := range n {
		kind := faultKind(i)
		if i >= int(numFaultKinds) {
			kind = faultKind(rng.IntN(int(numFaultKinds)))
		}
		e := event{at: load/20 + time.Duration(rng.Int64N(int64(load*9/10))), kind: kind}
		switch kind {
		case killWorker:
			e.target = rng.IntN(workers)
		case restartNATS:
			e.pause = time.Duration(200+rng.IntN(1800)) * time.Millisecond
		case killClient:
			e.target = rng.IntN(lanes)
			e.pause = time.Duration(3+rng.IntN(25)) * time.Millisecond // an enqueue lives ~15-30 ms
		}
		events = append(events, e)
	}
	slices.SortFunc(events, func(a, b event) int { return int(a.at - b.at) })
	return events
}

// planOutages draws n Postgres outages of 15-20s: one in each n-th of the load,
// starting after its first sixth and, when the load is long enough, ending before
// its last tenth, so the load runs on both sides of it.
func planOutages(rng *rand.Rand, n int, load time.Duration) []event {
	if n == 0 {
		return nil
	}
	var events []event
	seg := load / time.Duration(n)
	for i := range n {
		down := outageMin + time.Duration(rng.Int64N(int64(outageMax-outageMin)))
		at := time.Duration(i)*seg + seg/6
		if room := seg*9/10 - seg/6 - down; room > 0 {
			at += time.Duration(rng.Int64N(int64(room)))
		}
		events = append(events, event{at: at, kind: outagePG, pause: down})
	}
	return events
}

// faultCounts counts the faults injected from outside that really happened. Fault
// points that fired are counted from the workers' logs by the checker.
type faultCounts struct {
	workerKills    atomic.Int64
	natsRestarts   atomic.Int64
	pgTerminations atomic.Int64 // rounds that terminated at least one connection
	clientKills    atomic.Int64 // enqueue processes that really died of the SIGKILL
	pgOutages      atomic.Int64 // Postgres stopped and started again
	storeWipes     atomic.Int64 // JetStream stores deleted while nats-server was dead (consumers held down)
	storeWipesLive atomic.Int64 // the same with the consumers running
	storeTruncs    atomic.Int64 // last message blocks truncated while nats-server was dead
	holdKills      atomic.Int64 // consumer workers SIGKILLed to hold the consumers down
}

// inject runs the schedule until the load ends (ctx lives as long as the run). The
// sleeps are the schedule itself. A Postgres outage runs beside the rest of the
// schedule, so workers, nats-server and clients die during it too; only a
// pg_terminate_backend planned during an outage waits for the server to be back.
func (r *run) inject(ctx, load context.Context, start time.Time, events []event) error {
	var outages errList
	var wg sync.WaitGroup
	defer wg.Wait() // also on an early return: the server must be back first
schedule:
	for _, e := range events {
		select {
		case <-time.After(time.Until(start.Add(e.at))):
		case <-load.Done():
			break schedule
		}
		switch e.kind {
		case outagePG:
			wg.Add(1)
			go func() {
				defer wg.Done()
				r.logf("fault: stop Postgres (pg_ctl stop -m fast), down for %s", e.pause.Round(time.Millisecond))
				// On ctx, not load: the server must come back even if the load
				// ends meanwhile.
				if err := r.pg.restart(ctx, e.pause); err != nil {
					outages.add(fmt.Errorf("Postgres outage: %w", err))
					return
				}
				r.faults.pgOutages.Add(1)
				r.logf("Postgres is back")
			}()
		case killWorker:
			w := r.workers[e.target]
			if w.kill() {
				r.faults.workerKills.Add(1)
				r.logf("fault: SIGKILL worker %s (%s)", w.spec.name, w.spec.roles)
			}
		case restartNATS:
			r.logf("fault: kill -9 nats-server, down for %s", e.pause)
			if err := r.nats.crash(load, e.pause); err != nil {
				return fmt.Errorf("restart nats-server: %w", err)
			}
			r.faults.natsRestarts.Add(1)
			r.logf("nats-server is back")
		case terminatePG:
			if r.pg.whenUp(load) != nil {
				break schedule // the load ended during the outage
			}
			n, err := r.terminateWorkerConns(load)
			if err != nil {
				return err
			}
			if n > 0 {
				r.faults.pgTerminations.Add(1)
			}
			r.logf("fault: pg_terminate_backend on %d idem-worker connections", n)
		case killClient:
			r.lanes[e.target].armKill(e.pause)
		case wipeStore, truncateStore, wipeStoreLive:
			if err := r.storeFault(ctx, e); err != nil {
				return err
			}
		}
	}
	wg.Wait()
	return errors.Join(outages.list()...)
}

// terminateWorkerConns kills every server-side connection of the workers (they set
// application_name=idem-worker) to this run's database.
func (r *run) terminateWorkerConns(ctx context.Context) (int, error) {
	var n int
	err := r.db.Pool.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
FROM pg_stat_activity
WHERE datname = $1 AND application_name = 'idem-worker'`, r.db.Name).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("pg_terminate_backend: %w", err)
	}
	return n, nil
}
