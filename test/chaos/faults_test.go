package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/refapp"
)

// faultKind is a fault the schedule injects from outside the processes. The fault
// points inside the worker (IDEM_FAULTS) are armed by the supervisors instead.
type faultKind int

const (
	killWorker  faultKind = iota // SIGKILL one worker (its supervisor restarts it)
	restartNATS                  // kill -9 nats-server, restart it on the same port and store
	terminatePG                  // pg_terminate_backend on every idem-worker connection
	killClient                   // SIGKILL a lane's next enqueue mid-request, then it resumes
	numFaultKinds
)

func (k faultKind) String() string {
	return [...]string{"kill-worker", "restart-nats", "terminate-pg", "kill-client"}[k]
}

// event is one scheduled fault.
type event struct {
	at     time.Duration // offset into the load phase
	kind   faultKind
	target int           // worker or lane index
	pause  time.Duration // nats downtime, or delay before killing a client
}

func (e event) String() string {
	switch e.kind {
	case restartNATS:
		return fmt.Sprintf("@%s %s (down %s)", e.at.Round(time.Millisecond), e.kind, e.pause)
	case killClient:
		return fmt.Sprintf("@%s %s lane %d (%s after start)", e.at.Round(time.Millisecond), e.kind, e.target, e.pause)
	case killWorker:
		return fmt.Sprintf("@%s %s #%d", e.at.Round(time.Millisecond), e.kind, e.target)
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

// faultCounts counts the faults injected from outside that really happened. Fault
// points that fired are counted from the workers' logs by the checker.
type faultCounts struct {
	workerKills    atomic.Int64
	natsRestarts   atomic.Int64
	pgTerminations atomic.Int64 // rounds that terminated at least one connection
	clientKills    atomic.Int64 // enqueue processes that really died of the SIGKILL
}

func (f *faultCounts) total() int {
	return int(f.workerKills.Load() + f.natsRestarts.Load() + f.pgTerminations.Load() + f.clientKills.Load())
}

// inject runs the schedule. The sleeps are the schedule itself.
func (r *run) inject(ctx context.Context, start time.Time, events []event) error {
	for _, e := range events {
		select {
		case <-time.After(time.Until(start.Add(e.at))):
		case <-ctx.Done():
			return nil
		}
		switch e.kind {
		case killWorker:
			w := r.workers[e.target]
			if w.kill() {
				r.faults.workerKills.Add(1)
				r.logf("fault: SIGKILL worker %s (%s)", w.spec.name, w.spec.roles)
			}
		case restartNATS:
			r.logf("fault: kill -9 nats-server, down for %s", e.pause)
			if err := r.nats.crash(ctx, e.pause); err != nil {
				return fmt.Errorf("restart nats-server: %w", err)
			}
			r.faults.natsRestarts.Add(1)
			r.logf("nats-server is back")
		case terminatePG:
			n, err := r.terminateWorkerConns(ctx)
			if err != nil {
				return err
			}
			if n > 0 {
				r.faults.pgTerminations.Add(1)
			}
			r.logf("fault: pg_terminate_backend on %d idem-worker connections", n)
		case killClient:
			r.lanes[e.target].armKill(e.pause)
		}
	}
	return nil
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

// poison is a message published straight to JetStream that must end up in
// idem_dead_letters, with its key and payload as published.
type poison struct {
	why      string
	key      string
	payload  []byte
	subject  string // default idem.payments.charge
	mismatch bool   // the key of an intent with another payload
}

// injectPoison publishes the poison messages, and copies of some intents' messages
// (same key, same payload, a fresh Nats-Msg-Id: the at-least-once repeat that a
// dead-letter replay or a publisher past the broker's de-duplication window makes),
// which the inbox must fold.
func (r *run) injectPoison(ctx context.Context, rng *rand.Rand) error {
	// A key an intent already used, for "same key, different payload": wait until
	// some effect exists, so the poison is the second arrival and not the first.
	var key, account string
	var cents int64
	if err := r.waitFor(ctx, time.Minute, "a first effect to exist", func() (bool, string, error) {
		err := r.db.Pool.QueryRow(ctx, `SELECT idempotency_key, account, amount_cents FROM ledger_entries ORDER BY id LIMIT 1`).
			Scan(&key, &account, &cents)
		if err != nil {
			return false, "no ledger row yet", nil
		}
		return true, "", nil
	}); err != nil {
		return err
	}
	tag := fmt.Sprintf("poison-%d", rng.Uint32())
	charge := func(acct string, c int64) []byte {
		return fmt.Appendf(nil, `{"account":%q,"amount_cents":%d}`, acct, c)
	}
	r.poison = []poison{
		{why: "no Idempotency-Key", payload: charge(tag+"-nokey", 100)},
		{why: "key longer than 255 bytes", key: strings.Repeat("k", idem.MaxKeyLen+1), payload: charge(tag+"-longkey", 100)},
		{why: "key with a DEL byte", key: "bad\x7fkey-" + tag, payload: charge(tag+"-delkey", 100)},
		{why: "payload is not JSON", key: idem.NewKey().String(), payload: []byte(`{"account": "` + tag + `-notjson", amount_cents: oops`)},
		{why: "payload with an unknown field", key: idem.NewKey().String(), payload: []byte(`{"account":"` + tag + `-unknown","amount_cents":100,"currency":"EUR"}`)},
		{why: "negative amount", key: idem.NewKey().String(), payload: charge(tag+"-negative", -5)},
		{why: "same key as an intent, different payload", key: key, payload: charge(account, cents+1), mismatch: true},
		{why: "email without Idempotency-Key", subject: refapp.SubjectEmail, payload: []byte(`{"to":"` + tag + `@chaos.test","subject":"nokey","body":""}`)},
		{why: "email to no address", subject: refapp.SubjectEmail, key: idem.NewKey().String(), payload: []byte(`{"to":"` + tag + ` not an address","subject":"bad","body":""}`)},
	}
	for i, p := range r.poison {
		subject := refapp.SubjectCharge
		if p.subject != "" {
			subject = p.subject
		}
		msg := nats.NewMsg(subject)
		if p.key != "" {
			msg.Header.Set(idem.HeaderKey, p.key)
		}
		msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("chaos-%s-%d", tag, i))
		msg.Data = p.payload
		if err := r.publish(ctx, msg); err != nil {
			return fmt.Errorf("publish poison %q: %w", p.why, err)
		}
	}
	r.logf("published %d poison messages", len(r.poison))

	// Copies of published intents.
	rows, err := r.db.Pool.Query(ctx, `SELECT key, subject, payload FROM idem_outbox WHERE published_at IS NOT NULL ORDER BY id`)
	if err != nil {
		return fmt.Errorf("read outbox for copies: %w", err)
	}
	type outboxRow struct {
		key, subject string
		payload      []byte
	}
	var published []outboxRow
	for rows.Next() {
		var o outboxRow
		if err := rows.Scan(&o.key, &o.subject, &o.payload); err != nil {
			rows.Close()
			return fmt.Errorf("read outbox for copies: %w", err)
		}
		published = append(published, o)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read outbox for copies: %w", err)
	}
	n := min(r.cfg.copies, len(published))
	r.copied = map[string]bool{}
	for i, j := range rng.Perm(len(published))[:n] {
		o := published[j]
		r.copied[o.key] = true
		msg := nats.NewMsg(o.subject)
		msg.Header.Set(idem.HeaderKey, o.key)
		msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("chaos-copy-%s-%d", tag, i))
		msg.Data = o.payload
		if err := r.publish(ctx, msg); err != nil {
			return fmt.Errorf("publish a copy of %s: %w", o.key, err)
		}
	}
	r.logf("published %d copies of already-published intents", n)
	return nil
}

// publish publishes to JetStream, retrying through a nats-server restart. The
// Nats-Msg-Id makes the retries safe: the broker keeps one.
func (r *run) publish(ctx context.Context, msg *nats.Msg) error {
	var err error
	for attempt := 1; attempt <= 60; attempt++ {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err = r.js.PublishMsg(pctx, msg)
		cancel()
		if err == nil || ctx.Err() != nil {
			return err
		}
		select { // a publisher's back-off
		case <-time.After(250 * time.Millisecond):
		case <-ctx.Done():
		}
	}
	return err
}
