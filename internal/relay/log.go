package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/otelmsg"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/internal/wake"
)

// LogRelay publishes the outbox rows that Postgres's log streams to it: a logical
// replication slot of the installation, decoded by pgoutput from a publication of
// idem_outbox's INSERTs. It reads each committed row once, in commit order,
// publishes it with the Nats-Msg-Id of the polling relay, and never updates it.
// What it published, and where the stream put each row, it writes once per window
// of rows (idem_outbox_published), and only then tells the slot it may forget
// them: the slot's confirmed position never passes a row whose PubAck has not
// come. A crash before that re-reads the window from the slot and publishes it
// again, which the broker's duplicate window and the inbox fold.
//
// One relay reads a slot at a time: Postgres lets one walsender stream it. Every
// other LogRelay of the installation stands by and takes the slot over when its
// reader's connection ends (a crash, a kill, a network that gave up).
//
// A row it cannot publish while the broker answers (a refusal, a PubAck that did
// not come) it hands over to the polling relay (Relay), which runs beside it for
// such rows and for the reconciler's re-drives, with its backoff, MaxAttempts and
// dead letters. While the broker does not answer it publishes nothing more,
// confirms nothing, and starts again from the slot's position when it is back.
type LogRelay struct {
	pool       *pgxpool.Pool
	js         jetstream.JetStream
	cfg        Config
	stream     string
	schema     string
	log        *slog.Logger
	observe    idem.Observer
	st         *store.Store
	pubOpts    []jetstream.PublishOpt
	tracer     trace.Tracer
	handedOver func() // wakes the polling relay that takes handed-over rows
	// waker is told once new rows are a log relay's (the outbox's default says
	// so): from then on this process's Outboxes wake no polling relay.
	waker *wake.Waker
	// awaitProof: windows wait for the reconciler's proof before the collector
	// may delete them; without a reconciler a window is proven as it is written.
	awaitProof bool

	names LogNames
	// reading: this relay streams the slot now (the others stand by).
	reading atomic.Bool
	// confirmedAt is when the slot's position last moved (unix nanoseconds).
	confirmedAt atomic.Int64
}

// Defaults of the log relay's timing.
const (
	// logWindow is the longest a window stays open: how often, at most, the relay
	// writes a window and confirms the slot's position while rows come.
	logWindow = 200 * time.Millisecond
	// logStatus is how often the relay tells the server where it is when nothing
	// else made it.
	logStatus = time.Second
)

// NewLog returns the log relay of an installation's outbox (its parts, parts.Of).
// handedOver, if set, is called after rows were handed to the polling relay, to
// wake it.
func NewLog(inst parts.Installation, cfg Config, handedOver func()) (*LogRelay, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if inst.JS == nil {
		return nil, errors.New("relay: the installation has no NATS connection")
	}
	if len(cfg.OrderedSubjects) > 0 || cfg.AtomicPublish {
		return nil, errors.New("relay: the log relay publishes message by message in commit order; OrderedSubjects and AtomicPublish need the polling relay")
	}
	cfg = cfg.withDefaults()
	if handedOver == nil {
		handedOver = func() {}
	}
	return &LogRelay{pool: inst.Pool, js: inst.JS, cfg: cfg, stream: inst.Stream, schema: inst.Schema,
		log: inst.Logger.With("component", "relay", "relay", ModeLog), observe: inst.Observer, st: inst.Store,
		pubOpts: []jetstream.PublishOpt{jetstream.WithExpectStream(inst.Stream)}, tracer: otelmsg.Tracer(inst.Tracer),
		handedOver: handedOver, awaitProof: cfg.AwaitProof, waker: inst.Waker}, nil
}

// Reading reports whether this relay streams the slot now; the others of the
// installation stand by.
func (l *LogRelay) Reading() bool { return l.reading.Load() }

