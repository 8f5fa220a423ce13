package chaos

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// figures are what one run measured. The first seven are the figures line.
type figures struct {
	intents     int // intents in the clients' journals (a press killed before its journal write is no intent)
	faults      int // faults that really happened: fault points fired + injected kills, restarts, terminations
	effects     int // ledger_entries rows
	folded      int // duplicates_folded: repeats folded at a unique constraint (see README)
	deadLetters int // idem_dead_letters rows
	lost        int // intents with no effect
	doubled     int // intents with more than one effect

	notDone        []string // journal entries not done (the client gave up or never heard back)
	stray          []string // effects whose key is no intent
	wrongPayload   []string // effects whose account/amount is not what the intent asked for
	poisonMissing  []string // injected poison that is not a dead letter
	poisonExtra    []string // dead letters that are no injected poison
	faultsByKind   map[string]int
	replays, folds int            // the two parts of folded
	doubledBy      map[string]int // why a doubled intent was delivered again, as far as the suite knows
}

func (f figures) String() string {
	return fmt.Sprintf("chaos: intents=%d faults=%d effects=%d duplicates_folded=%d dead_letters=%d lost=%d doubled=%d",
		f.intents, f.faults, f.effects, f.folded, f.deadLetters, f.lost, f.doubled)
}

// problems lists every way the run broke the guarantee.
func (f figures) problems() []string {
	var ps []string
	if f.lost > 0 {
		ps = append(ps, fmt.Sprintf("%d intents lost (no effect)", f.lost))
	}
	if f.doubled > 0 {
		ps = append(ps, fmt.Sprintf("%d intents doubled (more than one effect)", f.doubled))
	}
	add := func(what string, xs []string) {
		if len(xs) > 0 {
			ps = append(ps, fmt.Sprintf("%d %s: %s", len(xs), what, abbreviate(xs, 10)))
		}
	}
	add("journal entries not done", f.notDone)
	add("effects of no intent", f.stray)
	add("effects with the wrong payload", f.wrongPayload)
	add("poison messages not dead-lettered", f.poisonMissing)
	add("dead letters that are no injected poison", f.poisonExtra)
	return ps
}

