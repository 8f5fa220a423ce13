package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
)

// The store faults: JetStream loses messages it has acknowledged and that no
// consumer has taken yet. To be sure there are such messages, the consumers are
// held down first (their workers SIGKILLed and not restarted) while the relays go
// on publishing; once a backlog has built, nats-server is killed -9 and its store
// damaged before the restart:
//
//   - wipe: the store directory is deleted entirely (a broker that lost its disk,
//     or a stream deleted and recreated): the stream and the durable consumers are
//     gone, the workers must recreate them;
//   - truncate: the stream's last message block is cut to half its size (what a
//     machine that crashed loses of acknowledged writes not yet fsynced, with
//     JetStream at its default sync interval).
//
// The checker records the backlog (rows published since the consumers went down,
// each checked to be in the stream under its Nats-Msg-Id before the kill) and which
// of them the stream no longer holds after the restart; each fault must lose some.
//
// A third fault, wipe-live, wipes the store with the consumers running: their
// durable consumers vanish under them, and they must notice and recreate them
// (a consumer checks every 5s) once the worker has recreated the stream. Its
// backlog is whatever was published in the last seconds and not settled yet; it
// need not lose anything.

// Backlog a store fault waits for before it kills nats-server: enough charges and
// emails that both consumers lose some.
const minBacklogCharges, minBacklogEmails = 10, 3

// storeDamage is what one store fault did, as the checker saw it.
type storeDamage struct {
	kind       faultKind
	at         time.Duration // into the load
	held       time.Duration // how long the consumers were down before the kill
	backlog    int           // acknowledged, unconsumed messages in the stream at the kill
	lost       int           // of those, the ones the stream no longer held after the restart
	lostIDs    []int64       // their outbox rows
	lostKeys   []string      // and keys
	effected   int           // rows left out of the backlog: their effect happened before the hold
	lastBefore uint64        // the stream's last sequence at the kill
	lastAfter  uint64        // and after the restart (0: no stream)
	noStream   bool          // the stream did not exist after the restart
	storeGone  bool          // wipe: the store directory did not exist when nats-server started again
	block      string        // truncate: the block file cut
	blockFrom  int64         // its size before and after
	blockTo    int64
}

func (d storeDamage) String() string {
	consumers := "consumers running"
	if d.kind.holdsConsumers() {
		consumers = "consumers down " + d.held.Round(time.Millisecond).String()
	}
	s := fmt.Sprintf("@%s %s: %s; backlog=%d acknowledged unconsumed messages in the stream (%d more had their effect already), lost=%d of them;",
		d.at.Round(time.Millisecond), d.kind, consumers, d.backlog, d.effected, d.lost)
	if d.kind == truncateStore {
		s += fmt.Sprintf(" %s cut from %d to %d bytes;", d.block, d.blockFrom, d.blockTo)
	} else {
		s += fmt.Sprintf(" store directory gone at the restart: %v;", d.storeGone)
	}
	after := strconv.FormatUint(d.lastAfter, 10)
	if d.noStream {
		after = "none (no stream)"
	}
	return s + fmt.Sprintf(" stream last sequence %d before, %s after the restart", d.lastBefore, after)
}

// planStoreFaults draws n store faults, a wipe, a truncation and a live wipe in
// turn, one in the middle of each n+1-th of the load.
func planStoreFaults(rng *rand.Rand, n int, load time.Duration) []event {
	seg := load / time.Duration(n+1)
	var events []event
	for i := range n {
		kind := [...]faultKind{wipeStore, truncateStore, wipeStoreLive}[i%3]
		at := seg*time.Duration(i+1) - seg/4 + time.Duration(rng.Int64N(int64(seg/2)))
		events = append(events, event{at: at, kind: kind, pause: time.Duration(200+rng.IntN(300)) * time.Millisecond})
	}
	return events
}

// backlogRow is an outbox row the relay published while the consumers were down.
type backlogRow struct {
	id           int64
	key, subject string
	msgID        string
	seq          uint64
}