// ConfirmedAt is when this relay last moved the slot's position (zero: never).
func (l *LogRelay) ConfirmedAt() time.Time {
	if n := l.confirmedAt.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// Names are the slot and the publication, known once Run has started.
func (l *LogRelay) Names() LogNames { return l.names }

// errStandby: another relay reads the slot.
type errStandby struct{ pid int }

func (e errStandby) Error() string {
	return fmt.Sprintf("the slot is read by another relay (backend pid %d)", e.pid)
}

// Run reads the slot until ctx is cancelled: a session at a time, each from the
// slot's confirmed position. A session ends when the connection, the database or
// the broker fails; the next one starts after a pause. A relay that finds the
// slot read by another stands by, trying again every PollInterval. At the end
// the window under way is finished (its PubAcks awaited, bounded by
// PublishTimeout, on the work context) before Run returns nil.
func (l *LogRelay) Run(ctx context.Context) error { return l.RunWork(ctx, context.WithoutCancel(ctx)) }

// RunWork is Run with the work context work: the window under way when ctx ends
// is finished on work, and abandoned (published again by the next reader of the
// slot) when work ends.
func (l *LogRelay) RunWork(ctx, work context.Context) error {
	c, err := LogCapability(ctx, l.pool, l.schema)
	if err == nil && c.Mode != ModeLog {
		err = fmt.Errorf("relay: the log relay cannot run: %s", c.Why)
	}
	if err == nil {
		l.names = NamesFor(c.Database, l.schema)
		err = ensurePublication(ctx, l.pool, l.schema, l.names.Publication)
	}
	if ctx.Err() != nil {
		return nil // stopped before it started
	}
	if err != nil {
		return err
	}
	l.log = l.log.With("slot", l.names.Slot)
	l.log.InfoContext(ctx, "log relay started", "publication", l.names.Publication, "stream", l.stream)
	pause, standing := time.Duration(0), false
	for {
		err := l.session(ctx, work)
		if ctx.Err() != nil {
			return nil
		}
		var sb errStandby
		switch {
		case errors.As(err, &sb):
			if !standing {
				l.log.InfoContext(ctx, "log relay standing by: another relay reads the slot; it takes over when that one stops", "reader_pid", sb.pid)
			}
			standing, pause = true, l.cfg.PollInterval
		default:
			standing = false
			pause = min(max(2*pause, l.cfg.PollInterval), 10*time.Second)
			l.log.WarnContext(ctx, "log relay: session ended; starting again from the slot's position", "err", err, "in", pause)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(pause):
		}
	}
}

// replicationConfig is the pool's connection, as a logical replication
// connection to the same database.
func (l *LogRelay) replicationConfig() *pgconn.Config {
	c := l.pool.Config().ConnConfig.Config.Copy()
	if c.RuntimeParams == nil {
		c.RuntimeParams = map[string]string{}
	}
	c.RuntimeParams["replication"] = "database"
	// pg_stat_replication names the process that reads the slot.
	c.RuntimeParams["application_name"] = fmt.Sprintf("idem log relay (pid %d)", os.Getpid())
	// A timed-out read leaves the stream as it was (a cancel request would end it).
	c.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.DeadlineContextWatcherHandler{Conn: pc.Conn()}
	}
	return c
}

// session takes the slot (creating it when it is missing, or lost) and streams it.
func (l *LogRelay) session(ctx, work context.Context) error {
	s, err := readSlot(ctx, l.pool, l.names.Slot)
	if err != nil {
		return err
	}
	if mode, err := relayDefault(ctx, l.pool, l.st); err == nil && mode == ModeLog {
		l.waker.ByLog(true) // another relay, or an earlier session, took the rows over
	}
	if s.active {
		return errStandby{pid: s.pid}
	}
	conn, err := pgconn.ConnectConfig(ctx, l.replicationConfig())
	if err != nil {
		return fmt.Errorf("relay: replication connection: %w", err)
	}
	defer conn.Close(context.Background())

	if s.exists && s.walStatus == "lost" {
		l.log.ErrorContext(ctx, "log relay: the slot lost WAL it still needed (max_slot_wal_keep_size); making a new one and handing what it never published to the polling relay")
		if _, err := l.pool.Exec(ctx, sqlDropSlot, l.names.Slot); err != nil {
			return fmt.Errorf("relay: drop lost slot: %w", err)
		}
		s.exists = false
	}
	if !s.exists {
		if err := l.createSlot(ctx, conn); err != nil {
			return err
		}
	}
	if err := setRelayDefault(ctx, l.pool, l.st, ModeLog); err != nil {
		return err
	}
	l.waker.ByLog(true)
	err = pglogrepl.StartReplication(ctx, conn, l.names.Slot, 0, pglogrepl.StartReplicationOptions{
		Mode: pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", fmt.Sprintf("publication_names '%s'", l.names.Publication),
			"binary 'true'"},
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55006" { // object_in_use: another walsender streams it
		return errStandby{}
	}
	if err != nil {
		return fmt.Errorf("relay: start replication: %w", err)
	}
	l.reading.Store(true)
	defer l.reading.Store(false)
	l.log.InfoContext(ctx, "log relay reading the slot", "from", s.confirmed)
	return l.read(ctx, work, conn)
}

