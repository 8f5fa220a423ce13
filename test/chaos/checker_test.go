package chaos

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/idemkit/idem/app/refapp"
)

// figures are what one run measured. The first eight are the figures line.
type figures struct {
	intents     int // intents in the clients' journals (a press killed before its journal write is no intent)
	faults      int // faults that really happened: fault points fired + injected kills, restarts, terminations, outages, marked messages acted on
	effects     int // ledger_entries rows + distinct Message-IDs the mail sink accepted
	folded      int // duplicates_folded: repeats folded instead of taking effect again (see README)
	deadLetters int // idem_dead_letters rows
	rejected    int // oversize presses answered 413, journaled as rejected, and without any trace in the database
	lost        int // intents with no effect
	doubled     int // intents with more than one effect

	notDone        []string // journal entries not done (the client gave up or never heard back)
	stray          []string // effects that belong to no intent
	wrongPayload   []string // effects that are not what their intent asked for
	poisonMissing  []string // injected poison that is not a dead letter
	poisonExtra    []string // dead letters that are no injected poison
	poisonWrong    []string // dead letters of injected poison filed by the wrong consumer or for the wrong reason
	notRetrying    []string // the panicking message, left retrying by a short run, not in the state it must be in
	oversizeWrong  []string // oversize presses not rejected with 413, or with a trace in the database
	marked         []string // what became of each marked message, for the log
	rawDead        int      // raw oversize outbox rows dead-lettered by the relay
	relayCharged   int      // published outbox rows the relay had charged failed publishes first (diagnostic)
	relayMostTries int      // the most publishes one of those took
	deadByConsumer map[string]int
	charges        int // intents by kind
	emails         int
	faultsByKind   map[string]int
	replays        int            // HTTP repeats answered from idem_requests
	folds          int            // deliveries folded by the idem_inbox claim
	resends        int            // SMTP re-sends with the same Message-ID, folded by the mail system
	doubledBy      map[string]int // why a doubled intent was delivered again, as far as the suite knows
	smtpDeliveries int            // raw messages the mail sink accepted
	store          storeFigures   // the store runs' (store_test.go)
	cluster        clusterFigures // the cluster runs' (cluster_test.go)
}

func (f figures) String() string {
	return fmt.Sprintf("chaos: intents=%d faults=%d effects=%d duplicates_folded=%d dead_letters=%d rejected=%d lost=%d doubled=%d",
		f.intents, f.faults, f.effects, f.folded, f.deadLetters, f.rejected, f.lost, f.doubled)
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
	add("dead letters with the wrong consumer or reason", f.poisonWrong)
	add("retrying messages not as they must be", f.notRetrying)
	add("oversize presses not refused cleanly", f.oversizeWrong)
	return ps
}

// missingFaults lists the faults the run was to inject and did not: a run that
// passes without them proves less than it claims.
func (f figures) missingFaults(cfg config) []string {
	var ps []string
	if n := f.faultsByKind["outage-pg"]; n < cfg.outages {
		ps = append(ps, fmt.Sprintf("%d of %d Postgres outages happened", n, cfg.outages))
	}
	if !cfg.noInjections {
		if f.faultsByKind["marked-kill"] == 0 {
			ps = append(ps, "the message marked Idem-Fault: kill never killed a worker")
		}
		if f.faultsByKind["marked-panic"] == 0 {
			ps = append(ps, "the message marked Idem-Fault: panic never made its handler panic")
		}
	}
	ps = append(ps, f.clusterMissing(cfg)...)
	return append(ps, f.storeMissing(cfg)...)
}

// journal is every intent the clients made, split by kind.
type journal struct {
	lines    []intentLine
	charges  []string // keys
	emails   []string
	oversize []intentLine // the oversize presses' journal: each must be rejected with 413
	direct   []string     // keys of the charges published straight to the stream (also in charges)
}