// storeFault runs one store fault (see above). It returns an error only when the
// run cannot go on (nats-server does not come back); a fault that did not find a
// backlog is recorded as having lost nothing, which the checker reports.
func (r *run) storeFault(ctx context.Context, e event) error {
	d := storeDamage{kind: e.kind, at: e.at}
	heldAt := time.Now()
	// By the database's clock: a row published after since, and not settled, has
	// not been consumed. Held consumers settle nothing; running ones go on, and
	// the backlog of a live wipe is what they had not settled of the last seconds.
	var since time.Time
	lookBack := "0s"
	if e.kind.holdsConsumers() {
		var consumers []*worker
		for _, w := range r.workers {
			if w.consumes() {
				consumers = append(consumers, w)
			}
		}
		defer func() {
			for _, w := range consumers {
				w.release()
			}
			r.logf("store fault %s: consumers released", e.kind)
		}()
		killed := 0
		for _, w := range consumers {
			if w.hold() {
				killed++
			}
		}
		r.faults.holdKills.Add(int64(killed))
		r.logf("fault: %s: holding the consumers down (%d workers SIGKILLed) for a backlog", e.kind, killed)
	} else {
		lookBack = "3s"
	}
	if err := r.retryDB(ctx, "read the database clock", func(ctx context.Context) error {
		return r.db.Pool.QueryRow(ctx, `SELECT now() - $1::interval`, lookBack).Scan(&since)
	}); err != nil {
		return err
	}
	var rows []backlogRow
	if e.kind.holdsConsumers() {
		err := r.waitFor(ctx, r.cfg.holdFor, "a backlog of unconsumed messages", func() (bool, string, error) {
			var err error
			if rows, err = r.unsettledSince(ctx, since); err != nil {
				return false, fmt.Sprintf("read the outbox: %v", err), nil
			}
			charges, emails := countSubjects(rows)
			return charges >= minBacklogCharges && emails >= minBacklogEmails,
				fmt.Sprintf("%d charges and %d emails published since the consumers went down", charges, emails), nil
		})
		if err != nil {
			r.logf("store fault %s: %v; damaging the store anyway", e.kind, err)
		}
	} else if err := r.retryDB(ctx, "read the outbox", func(ctx context.Context) error {
		var err error
		rows, err = r.unsettledSince(ctx, since)
		return err
	}); err != nil {
		return err
	}
	stream, err := r.stream(ctx)
	if err != nil {
		return err
	}
	var backlog []backlogRow
	if stream != nil {
		for _, b := range rows {
			in, err := r.inStream(ctx, stream, b)
			if err != nil {
				return err
			}
			if in {
				backlog = append(backlog, b)
			}
		}
		if info, err := stream.Info(ctx); err == nil {
			d.lastBefore = info.State.LastSeq
		}
	}
	if e.kind.holdsConsumers() {
		// A consumer killed by the hold between its effect and its settlement (the
		// mail sent, the inbox row not yet committed) left a row that looks
		// unconsumed: the log relay records a batch as published once the whole
		// batch is acknowledged, so such a row can carry a published_at after
		// since. Its intent has its effect already; it is no backlog.
		if backlog, d.effected, err = r.withoutEffect(ctx, backlog); err != nil {
			return err
		}
	}
	d.backlog, d.held = len(backlog), time.Since(heldAt)

	what := "store directory deleted"
	mutate := func() error {
		if err := os.RemoveAll(r.nats.storeDir); err != nil {
			return fmt.Errorf("delete the nats store: %w", err)
		}
		_, err := os.Stat(r.nats.storeDir)
		d.storeGone = errors.Is(err, os.ErrNotExist)
		return nil
	}
	if e.kind == truncateStore {
		what = "last message block truncated to half its size"
		mutate = func() error { return r.truncateLastBlock(&d) }
	}
	r.logf("fault: kill -9 nats-server (%s, %d unconsumed messages in the stream, last sequence %d), down for %s",
		what, d.backlog, d.lastBefore, e.pause)
	if err := r.nats.crashWith(ctx, e.pause, what, mutate); err != nil {
		return fmt.Errorf("store fault %s: %w", e.kind, err)
	}
	switch e.kind {
	case truncateStore:
		r.faults.storeTruncs.Add(1)
	case wipeStore:
		r.faults.storeWipes.Add(1)
	case wipeStoreLive:
		r.faults.storeWipesLive.Add(1)
	}

	// What the stream still holds of the backlog, read right after the restart
	// (the relays publish meanwhile, into the sequences the stream lost: a message
	// with another Nats-Msg-Id at a row's sequence is no longer the row's).
	if stream, err = r.stream(ctx); err != nil {
		return err
	}
	d.noStream = stream == nil
	if stream != nil {
		if info, err := stream.Info(ctx); err == nil {
			d.lastAfter = info.State.LastSeq
		}
	}
	for _, b := range backlog {
		in := false
		if stream != nil {
			if in, err = r.inStream(ctx, stream, b); err != nil {
				return err
			}
		}
		if !in {
			d.lost++
			d.lostIDs, d.lostKeys = append(d.lostIDs, b.id), append(d.lostKeys, b.key)
		}
	}
	r.logf("nats-server is back: %s", d)
	r.storeMu.Lock()
	r.damage = append(r.damage, d)
	r.storeMu.Unlock()
	return nil
}