// createSlot makes the slot and hands the log relay's rows that no window holds,
// written before it, to the polling relay: after a slot was dropped or lost they
// were never published, and no slot streams them now.
func (l *LogRelay) createSlot(ctx context.Context, conn *pgconn.PgConn) error {
	fs := faults.From(ctx)
	_, err := pglogrepl.CreateReplicationSlot(ctx, conn, l.names.Slot, "pgoutput",
		pglogrepl.CreateReplicationSlotOptions{Mode: pglogrepl.LogicalReplication, SnapshotAction: "NOEXPORT_SNAPSHOT",
			Temporary: fs.On(faults.TemporarySlot)})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42710" { // duplicate_object: another relay made it
		return errStandby{}
	}
	if err != nil {
		return fmt.Errorf("relay: create slot %s: %w", l.names.Slot, err)
	}
	if fs.On(faults.SkipSlotHandOver) || fs.On(faults.TemporarySlot) {
		return nil // the negative controls: what no slot streams stays unpublished
	}
	var created time.Time
	if err := l.pool.QueryRow(ctx, `SELECT now()`).Scan(&created); err != nil {
		return fmt.Errorf("relay: create slot: %w", err)
	}
	tag, err := l.pool.Exec(ctx, l.st.Outbox.HandOverUnpublished, "the log relay's slot was made anew; no window holds it", created)
	if err != nil {
		return fmt.Errorf("relay: hand over what the old slot never published: %w", err)
	}
	l.log.InfoContext(ctx, "log relay created the slot", "handed_over", tag.RowsAffected())
	if tag.RowsAffected() > 0 {
		l.log.WarnContext(ctx, "log relay: rows no slot will stream go to the polling relay", "rows", tag.RowsAffected())
		l.handedOver()
	}
	return nil
}

// logTxn is one committed transaction the slot streamed, in commit order: the
// log relay's rows in it, published, and where it ends.
type logTxn struct {
	end     pglogrepl.LSN
	rows    []outboxRow
	futures []jetstream.PubAckFuture // nil where the row could not be made a message
	errs    []error
	sent    time.Time
	epoch   epoch
}