// newJournal sorts the lines by kind (known from the response the client journaled).
// An intent that is not done has no response and no kind: the checker reports it.
func newJournal(lines []intentLine) journal {
	j := journal{lines: lines}
	for _, il := range lines {
		switch il.kind() {
		case "charge":
			j.charges = append(j.charges, il.Key)
		case "email":
			j.emails = append(j.emails, il.Key)
		}
	}
	return j
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

// settle waits until the run has come to rest: the outbox is fully published,
// every intent has an effect (a ledger row, a mail with its Message-ID) and, where
// the inbox is on, an inbox row; every poison message has been dealt with; and the
// durable consumers have nothing pending or unacknowledged (so no redelivery is
// still on its way). A lost intent makes this time out; the checker then reports it.
//
// A run whose reconciler is to prove delivery (awaitsProof) also waits until it
// has: no published row is still unproven (completed_at and alerted_at NULL). A
// run that must lose intents (lossControl) cannot settle: it waits for quiescence
// instead.
func (r *run) settle(ctx context.Context, j journal) error {
	if r.cfg.lossControl {
		return r.quiesce(ctx)
	}
	mailIDs := make([]string, len(j.emails))
	for i, k := range j.emails {
		mailIDs[i] = refapp.MessageID(k)
	}
	return r.waitFor(ctx, r.cfg.settle, "the run to settle", func() (bool, string, error) {
		var unpublished, charged, chargesInbox, emailsInbox, dead, unproven int
		err := r.db.Pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM `+outboxView+` WHERE published_at IS NULL AND dead_lettered_at IS NULL),
       (SELECT count(DISTINCT idempotency_key) FROM ledger_entries WHERE idempotency_key = ANY($1)),
       (SELECT count(*) FROM idem_inbox WHERE consumer = 'charges'),
       (SELECT count(*) FROM idem_inbox WHERE consumer = 'emails' AND status = 'done'),
       (SELECT count(*) FROM idem_dead_letters),
       (SELECT count(*) FROM `+outboxView+` WHERE published_at IS NOT NULL AND completed_at IS NULL AND alerted_at IS NULL)`,
			j.charges).Scan(&unpublished, &charged, &chargesInbox, &emailsInbox, &dead, &unproven)
		if err != nil {
			return false, "", err
		}
		mailed := 0
		for _, id := range mailIDs {
			if r.smtp.DeliveriesOf(id) > 0 {
				mailed++
			}
		}
		var missing []string
		if unpublished > 0 {
			missing = append(missing, fmt.Sprintf("%d outbox rows neither published nor dead-lettered", unpublished))
		}
		if r.cfg.awaitsProof() && unproven > 0 {
			missing = append(missing, fmt.Sprintf("%d published outbox rows not yet proven settled by the reconciler", unproven))
		}
		if charged < len(j.charges) {
			missing = append(missing, fmt.Sprintf("%d of %d charges without a ledger row", len(j.charges)-charged, len(j.charges)))
		}
		if mailed < len(j.emails) {
			missing = append(missing, fmt.Sprintf("%d of %d emails not mailed", len(j.emails)-mailed, len(j.emails)))
		}
		if !r.cfg.negative && chargesInbox < len(j.charges) {
			missing = append(missing, fmt.Sprintf("charges inbox has %d of %d keys", chargesInbox, len(j.charges)))
		}
		if emailsInbox < len(j.emails) {
			missing = append(missing, fmt.Sprintf("emails inbox has %d of %d keys done", emailsInbox, len(j.emails)))
		}
		if want := r.expectedDeadLetters(); dead < want {
			missing = append(missing, fmt.Sprintf("%d of %d dead letters", dead, want))
		}
		// A message still retrying (the panicking one in a short run) stays
		// unacknowledged: it may be the charge consumer's one unacked message,
		// once it has been charged a few failed attempts.
		retrying := 0
		for _, p := range r.poison {
			if !p.retrying {
				continue
			}
			st, err := r.retryState(ctx, p)
			if err != nil {
				return false, "", err
			}
			if st.deadLetters > 0 {
				continue
			}
			retrying++
			if st.attempts < minRetryAttempts {
				missing = append(missing, fmt.Sprintf("message %q charged %d of %d failed attempts", p.why, st.attempts, minRetryAttempts))
			}
		}
		for _, c := range []struct {
			name         string
			mayBeUnacked int
		}{{refapp.ChargeConsumer, retrying}, {refapp.EmailConsumer, 0}} {
			if m := r.consumerBusy(ctx, c.name, c.mayBeUnacked); m != "" {
				missing = append(missing, m)
			}
		}
		return len(missing) == 0, strings.Join(missing, "; "), nil
	})
}

// quiesce waits, for a run that must lose intents (lossControl), until nothing is
// left in flight: every outbox row published (or dead-lettered) and both durable
// consumers with nothing pending and nothing unacknowledged, for 2s in a row.
// What has no effect by then has none coming: nothing re-drives it. A run that
// never comes to rest times out, and the checker counts anyway.
func (r *run) quiesce(ctx context.Context) error {
	quiet := 0
	return r.waitFor(ctx, r.cfg.settle, "the run to come to rest (it cannot settle: it loses intents)", func() (bool, string, error) {
		var unpublished int
		if err := r.db.Pool.QueryRow(ctx, `SELECT count(*) FROM `+outboxView+` WHERE published_at IS NULL AND dead_lettered_at IS NULL`).Scan(&unpublished); err != nil {
			return false, "", err
		}
		var busy []string
		if unpublished > 0 {
			busy = append(busy, fmt.Sprintf("%d outbox rows neither published nor dead-lettered", unpublished))
		}
		for _, name := range []string{refapp.ChargeConsumer, refapp.EmailConsumer} {
			if m := r.consumerBusy(ctx, name, 0); m != "" {
				busy = append(busy, m)
			}
		}
		if len(busy) > 0 {
			quiet = 0
			return false, strings.Join(busy, "; "), nil
		}
		quiet++
		return quiet >= 10, "quiet for a moment only", nil // 10 polls of 200ms
	})
}

// minRetryAttempts is how many failed attempts a message still retrying at the end
// of a run must have been charged: enough to show it is retried alone, with its
// backoff, and counted.
const minRetryAttempts = 3

// retryState is what the database says of a message that may still be retrying.
type retryState struct {
	attempts    int    // idem_attempts for the charge consumer and its key
	lastError   string // the failure recorded last
	deadLetters int    // its dead letters
	effects     int    // ledger rows and inbox rows of its key (must stay 0)
}

func (r *run) retryState(ctx context.Context, p poison) (retryState, error) {
	var st retryState
	err := r.db.Pool.QueryRow(ctx, `
SELECT COALESCE((SELECT attempts FROM idem_attempts WHERE consumer = $1 AND key = $2), 0),
       COALESCE((SELECT last_error FROM idem_attempts WHERE consumer = $1 AND key = $2), ''),
       (SELECT count(*) FROM idem_dead_letters WHERE consumer = $1 AND key = $2),
       (SELECT count(*) FROM ledger_entries WHERE idempotency_key = $2) + (SELECT count(*) FROM idem_inbox WHERE key = $2)`,
		p.consumer, p.key).Scan(&st.attempts, &st.lastError, &st.deadLetters, &st.effects)
	if err != nil {
		return st, fmt.Errorf("read the attempts of %q: %w", p.why, err)
	}
	return st, nil
}

// consumerBusy says what the durable consumer name still has in flight beyond
// mayBeUnacked unacknowledged messages, or "". A message is unacknowledged from its
// delivery to its ack or terminate, through its redeliveries and back-offs.
func (r *run) consumerBusy(ctx context.Context, name string, mayBeUnacked int) string {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	c, err := r.js.Consumer(ctx, refapp.StreamName, name)
	if err != nil {
		return fmt.Sprintf("consumer %s: %v", name, err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		return fmt.Sprintf("consumer %s: %v", name, err)
	}
	if info.NumPending > 0 || info.NumAckPending > mayBeUnacked {
		return fmt.Sprintf("consumer %s has %d pending, %d unacknowledged (a redelivery waits out AckWait)", name, info.NumPending, info.NumAckPending)
	}
	return ""
}

// expectedDeadLetters is how many dead letters a settled run has at least: every
// poison message, except one still retrying and, in the negative control, the
// charge mismatch, which runs as an effect there.
func (r *run) expectedDeadLetters() int {
	n := 0
	for _, p := range r.poison {
		if !p.retrying && !(r.cfg.negative && p.mismatch) {
			n++
		}
	}
	return n
}

// check reads the database, the mail sink and the logs and computes the figures. It
// reads everything itself: nothing the workers report about themselves is trusted
// for lost or doubled.
func (r *run) check(ctx context.Context, j journal) (figures, error) {
	f := figures{intents: len(j.lines) + len(j.direct), charges: len(j.charges), emails: len(j.emails),
		faultsByKind: map[string]int{}, doubledBy: map[string]int{}, deadByConsumer: map[string]int{}}
	for _, il := range j.lines {
		if il.Status != "done" || il.kind() == "" {
			f.notDone = append(f.notDone, fmt.Sprintf("%s (%s after %d attempts, response %s)", il.Key, il.Status, il.Attempts, il.Response))
		}
	}
	if err := r.checkCharges(ctx, j, &f); err != nil {
		return f, err
	}
	r.checkEmails(j, &f)
	if err := r.checkDeadLetters(ctx, &f); err != nil {
		return f, err
	}
	if err := r.checkOversize(ctx, j, &f); err != nil {
		return f, err
	}
	// What the marked messages did to their batch-mates: a charge of their burst
	// that was charged a redelivered attempt had a worker die under it (the one the
	// kill-marked message took down, or a fault's). checkCharges has already
	// counted whether each took effect exactly once.
	if !r.cfg.noInjections {
		var redelivered int
		if err := r.db.Pool.QueryRow(ctx, `SELECT count(*) FROM idem_attempts WHERE consumer = $1 AND key = ANY($2)`,
			refapp.ChargeConsumer, j.direct).Scan(&redelivered); err != nil {
			return f, fmt.Errorf("read the burst's attempts: %w", err)
		}
		f.marked = append(f.marked, fmt.Sprintf("their burst: %d charges, %d of them redelivered after a worker died under them", len(j.direct), redelivered))
	}
	// A diagnostic, not a verdict: rows the relay charged a failed publish before
	// it got one through. A publish is charged only when the broker answers (one
	// that fails while the broker is down costs nothing), so these are failures
	// the relay blamed on the row. A row the reconciler re-drove was published
	// once per generation, each publish counted in attempts.
	if err := r.db.Pool.QueryRow(ctx, `SELECT count(*), COALESCE(max(attempts), 0) FROM `+outboxView+` WHERE published_at IS NOT NULL AND attempts > generation + 1`).
		Scan(&f.relayCharged, &f.relayMostTries); err != nil {
		return f, fmt.Errorf("read the outbox's attempts: %w", err)
	}
	if r.cfg.storeFaults > 0 {
		if err := r.checkStore(ctx, &f); err != nil {
			return f, err
		}
	}
	if r.cfg.cluster {
		r.clusterFigures(ctx, &f) // before countFromLogs, which adds up faultsByKind
	}
	return f, r.countFromLogs(&f)
}

// checkCharges: every charge intent has exactly one ledger row, with its amount.
func (r *run) checkCharges(ctx context.Context, j journal, f *figures) error {
	isCharge := make(map[string]bool, len(j.charges))
	for _, k := range j.charges {
		isCharge[k] = true
	}
	mismatchKey := ""
	for _, p := range r.poison {
		if p.mismatch {
			mismatchKey = p.key
		}
	}
	rows, err := r.db.Pool.Query(ctx, `SELECT idempotency_key, account, amount_cents FROM ledger_entries ORDER BY id`)
	if err != nil {
		return fmt.Errorf("read ledger: %w", err)
	}
	defer rows.Close()
	effects := map[string]int{}
	for rows.Next() {
		var key, account string
		var cents int64
		if err := rows.Scan(&key, &account, &cents); err != nil {
			return fmt.Errorf("read ledger: %w", err)
		}
		f.effects++
		effects[key]++
		if !isCharge[key] {
			f.stray = append(f.stray, fmt.Sprintf("ledger row for %q (account %s)", key, account))
		}
		if p, ok := r.plan[account]; !ok || p.email || p.cents != cents {
			f.wrongPayload = append(f.wrongPayload, fmt.Sprintf("ledger row for %s: account %s amount %d", key, account, cents))
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read ledger: %w", err)
	}
	for _, key := range j.charges {
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
	return nil
}

// checkEmails: every email intent reached the mail sink under the Message-ID derived
// from its key, to its recipient with its subject, and each recipient (one per
// intent) got one distinct message. Re-sends of the same Message-ID are what a
// worker killed between the send and its completion leaves; a mail system folds
// them, and they are counted as such.
func (r *run) checkEmails(j journal, f *figures) {
	keyOf := make(map[string]string, len(j.emails)) // Message-ID -> key
	for _, k := range j.emails {
		keyOf[refapp.MessageID(k)] = k
	}
	deliveries := map[string]int{}      // key -> raw messages
	ids := map[string]map[string]bool{} // recipient -> distinct Message-IDs
	for _, m := range r.smtp.Messages() {
		f.smtpDeliveries++
		rcpt := strings.Join(m.To, ",")
		if ids[rcpt] == nil {
			ids[rcpt] = map[string]bool{}
		}
		ids[rcpt][m.MessageID] = true
		key, ok := keyOf[m.MessageID]
		if !ok {
			f.stray = append(f.stray, fmt.Sprintf("mail %s to %s", m.MessageID, rcpt))
			continue
		}
		deliveries[key]++
		if deliveries[key] > 1 {
			continue // a re-send: same message
		}
		f.effects++
		account, _, _ := strings.Cut(rcpt, "@")
		p, ok := r.plan[account]
		if !ok || !p.email || rcpt != p.recipient() || m.Header.Get("Subject") != p.subject() {
			f.wrongPayload = append(f.wrongPayload, fmt.Sprintf("mail for %s: to %s subject %q", key, rcpt, m.Header.Get("Subject")))
		}
	}
	for _, k := range j.emails {
		switch n := deliveries[k]; {
		case n == 0:
			f.lost++
		case n > 1:
			f.resends += n - 1
		}
	}
	for rcpt, set := range ids {
		if len(set) > 1 {
			f.doubled++
			f.doubledBy["second message to "+rcpt]++
		}
	}
}

// checkDeadLetters compares the dead letters with the injected poison, as multisets
// of (key, payload), and checks that each was filed by the consumer (or the relay)
// and for the reason its kind of poison must give. A message left retrying must be
// in the state checkRetrying describes.
func (r *run) checkDeadLetters(ctx context.Context, f *figures) error {
	type want struct {
		p       poison
		matched bool
	}
	byID := map[string][]*want{}
	var all []*want
	for _, p := range r.poison {
		w := &want{p: p}
		id := p.key + "\x00" + string(p.payload)
		byID[id] = append(byID[id], w)
		all = append(all, w)
	}
	rows, err := r.db.Pool.Query(ctx, `SELECT consumer, key, payload, reason FROM idem_dead_letters ORDER BY id`)
	if err != nil {
		return fmt.Errorf("read dead letters: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var consumer, key, reason string
		var payload []byte
		if err := rows.Scan(&consumer, &key, &payload, &reason); err != nil {
			return fmt.Errorf("read dead letters: %w", err)
		}
		f.deadLetters++
		f.deadByConsumer[consumer]++
		var w *want
		for _, c := range byID[key+"\x00"+string(payload)] {
			if !c.matched {
				w = c
				break
			}
		}
		if w == nil {
			f.poisonExtra = append(f.poisonExtra, fmt.Sprintf("%s: key %q payload %q: %s", consumer, key, abbreviateBytes(payload, 120), reason))
			continue
		}
		w.matched = true
		if !w.p.filedAs(consumer, reason) {
			f.poisonWrong = append(f.poisonWrong, fmt.Sprintf("%s: filed by %s for %q; want %s for %q", w.p.why, consumer, reason, w.p.consumer, strings.Join(w.p.reason, `" and "`)))
		}
		if w.p.raw {
			f.rawDead++
		}
		if w.p.mark != "" {
			f.marked = append(f.marked, fmt.Sprintf("Idem-Fault: %s: dead letter of %s: %s", w.p.mark, consumer, reason))
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read dead letters: %w", err)
	}
	for _, w := range all {
		switch {
		case w.matched:
		case w.p.retrying:
			if err := r.checkRetrying(ctx, w.p, f); err != nil {
				return err
			}
		default:
			f.poisonMissing = append(f.poisonMissing, w.p.why)
		}
	}
	sort.Strings(f.poisonMissing)
	return nil
}

// filedAs reports whether a dead letter filed by consumer for reason is the one p
// must become.
func (p poison) filedAs(consumer, reason string) bool {
	if p.consumer != "" && consumer != p.consumer {
		return false
	}
	for _, s := range p.reason {
		if !strings.Contains(reason, s) {
			return false
		}
	}
	return true
}

// checkRetrying: a message the run ended before it could use up its attempts (the
// panicking one in a short run) has been charged at least minRetryAttempts failed
// attempts in Postgres, the last one failed by the handler's panic, and it has no
// effect and no inbox row.
func (r *run) checkRetrying(ctx context.Context, p poison, f *figures) error {
	st, err := r.retryState(ctx, p)
	if err != nil {
		return err
	}
	f.marked = append(f.marked, fmt.Sprintf("Idem-Fault: %s: still retrying (the run ends before its backoff does): %d attempts charged, last error %q",
		p.mark, st.attempts, st.lastError))
	switch {
	case st.attempts < minRetryAttempts:
		f.notRetrying = append(f.notRetrying, fmt.Sprintf("%s: %d attempts charged, want at least %d", p.why, st.attempts, minRetryAttempts))
	case !strings.Contains(st.lastError, "panicked"):
		f.notRetrying = append(f.notRetrying, fmt.Sprintf("%s: last error %q, want the handler's panic", p.why, st.lastError))
	}
	if st.effects > 0 {
		f.notRetrying = append(f.notRetrying, fmt.Sprintf("%s: %d ledger or inbox rows", p.why, st.effects))
	}
	return nil
}

// checkOversize: every oversize press is in its journal as rejected with 413, and
// left nothing in the database: no stored request but the 413, no payment, no
// outbox row, no inbox row, no ledger row, no dead letter.
func (r *run) checkOversize(ctx context.Context, j journal, f *figures) error {
	if len(j.oversize) != r.cfg.oversize {
		f.oversizeWrong = append(f.oversizeWrong, fmt.Sprintf("%d oversize presses in their journal, %d were made", len(j.oversize), r.cfg.oversize))
	}
	var keys []string
	for _, il := range j.oversize {
		keys = append(keys, il.Key)
		if il.Status != "rejected" || il.HTTPStatus != 413 {
			f.oversizeWrong = append(f.oversizeWrong, fmt.Sprintf("%s: %s with HTTP %d after %d attempts, want rejected with 413 (response %s)",
				il.Key, il.Status, il.HTTPStatus, il.Attempts, abbreviateBytes(il.Response, 200)))
			continue
		}
		f.rejected++
	}
	var requests, payments, outboxRows, inbox, ledger, dead int
	err := r.db.Pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM idem_requests WHERE key = ANY($1) AND response_code IS DISTINCT FROM 413),
       (SELECT count(*) FROM payments WHERE idempotency_key = ANY($1)),
       (SELECT count(*) FROM idem_outbox WHERE key = ANY($1)),
       (SELECT count(*) FROM idem_inbox WHERE key = ANY($1)),
       (SELECT count(*) FROM ledger_entries WHERE idempotency_key = ANY($1)),
       (SELECT count(*) FROM idem_dead_letters WHERE key = ANY($1))`, keys).Scan(&requests, &payments, &outboxRows, &inbox, &ledger, &dead)
	if err != nil {
		return fmt.Errorf("read the oversize presses' traces: %w", err)
	}
	if n := requests + payments + outboxRows + inbox + ledger + dead; n > 0 {
		f.oversizeWrong = append(f.oversizeWrong, fmt.Sprintf("traces of oversize presses: %d stored requests other than 413, %d payments, %d outbox rows, %d inbox rows, %d ledger rows, %d dead letters",
			requests, payments, outboxRows, inbox, ledger, dead))
		f.rejected = 0
	}
	return nil
}

func abbreviateBytes(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return fmt.Sprintf("%s... (%d bytes)", b[:n], len(b))
}

// faultPoints are the deterministic fault points the suite arms.
func faultPoints() []string {
	return []string{"effect.before-commit", "consumer.after-commit", "external.after-perform", "relay.after-publish", "ingress.after-commit"}
}

// countFromLogs counts the fault points that fired (the worker says so on stderr
// just before it SIGKILLs itself), adds what the schedule did from outside, and
// counts the folded repeats: HTTP replays and inbox folds, which the workers log at
// debug level, plus the mail re-sends counted by checkEmails.
func (r *run) countFromLogs(f *figures) error {
	const replayed, folded = `msg="producer: replayed"`, `msg="duplicate folded"`
	// What the marked messages did: the worker says so before it kills itself; the
	// consumer logs each panic it recovered.
	const markedKill, markedPanic = "faults: consumer.marked-messages: a marked message kills its worker", `msg="handler panicked"`
	needles := []string{replayed, folded, markedKill, markedPanic}
	for _, p := range faultPoints() {
		needles = append(needles, "faults: "+p+" fired")
	}
	counts, err := r.procs.countInLogs("worker-", needles...)
	if err != nil {
		return err
	}
	for _, p := range faultPoints() {
		f.faultsByKind[p] = counts["faults: "+p+" fired"]
	}
	f.faultsByKind["sigkill-worker"] = int(r.faults.workerKills.Load())
	f.faultsByKind["restart-nats"] = int(r.faults.natsRestarts.Load())
	f.faultsByKind["terminate-pg"] = int(r.faults.pgTerminations.Load())
	f.faultsByKind["sigkill-client"] = int(r.faults.clientKills.Load())
	f.faultsByKind["outage-pg"] = int(r.faults.pgOutages.Load())
	if r.cfg.storeFaults > 0 {
		f.faultsByKind["wipe-nats-store"] = int(r.faults.storeWipes.Load())
		f.faultsByKind["wipe-nats-store-live"] = int(r.faults.storeWipesLive.Load())
		f.faultsByKind["truncate-nats-block"] = int(r.faults.storeTruncs.Load())
		f.faultsByKind["hold-consumers"] = int(r.faults.holdKills.Load())
	}
	f.faultsByKind["marked-kill"] = counts[markedKill]
	f.faultsByKind["marked-panic"] = counts[markedPanic]
	for _, n := range f.faultsByKind {
		f.faults += n
	}
	f.replays, f.folds = counts[replayed], counts[folded]
	f.folded = f.replays + f.folds + f.resends
	return nil
}

func abbreviate(xs []string, n int) string {
	if len(xs) <= n {
		return strings.Join(xs, "; ")
	}
	return strings.Join(xs[:n], "; ") + fmt.Sprintf("; ... and %d more", len(xs)-n)
}

// outboxView is idem_outbox as the checker reads it, whichever relay published a
// row: published_at, stream and stream_seq are where the polling relay marked it
// published, or where the log relay's window (idem_outbox_published) says the
// stream put it. The log relay never marks a row.
const outboxView = outboxRows + ` AS idem_outbox`

// outboxRows is outboxView without its name.
const outboxRows = `(
SELECT o.id, o.key, o.subject, o.msg_id, o.headers, o.payload, o.created_at, o.attempts, o.generation,
       o.dead_lettered_at, o.completed_at, o.alerted_at, o.expires_at, o.relay, o.message_name,
       COALESCE(o.published_at, w.published_at) AS published_at,
       COALESCE(o.stream, w.stream) AS stream, COALESCE(o.stream_seq, w.seq) AS stream_seq
FROM idem_outbox o
LEFT JOIN LATERAL (
  SELECT w.published_at, w.stream, s.seq FROM idem_outbox_published w, unnest(w.ids, w.seqs) AS s(id, seq)
  WHERE o.relay = 'log' AND w.id_range @> o.id AND s.id = o.id
  ORDER BY w.id LIMIT 1) AS w ON true
)`