// unsettledSince lists the outbox rows published into the run's stream after since
// that the consumer of their subject has not settled (no inbox row done, no dead
// letter).
func (r *run) unsettledSince(ctx context.Context, since time.Time) ([]backlogRow, error) {
	rs, err := r.db.Pool.Query(ctx, `
SELECT o.id, o.key, o.subject, o.msg_id, o.stream_seq FROM `+outboxRows+` AS o
WHERE o.published_at > $1 AND o.stream = $2 AND o.stream_seq IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM idem_inbox i WHERE i.key = o.key AND i.status = 'done'
                  AND i.consumer = CASE o.subject WHEN $3 THEN $4 ELSE $5 END)
  AND NOT EXISTS (SELECT 1 FROM idem_dead_letters dl WHERE dl.key = o.key)
ORDER BY o.id`, since, refapp.StreamName, refapp.SubjectCharge, refapp.ChargeConsumer, refapp.EmailConsumer)
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	var out []backlogRow
	for rs.Next() {
		var b backlogRow
		var seq int64
		if err := rs.Scan(&b.id, &b.key, &b.subject, &b.msgID, &seq); err != nil {
			return nil, err
		}
		b.seq = uint64(seq)
		out = append(out, b)
	}
	return out, rs.Err()
}

// withoutEffect is rows without those whose intent has its effect (a ledger row,
// a mail delivered), and how many it left out. Called with the consumers held
// down, so no effect can happen between this read and the store fault.
func (r *run) withoutEffect(ctx context.Context, rows []backlogRow) ([]backlogRow, int, error) {
	var out []backlogRow
	for _, b := range rows {
		var ledger int
		if err := r.retryDB(ctx, "read the ledger", func(ctx context.Context) error {
			return r.db.Pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entries WHERE idempotency_key = $1`, b.key).Scan(&ledger)
		}); err != nil {
			return nil, 0, err
		}
		if ledger > 0 || b.subject == refapp.SubjectEmail && r.smtp.DeliveriesOf(refapp.MessageID(b.key)) > 0 {
			continue
		}
		out = append(out, b)
	}
	return out, len(rows) - len(out), nil
}

func countSubjects(rows []backlogRow) (charges, emails int) {
	for _, b := range rows {
		switch b.subject {
		case refapp.SubjectCharge:
			charges++
		case refapp.SubjectEmail:
			emails++
		}
	}
	return charges, emails
}

// stream is the run's stream, or nil when it does not exist; it retries while the
// broker is not answering (it may just have restarted), for up to 30s.
func (r *run) stream(ctx context.Context) (jetstream.Stream, error) {
	var s jetstream.Stream
	err := r.retryJS(ctx, "look up the stream", func(ctx context.Context) error {
		var err error
		s, err = r.js.Stream(ctx, refapp.StreamName)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			s, err = nil, nil
		}
		return err
	})
	return s, err
}

// inStream reports whether the stream still holds b: at its sequence, a message
// with its Nats-Msg-Id.
func (r *run) inStream(ctx context.Context, s jetstream.Stream, b backlogRow) (bool, error) {
	var in bool
	err := r.retryJS(ctx, fmt.Sprintf("read sequence %d", b.seq), func(ctx context.Context) error {
		m, err := s.GetMsg(ctx, b.seq)
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound), errors.Is(err, jetstream.ErrStreamNotFound):
			in = false
			return nil
		case err != nil:
			return err
		}
		in = m.Header.Get(idem.HeaderMsgID) == b.msgID
		return nil
	})
	return in, err
}

// retryJS runs fn until it succeeds, for up to 30s: the checker's JetStream calls
// right after a restart may find the server not answering yet.
func (r *run) retryJS(ctx context.Context, what string, fn func(context.Context) error) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := fn(cctx)
		cancel()
		if err == nil || ctx.Err() != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("chaos: %s: %w", what, err)
		}
		select { // poll interval
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
		}
	}
}

// truncateLastBlock cuts the stream's highest-numbered message block to half its
// size, recording which and how much.
func (r *run) truncateLastBlock(d *storeDamage) error {
	dir := r.nats.streamMsgsDir(refapp.StreamName)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("list the stream's blocks: %w", err)
	}
	last := -1
	for _, e := range entries {
		n, err := strconv.Atoi(strings.TrimSuffix(e.Name(), ".blk"))
		if err == nil && strings.HasSuffix(e.Name(), ".blk") && n > last {
			last = n
		}
	}
	if last < 0 {
		return fmt.Errorf("no message block in %s", dir)
	}
	d.block = fmt.Sprintf("%d.blk", last)
	path := filepath.Join(dir, d.block)
	st, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("truncate %s: %w", path, err)
	}
	d.blockFrom = st.Size()
	if err := os.Truncate(path, d.blockFrom/2); err != nil {
		return fmt.Errorf("truncate %s: %w", path, err)
	}
	st, err = os.Stat(path)
	if err != nil {
		return fmt.Errorf("truncate %s: %w", path, err)
	}
	d.blockTo = st.Size()
	return nil
}