// read reads the slot, publishes each transaction's rows as they come, and
// confirms positions as the acker settles them.
func (l *LogRelay) read(ctx, work context.Context, conn *pgconn.PgConn) error {
	txns := make(chan *logTxn, 1024)
	a := &acker{l: l, done: make(chan error, 1)}
	inFlight := make(chan struct{}, 4*l.cfg.BatchSize) // messages published, PubAck not yet settled
	a.inFlight = inFlight
	go a.run(work, txns)
	// Whatever ends the session, the acker finishes what was handed to it.
	finish := func() error {
		close(txns)
		err := <-a.done
		l.sendStatus(work, conn, a.confirmed.Load(), false)
		return err
	}

	confirmOnRead := faults.From(ctx).On(faults.ConfirmOnRead)
	var cols outboxColumns
	var rel uint32
	var relKnown bool
	var cur *logTxn
	var enqueued uint64 // transactions handed to the acker
	var confirmedSent uint64
	lastStatus := time.Now()
	for {
		select {
		case err := <-a.done:
			// The acker stopped early (the broker or the database failed).
			l.sendStatus(work, conn, a.confirmed.Load(), false)
			return err
		default:
		}
		// Tell the server where the slot may move: soon after a window was written,
		// and every logStatus regardless. With nothing in flight, ask for its
		// position too, so that the slot moves past WAL no outbox row is in.
		idle := cur == nil && a.idle(enqueued)
		if c, since := a.confirmed.Load(), time.Since(lastStatus); since >= logStatus || (c > confirmedSent && since >= logWindow) {
			if err := l.sendStatus(ctx, conn, c, idle); err != nil {
				return errors.Join(err, finish())
			}
			confirmedSent, lastStatus = c, time.Now()
		}
		wait := logStatus
		if !idle {
			wait = logWindow
		}
		rctx, cancel := context.WithTimeout(ctx, wait)
		msg, err := conn.ReceiveMessage(rctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return finish()
			}
			if pgconn.Timeout(err) {
				continue
			}
			return errors.Join(fmt.Errorf("relay: read the slot: %w", err), finish())
		}
		var data []byte
		switch m := msg.(type) {
		case *pgproto3.CopyData:
			data = m.Data
		case *pgproto3.ErrorResponse:
			return errors.Join(fmt.Errorf("relay: the slot's stream: %w", pgconn.ErrorResponseToPgError(m)), finish())
		default:
			continue
		}
		switch data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			k, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
			if err != nil {
				return errors.Join(fmt.Errorf("relay: keepalive: %w", err), finish())
			}
			// Everything before the server's position has been sent; with nothing
			// of it left to settle, the slot may move there (past WAL no outbox
			// row is in, which it would otherwise keep).
			if cur == nil && a.idle(enqueued) {
				a.advance(uint64(k.ServerWALEnd))
			}
			if k.ReplyRequested {
				lastStatus = time.Time{} // answer at once
			}
		case pglogrepl.XLogDataByteID:
			x, err := pglogrepl.ParseXLogData(data[1:])
			if err != nil {
				return errors.Join(fmt.Errorf("relay: wal data: %w", err), finish())
			}
			lm, err := pglogrepl.Parse(x.WALData)
			if err != nil {
				return errors.Join(fmt.Errorf("relay: decode: %w", err), finish())
			}
			switch m := lm.(type) {
			case *pglogrepl.RelationMessage:
				if m.Namespace == l.schema && m.RelationName == "idem_outbox" {
					if cols, err = outboxColumnsOf(m); err != nil {
						return errors.Join(err, finish())
					}
					rel, relKnown = m.RelationID, true
				}
			case *pglogrepl.BeginMessage:
				cur = &logTxn{}
			case *pglogrepl.InsertMessage:
				if cur == nil || !relKnown || m.RelationID != rel {
					continue
				}
				row, err := cols.decodeInsert(m.Tuple)
				if err != nil {
					return errors.Join(err, finish())
				}
				if !row.mine {
					continue // the polling relay's
				}
				if cur.sent.IsZero() {
					cur.sent, cur.epoch = time.Now(), connEpochOf(l.js.Conn())
				}
				select {
				case inFlight <- struct{}{}:
				case <-ctx.Done():
					return finish()
				case err := <-a.done:
					return err
				}
				cur.rows = append(cur.rows, row.outboxRow)
				f, err := l.publish(row.outboxRow)
				cur.futures, cur.errs = append(cur.futures, f), append(cur.errs, err)
			case *pglogrepl.CommitMessage:
				if cur == nil {
					continue
				}
				cur.end = m.TransactionEndLSN
				if confirmOnRead {
					a.advance(uint64(cur.end)) // the negative control: before any PubAck
				}
				enqueued++
				select {
				case txns <- cur:
				case err := <-a.done:
					return err
				}
				cur = nil
			}
		}
	}
}

// publish sends row o, async.
func (l *LogRelay) publish(o outboxRow) (jetstream.PubAckFuture, error) {
	msg, err := messageOf(o)
	if err != nil {
		return nil, err
	}
	return l.js.PublishMsgAsync(msg, l.pubOpts...)
}

// sendStatus tells the server how far the slot may move: everything before
// confirmed is published and written down. ask asks the server to answer with its
// position at once, so a relay with nothing in flight can move past WAL of other
// tables.
func (l *LogRelay) sendStatus(ctx context.Context, conn *pgconn.PgConn, confirmed uint64, ask bool) error {
	err := pglogrepl.SendStandbyStatusUpdate(ctx, conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: pglogrepl.LSN(confirmed), ReplyRequested: ask})
	if err != nil {
		return fmt.Errorf("relay: confirm the slot's position: %w", err)
	}
	return nil
}