// waitFor polls cond until it holds or timeout passes, saying every 10s what it is
// still waiting for. cond returns (holds, what is missing, error).
func (r *run) waitFor(ctx context.Context, timeout time.Duration, what string, cond func() (bool, string, error)) error {
	deadline := time.Now().Add(timeout)
	nextReport := time.Now().Add(10 * time.Second)
	for {
		ok, missing, err := cond()
		if err != nil {
			return fmt.Errorf("waiting for %s: %w", what, err)
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s waiting for %s: %s", timeout, what, missing)
		}
		if time.Now().After(nextReport) {
			r.logf("still waiting for %s: %s", what, missing)
			nextReport = time.Now().Add(10 * time.Second)
		}
		select {
		case <-time.After(200 * time.Millisecond): // poll interval
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// settle waits until the run has come to rest: the outbox is fully published, every
// intent has an effect (and, with the inbox on, an inbox row), the durable consumer
// has nothing pending or unacknowledged (so no redelivery is still on its way), and
// every poison message has been dealt with. A lost intent makes this time out; the
// checker then reports it.
func (r *run) settle(ctx context.Context, keys []string) error {
	return r.waitFor(ctx, r.cfg.settle, "the run to settle", func() (bool, string, error) {
		var unpublished, withEffect, inbox, dead int
		err := r.db.Pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM idem_outbox WHERE published_at IS NULL),
       (SELECT count(DISTINCT idempotency_key) FROM ledger_entries WHERE idempotency_key = ANY($1)),
       (SELECT count(*) FROM idem_inbox WHERE consumer = 'charges'),
       (SELECT count(*) FROM idem_dead_letters)`, keys).Scan(&unpublished, &withEffect, &inbox, &dead)
		if err != nil {
			return false, "", err
		}
		var missing []string
		if unpublished > 0 {
			missing = append(missing, fmt.Sprintf("%d outbox rows unpublished", unpublished))
		}
		if withEffect < len(keys) {
			missing = append(missing, fmt.Sprintf("%d of %d intents without an effect", len(keys)-withEffect, len(keys)))
		}
		if !r.cfg.negative && inbox < len(keys) {
			missing = append(missing, fmt.Sprintf("inbox has %d of %d keys", inbox, len(keys)))
		}
		if want := r.expectedDeadLetters(); dead < want {
			missing = append(missing, fmt.Sprintf("%d of %d dead letters", dead, want))
		}
		ictx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		c, err := r.js.Consumer(ictx, idem.StreamName, "charges")
		if err != nil {
			missing = append(missing, fmt.Sprintf("consumer info: %v", err))
		} else if info, err := c.Info(ictx); err != nil {
			missing = append(missing, fmt.Sprintf("consumer info: %v", err))
		} else if info.NumPending > 0 || info.NumAckPending > 0 {
			missing = append(missing, fmt.Sprintf("consumer has %d pending, %d unacknowledged (a redelivery waits out AckWait)", info.NumPending, info.NumAckPending))
		}
		return len(missing) == 0, strings.Join(missing, "; "), nil
	})
}

// expectedDeadLetters is how many dead letters a settled run has: every poison
// message, except in the negative control the mismatch, which runs as an effect.
func (r *run) expectedDeadLetters() int {
	if r.cfg.negative {
		return len(r.poison) - 1
	}
	return len(r.poison)
}

// check reads the database and the logs and computes the figures. It reads
// everything itself: nothing the workers report about themselves is trusted for
// lost or doubled.
func (r *run) check(ctx context.Context, journal []intentLine) (figures, error) {
	f := figures{intents: len(journal), faultsByKind: map[string]int{}, doubledBy: map[string]int{}}
	mismatchKey := ""
	for _, p := range r.poison {
		if p.mismatch {
			mismatchKey = p.key
		}
	}
	isIntent := make(map[string]bool, len(journal))
	for _, il := range journal {
		isIntent[il.Key] = true
		if il.Status != "done" {
			f.notDone = append(f.notDone, fmt.Sprintf("%s (%s after %d attempts)", il.Key, il.Status, il.Attempts))
		}
	}

	// Effects, by the key the client journaled.
	rows, err := r.db.Pool.Query(ctx, `SELECT idempotency_key, account, amount_cents FROM ledger_entries ORDER BY id`)
	if err != nil {
		return f, fmt.Errorf("read ledger: %w", err)
	}
	effects := map[string]int{}
	for rows.Next() {
		var key, account string
		var cents int64
		if err := rows.Scan(&key, &account, &cents); err != nil {
			rows.Close()
			return f, fmt.Errorf("read ledger: %w", err)
		}
		f.effects++
		effects[key]++
		if !isIntent[key] {
			f.stray = append(f.stray, fmt.Sprintf("%q (account %s)", key, account))
		}
		if want, ok := r.plan[account]; !ok || want != cents {
			f.wrongPayload = append(f.wrongPayload, fmt.Sprintf("%s: account %s amount %d", key, account, cents))
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return f, fmt.Errorf("read ledger: %w", err)
	}
	for key := range isIntent {
		switch n := effects[key]; {
		case n == 0:
			f.lost++
		case n > 1:
			f.doubled++
			switch {
			case key == mismatchKey:
				f.doubledBy["same-key poison"]++
			case r.copied[key]:
				f.doubledBy["published copy"]++
			default:
				f.doubledBy["redelivery or re-publish"]++
			}
		}
	}

	// Dead letters against the injected poison, as multisets of (key, payload).
	expected := map[string]int{}
	names := map[string]string{}
	for _, p := range r.poison {
		id := p.key + "\x00" + string(p.payload)
		expected[id]++
		names[id] = p.why
	}
	drows, err := r.db.Pool.Query(ctx, `SELECT key, payload, reason FROM idem_dead_letters ORDER BY id`)
	if err != nil {
		return f, fmt.Errorf("read dead letters: %w", err)
	}
	for drows.Next() {
		var key, reason string
		var payload []byte
		if err := drows.Scan(&key, &payload, &reason); err != nil {
			drows.Close()
			return f, fmt.Errorf("read dead letters: %w", err)
		}
		f.deadLetters++
		id := key + "\x00" + string(payload)
		if expected[id] > 0 {
			expected[id]--
			continue
		}
		f.poisonExtra = append(f.poisonExtra, fmt.Sprintf("key %q payload %q: %s", key, payload, reason))
	}
	drows.Close()
	if err := drows.Err(); err != nil {
		return f, fmt.Errorf("read dead letters: %w", err)
	}
	for id, n := range expected {
		for range n {
			f.poisonMissing = append(f.poisonMissing, names[id])
		}
	}
	sort.Strings(f.poisonMissing)

	// Faults: fault points that fired (the worker says so on stderr just before it
	// SIGKILLs itself) plus what the schedule did from outside.
	points := []string{"effect.before-commit", "consumer.after-commit", "relay.after-publish", "ingress.after-commit"}
	needles := []string{`msg="middleware: replayed"`, `msg="duplicate folded"`}
	for _, p := range points {
		needles = append(needles, "faults: "+p+" fired")
	}
	counts, err := r.procs.countInLogs("worker-", needles...)
	if err != nil {
		return f, err
	}
	for _, p := range points {
		f.faultsByKind[p] = counts["faults: "+p+" fired"]
	}
	f.faultsByKind["sigkill-worker"] = int(r.faults.workerKills.Load())
	f.faultsByKind["restart-nats"] = int(r.faults.natsRestarts.Load())
	f.faultsByKind["terminate-pg"] = int(r.faults.pgTerminations.Load())
	f.faultsByKind["sigkill-client"] = int(r.faults.clientKills.Load())
	for _, n := range f.faultsByKind {
		f.faults += n
	}

	// duplicates_folded = HTTP repeats answered from idem_requests + deliveries
	// folded by the idem_inbox claim.
	f.replays, f.folds = counts[needles[0]], counts[needles[1]]
	f.folded = f.replays + f.folds
	return f, nil
}

func abbreviate(xs []string, n int) string {
	if len(xs) <= n {
		return strings.Join(xs, "; ")
	}
	return strings.Join(xs[:n], "; ") + fmt.Sprintf("; ... and %d more", len(xs)-n)
}