// acker settles the transactions the reader published, in commit order: it waits
// for each row's PubAck, gathers the acknowledged ones into a window, hands the
// failed ones over to the polling relay, and writes the window down before the
// position after it may be confirmed.
type acker struct {
	l        *LogRelay
	inFlight chan struct{}
	done     chan error
	// confirmed is the position every transaction before which is settled and
	// written down; settled counts the transactions settled and written.
	confirmed atomic.Uint64
	settled   atomic.Uint64
}

// idle reports whether every transaction of the enqueued ones is settled and
// written down.
func (a *acker) idle(enqueued uint64) bool { return a.settled.Load() == enqueued }

// advance moves the confirmed position forward to p, never back.
func (a *acker) advance(p uint64) {
	for {
		c := a.confirmed.Load()
		if p <= c || a.confirmed.CompareAndSwap(c, p) {
			return
		}
	}
}

// window is what the acker has settled and not yet written down.
type window struct {
	ids, seqs []int64
	rows      []outboxRow // for the send span
	failed    map[int64]error
	handOver  settlement
	end       pglogrepl.LSN
	txns      uint64
	opened    time.Time
}

func (a *acker) run(ctx context.Context, txns <-chan *logTxn) {
	w := &window{failed: map[int64]error{}}
	t := time.NewTicker(logWindow)
	defer t.Stop()
	for {
		select {
		case x, ok := <-txns:
			if !ok {
				a.done <- a.flush(ctx, w)
				return
			}
			if err := a.settle(ctx, w, x); err != nil {
				a.done <- errors.Join(err, a.flush(ctx, w))
				return
			}
			if len(w.ids)+len(w.handOver.ids) >= a.l.cfg.BatchSize {
				if err := a.flush(ctx, w); err != nil {
					a.done <- err
					return
				}
			}
		case <-t.C:
			if w.txns > 0 && time.Since(w.opened) >= logWindow {
				if err := a.flush(ctx, w); err != nil {
					a.done <- err
					return
				}
			}
		}
	}
}

// settle waits for x's PubAcks and adds x to w. A failure the broker explains
// (it does not answer, the connection dropped meanwhile) ends the session
// without settling x: nothing is charged, and x is read again from the slot.
func (a *acker) settle(ctx context.Context, w *window, x *logTxn) error {
	if w.txns == 0 {
		w.opened = time.Now()
	}
	var ok acked
	failed := map[int64]error{}
	if len(x.rows) > 0 {
		deadline, cancel := context.WithDeadline(ctx, x.sent.Add(a.l.cfg.PublishTimeout))
		for i, o := range x.rows {
			if x.errs[i] != nil {
				failed[o.id] = x.errs[i]
				<-a.inFlight
				continue
			}
			ack, err := awaitAck(deadline, x.futures[i], a.l.cfg.PublishTimeout)
			<-a.inFlight
			if err != nil {
				failed[o.id] = err
				continue
			}
			ok.ids, ok.streams, ok.seqs = append(ok.ids, o.id), append(ok.streams, ack.Stream), append(ok.seqs, int64(ack.Sequence))
		}
		cancel()
	}
	if err := faults.From(ctx).Hit(ctx, faults.RelayAfterPublish, keysOf(x.rows)); err != nil {
		return fmt.Errorf("relay: after publish: %w", err)
	}
	if len(failed) > 0 {
		dropped := !x.epoch.connected || connEpochOf(a.l.js.Conn()) != x.epoch
		up := len(ok.ids) > 0 || brokerUp(ctx, a.l.js, a.l.cfg.PublishTimeout)
		for _, o := range x.rows {
			err, bad := failed[o.id]
			if !bad {
				continue
			}
			if !up || dropped || connectionLost(err) {
				a.l.observe.Observe(idem.Event{Component: idem.ComponentRelay, Outcome: idem.OutcomeFailed, Count: len(failed)})
				return fmt.Errorf("%w: %d of a transaction's %d rows wait: %v", ErrBrokerDown, len(failed), len(x.rows), err)
			}
			w.handOver.add(o.id, fmt.Sprintf("publish to %s failed: %v", o.subject, err), a.l.cfg.Backoff(1))
			w.failed[o.id] = err
		}
	}
	w.ids, w.seqs = append(w.ids, ok.ids...), append(w.seqs, ok.seqs...)
	w.rows = append(w.rows, x.rows...)
	w.end = x.end
	w.txns++
	return nil
}

// awaitAck waits for f's PubAck until deadline; one answered by then keeps its
// answer (a refusal is not a timeout).
func awaitAck(deadline context.Context, f jetstream.PubAckFuture, timeout time.Duration) (*jetstream.PubAck, error) {
	select {
	case ack := <-f.Ok():
		return ack, nil
	case err := <-f.Err():
		return nil, err
	case <-deadline.Done():
		select {
		case ack := <-f.Ok():
			return ack, nil
		case err := <-f.Err():
			return nil, err
		default:
			return nil, fmt.Errorf("no PubAck within PublishTimeout %s", timeout)
		}
	}
}

// flush writes w down (its hand-overs and its window, in one transaction), then
// lets the slot move past it.
func (a *acker) flush(ctx context.Context, w *window) error {
	if w.txns == 0 {
		return nil
	}
	start := w.opened
	if len(w.ids) > 0 || len(w.handOver.ids) > 0 {
		err := pgx.BeginFunc(ctx, a.l.pool, func(tx pgx.Tx) error {
			if len(w.handOver.ids) > 0 {
				if _, err := tx.Exec(ctx, a.l.st.Outbox.HandOver, w.handOver.ids, w.handOver.reasons, w.handOver.waits); err != nil {
					return fmt.Errorf("relay: hand over: %w", err)
				}
			}
			if len(w.ids) > 0 {
				lo, hi := w.ids[0], w.ids[0]
				for _, id := range w.ids {
					lo, hi = min(lo, id), max(hi, id)
				}
				if _, err := tx.Exec(ctx, a.l.st.Published.Insert, a.l.stream, w.ids, w.seqs, lo, hi, w.end.String(), !a.l.awaitProof); err != nil {
					return fmt.Errorf("relay: write the window: %w", err)
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	a.l.traceBatch(ctx, start, w.rows, w.failed)
	a.advance(uint64(w.end))
	a.settled.Add(w.txns)
	a.l.confirmedAt.Store(time.Now().UnixNano())
	elapsed := time.Since(start)
	if len(w.ids) > 0 {
		a.l.observe.Observe(idem.Event{Component: idem.ComponentRelay, Outcome: idem.OutcomePublished, Count: len(w.ids), Duration: elapsed})
	}
	if n := len(w.handOver.ids); n > 0 {
		a.l.observe.Observe(idem.Event{Component: idem.ComponentRelay, Outcome: idem.OutcomeFailed, Count: n, Duration: elapsed})
		a.l.log.WarnContext(ctx, "log relay: some publishes failed; the polling relay retries them after a backoff", "failed", n, "published", len(w.ids), "err", w.handOver.reasons[0])
		a.l.handedOver()
	}
	*w = window{failed: map[int64]error{}}
	return nil
}

// traceBatch records a window's send span, as the polling relay does a batch's.
func (l *LogRelay) traceBatch(ctx context.Context, start time.Time, rows []outboxRow, failed map[int64]error) {
	if len(rows) == 0 {
		return
	}
	traceSend(ctx, l.tracer, l.stream, start, rows, failed)
}

// brokerUp asks JetStream for the account's info, with a short deadline: whether
// publishes that went unanswered say something about the broker or about the rows.
func brokerUp(ctx context.Context, js jetstream.JetStream, publishTimeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(ctx, min(2*time.Second, publishTimeout))
	defer cancel()
	_, err := js.AccountInfo(ctx)
	return err == nil
}

func connEpochOf(nc *nats.Conn) epoch {
	return epoch{connected: nc.Status() == nats.CONNECTED, reconnects: nc.Stats().Reconnects}
}
