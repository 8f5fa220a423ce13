package producer

// Group commit (Config.GroupCommit): concurrent requests share one transaction, one
// connection and one COMMIT, each under a savepoint of its own.
//
//	BEGIN; SET LOCAL lock_timeout = Wait              -- once per group, by its first turn
//	  SAVEPOINT idem_member; claim                    -- one round trip per member ...
//	    (the claim sets lock_timeout to 1 ms, and back to Wait once it holds the key)
//	  handler(ctx with the group's tx)
//	  outbox INSERTs; store response; RELEASE         -- ... and one more
//	  (a failed member: ROLLBACK TO SAVEPOINT, and it is answered at once)
//	  ... the next member, on the same connection ...
//	COMMIT                                            -- once per group, by its last member
//	every stored member writes its response           -- never before the COMMIT returned
//
// A request joins the open group if it has room, else starts a new one; several
// groups run at once, each on its own connection. Members take turns on the
// connection, and the member that finishes when no other is waiting commits.
// A group thus forms from the requests that arrive while it is busy, and nobody
// waits for followers (unless GroupCommit.MaxWait says so).
//
// The hazard is a claim that would wait: a concurrent duplicate's uncommitted row
// would make the whole group wait for it. So the claim runs with a lock_timeout of
// 1 ms (undone with the savepoint, or reset to Wait before the handler runs), and
// a member whose claim times out is ejected: rolled back to its savepoint, it runs
// alone on the ordinary path, where it waits up to Wait as any duplicate does. A
// second member with a key already in the open group is ejected before it touches
// the database: in the same transaction its claim would find its twin's uncommitted
// record and replay a response that may never commit.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faults"
)

// MaxGroupRequests is the largest GroupCommit.MaxRequests. Every member's
// savepoint that writes gets a subtransaction ID, and Postgres caches only 64 of
// them per backend; beyond that ("suboverflow") every snapshot in the cluster gets
// slower. The bound leaves room for the handlers' own savepoints.
const MaxGroupRequests = 32

// groupClaimLockTimeout is how long a grouped claim waits for a lock before its
// request is ejected from the group (lock_timeout has millisecond resolution).
const groupClaimLockTimeout = time.Millisecond

// GroupCommit coalesces concurrent requests into one transaction, each under its own
// savepoint, so they share BEGIN, COMMIT and the WAL flush. The zero value is off:
// one transaction per request.
//
// What stays the same for each request: its claim, handler, outbox messages and
// stored response commit together or not at all; a failed handler (5xx, panic)
// rolls back to its savepoint only; its response is written after the COMMIT
// returned; a COMMIT that fails answers every member that had stored a response as
// its own failed commit would (500 or 503), with nothing stored.
//
// What changes: members run one after another on the group's connection, so a slow
// handler delays its group, and a handler's lock waits (up to Wait) hold up the
// whole group. Rows locked by one member stay locked until the group commits,
// which can make requests that would not have conflicted alone wait for each other
// (or, across groups, deadlock: Postgres then fails one statement, and that
// member's handler). A member sees the rows of the members before it in its
// group, as if they had committed just before it, and now() is the group's start,
// not the request's (idem_requests.expires_at too). The handler's statements
// through Intent.Tx ignore the request's cancellation, so a client that goes away
// cannot break the connection the group shares.
type GroupCommit struct {
	// MaxRequests is the most requests one group holds, 1..MaxGroupRequests.
	// 0 turns group commit off.
	MaxRequests int
	// MaxWait is how long a group whose members have all finished waits for one
	// more before it commits, when it has room. Every member already finished
	// waits that long too, so keep it at a millisecond or less. Default 0: commit
	// as soon as no member is waiting for its turn.
	MaxWait time.Duration
}

func (g GroupCommit) validate() error {
	if g.MaxRequests < 0 || g.MaxRequests > MaxGroupRequests {
		return fmt.Errorf("middleware: GroupCommit.MaxRequests %d is outside 0..%d", g.MaxRequests, MaxGroupRequests)
	}
	if g.MaxWait < 0 {
		return fmt.Errorf("middleware: GroupCommit.MaxWait %v is negative", g.MaxWait)
	}
	return nil
}

// groups admits requests to groups. It is part of a Middleware, not global: two
// middlewares never share a transaction.
type groups struct {
	mu   sync.Mutex
	open *group // the group new requests join; nil when none has room
	// newest is the group started last, full or not: what tests watch form.
	newest *group
}

// groupKey is a request's name within a group: two members with the same one
// would share a claim.
type groupKey struct{ scope, key string }

// group is one shared transaction and the requests in it.
type group struct {
	// turn holds one token: whoever has taken it owns the connection.
	turn chan struct{}
	// done is closed when the transaction has ended; err is its outcome.
	done chan struct{}
	err  error
	// more wakes a last member waiting out MaxWait when a request joins.
	more chan struct{}

	// Guarded by groups.mu.
	joined  int  // members admitted
	pending int  // members admitted that have not finished their turn
	idle    bool // the last member is waiting out MaxWait
	closed  bool // committing or committed: nobody joins
	keys    map[groupKey]struct{}

	// Owned by whoever holds turn.
	tx     pgx.Tx
	broken error // the transaction cannot go on; it will be rolled back
}

// join admits a request to the open group, or to a new one. It returns nil when
// the open group already has a member with the same scope and key.
func (gs *groups) join(scope string, key idem.Key, maxRequests int) *group {
	gs.mu.Lock()
	defer gs.mu.Unlock()
	k := groupKey{scope, string(key)}
	g := gs.open
	if g != nil {
		if _, twin := g.keys[k]; twin {
			return nil
		}
	}
	if g == nil || g.closed || g.joined >= maxRequests {
		g = &group{turn: make(chan struct{}, 1), done: make(chan struct{}), more: make(chan struct{}, 1), keys: map[groupKey]struct{}{}}
		g.turn <- struct{}{}
		gs.open, gs.newest = g, g
	}
	g.joined++
	g.pending++
	g.keys[k] = struct{}{}
	if g.idle {
		g.idle = false
		g.more <- struct{}{} // buffered, and empty while idle
	}
	if g.joined >= maxRequests {
		gs.open = nil // full: the next request starts a new group
	}
	return g
}

// finish ends the turn of the member holding it: it passes the connection to the
// next member, or, being the last, commits the group.
func (m *Middleware) finish(ctx context.Context, g *group) {
	gs := &m.groups
	gs.mu.Lock()
	g.pending--
	if g.pending > 0 {
		gs.mu.Unlock()
		g.turn <- struct{}{}
		return
	}
	if wait := m.cfg.GroupCommit.MaxWait; wait > 0 && g.broken == nil && g.joined < m.cfg.GroupCommit.MaxRequests {
		g.idle = true
		gs.mu.Unlock()
		t := time.NewTimer(wait)
		select {
		case <-g.more:
			t.Stop()
			g.turn <- struct{}{}
			return
		case <-t.C:
		}
		gs.mu.Lock()
		if !g.idle {
			// A request joined as the timer fired; its signal is in more.
			gs.mu.Unlock()
			<-g.more
			g.turn <- struct{}{}
			return
		}
		g.idle = false
	}
	g.closed = true
	if gs.open == g {
		gs.open = nil
	}
	gs.mu.Unlock()
	m.endGroup(ctx, g)
}

// endGroup commits the group's transaction (or rolls back a broken one) and
// releases the members waiting for the outcome.
func (m *Middleware) endGroup(ctx context.Context, g *group) {
	defer close(g.done)
	switch {
	case g.tx == nil:
		g.err = g.broken // never began; nobody stored anything
	case g.broken != nil:
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if err := g.tx.Rollback(rctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
			m.cfg.Logger.WarnContext(ctx, "middleware: group: rollback", "err", err)
		}
		g.err = g.broken
	default:
		if err := g.tx.Commit(ctx); err != nil {
			g.err = fmt.Errorf("producer: group: commit: %w", err)
		}
	}
}

// serveGrouped runs a request as a member of a group. It returns false, having
// answered nothing and left nothing in the database, when the request was ejected
// and must run alone.
func (m *Middleware) serveGrouped(a *answer, r *http.Request, next http.Handler, scope string, key idem.Key, fp, body []byte) bool {
	g := m.groups.join(scope, key, m.cfg.GroupCommit.MaxRequests)
	if g == nil {
		return false // its twin is in the open group
	}
	// The group's statements must not die with this client: pgx closes a
	// connection whose query is cancelled, and the connection is the group's.
	ctx := context.WithoutCancel(a.ctx)
	<-g.turn
	turn := true
	end := func(rollback bool) {
		if rollback {
			m.rollbackMember(ctx, g)
		}
		turn = false
		m.finish(ctx, g)
	}
	defer func() {
		if turn { // a panic on the way, http.ErrAbortHandler included
			end(true)
		}
	}()

	if g.broken == nil && g.tx == nil {
		tx, err := m.pool.BeginTx(ctx, pgx.TxOptions{BeginQuery: m.q.begin})
		if err != nil {
			g.broken = fmt.Errorf("producer: group: begin: %w", err)
		} else {
			g.tx = tx
		}
	}
	if g.broken != nil {
		// Nothing claimed: alone, the request fares as it would have without groups.
		end(false)
		return false
	}

	claimed, err := m.claimInGroup(ctx, g.tx, scope, key, fp, r)
	if err != nil || !claimed.ok {
		end(true)
		switch {
		case isLockTimeout(err):
			return false // a concurrent duplicate holds the key: wait for it alone
		case err != nil:
			a.dbFailed(err)
		default:
			a.fromRecord(claimed.rec, fp)
		}
		return true
	}

	setBody(r, body)
	intent := &Intent{Tx: &memberTx{tx: g.tx, own: true}, Scope: scope, Key: key, outbox: m.cfg.Outbox, batch: &pgx.Batch{}}
	capture := newCapture(m.cfg.MaxResponseBytes)
	if !a.runHandler(next, capture, r.WithContext(withIntent(a.ctx, intent))) {
		end(true)
		a.fail(http.StatusInternalServerError, "internal_error",
			"the request failed and was rolled back; retry with the same Idempotency-Key")
		return true
	}
	if capture.overflow {
		end(true)
		a.log.ErrorContext(ctx, "middleware: handler response exceeds MaxResponseBytes; rolled back", "limit", m.cfg.MaxResponseBytes)
		a.fail(http.StatusInternalServerError, "response_too_large",
			fmt.Sprintf("the handler's response is larger than the %d bytes that can be stored for replay; the request was rolled back", m.cfg.MaxResponseBytes))
		return true
	}
	resp := capture.result()
	if !storesResponse(resp.status) {
		end(true)
		a.log.WarnContext(ctx, "middleware: handler answered with a retryable status; rolled back", "status", resp.status)
		a.respond(OutcomeFailed, resp, false)
		return true
	}

	messages := intent.batch.Len()
	intent.batch.Queue(m.q.complete, scope, string(key), resp.status, storedHeader(resp.header), resp.body)
	intent.batch.Queue(sqlReleaseMember)
	if err := g.tx.SendBatch(ctx, intent.batch).Close(); err != nil {
		end(true)
		a.dbFailed(fmt.Errorf("producer: group: enqueue and store response: %w", err))
		return true
	}
	end(false)

	// Stored, but durable only once the group commits: the response waits for it.
	<-g.done
	if g.err != nil {
		a.dbFailed(g.err)
		return true
	}
	if err := faults.From(a.ctx).Hit(a.ctx, faults.IngressAfterCommit, []string{intent.ScopedKey()}); err != nil {
		a.log.WarnContext(a.ctx, "middleware: response abandoned after commit (fault point)", "err", err)
		panic(http.ErrAbortHandler)
	}
	if messages > 0 {
		if err := m.cfg.Outbox.Wake(a.ctx, m.pool); err != nil {
			a.log.WarnContext(a.ctx, "middleware: waking the relay failed; it will find the messages at its next poll", "err", err)
		}
	}
	a.log.DebugContext(a.ctx, "middleware: executed and stored in a group", "status", resp.status)
	a.respond(OutcomeNew, resp, false)
	return true
}

// claimInGroup claims (scope, key) under a new savepoint, with the short lock
// timeout, in one round trip and two statements; on success the savepoint stays open and lock_timeout
// is Wait again, for the handler. On failure the caller rolls back to the
// savepoint.
func (m *Middleware) claimInGroup(ctx context.Context, tx pgx.Tx, scope string, key idem.Key, fp []byte, r *http.Request) (claimResult, error) {
	b := &pgx.Batch{}
	b.Queue(sqlSavepointMember)
	var lockedAt time.Time
	var restored string
	b.Queue(m.q.groupClaim, scope, string(key), fp, r.Method, r.URL.Path, m.cfg.KeyLifetime.Seconds(), m.q.groupClaimMs, m.q.waitMs).
		QueryRow(func(row pgx.Row) error { return row.Scan(&lockedAt, &restored) })
	err := tx.SendBatch(ctx, b).Close()
	if err == nil {
		return claimResult{ok: true}, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return claimResult{}, fmt.Errorf("producer: group: claim: %w", err)
	}
	// The key has a record (or had: it may be expired or deleted meanwhile). The
	// ordinary claim sorts that out, still under the short timeout the failed
	// INSERT left: deleting an expired record can wait on a concurrent duplicate
	// too.
	res, err := m.claim(ctx, tx, scope, key, fp, r)
	if err != nil || !res.ok {
		return res, err
	}
	if _, err := tx.Exec(ctx, m.q.waitTimeout); err != nil {
		return claimResult{}, fmt.Errorf("producer: group: %w", err)
	}
	return res, nil
}

// rollbackMember undoes the turn-holder's savepoint. If even that fails, the
// group's transaction is unusable and is marked broken.
func (m *Middleware) rollbackMember(ctx context.Context, g *group) {
	if g.broken != nil || g.tx == nil {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := g.tx.Exec(rctx, sqlRollbackMember); err != nil {
		g.broken = fmt.Errorf("producer: group: roll back to savepoint: %w", err)
	}
}

// memberTx is a group member's Intent.Tx: the group's transaction, inside the
// member's savepoint. Its statements ignore the request's cancellation, because a
// cancelled query makes pgx close the connection, which is the whole group's. The
// member's own transaction refuses Commit and Rollback, which belong to the
// middleware; a nested one (Begin) is a savepoint the handler may end.
type memberTx struct {
	tx  pgx.Tx
	own bool
}

var errMemberTx = errors.New("producer: group: the middleware commits or rolls back the request's transaction, not the handler")

func (t *memberTx) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := t.tx.Begin(context.WithoutCancel(ctx))
	if err != nil {
		return nil, err
	}
	return &memberTx{tx: tx}, nil
}

func (t *memberTx) Commit(ctx context.Context) error {
	if t.own {
		return errMemberTx
	}
	return t.tx.Commit(context.WithoutCancel(ctx))
}

func (t *memberTx) Rollback(ctx context.Context) error {
	if t.own {
		return errMemberTx
	}
	return t.tx.Rollback(context.WithoutCancel(ctx))
}

func (t *memberTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	return t.tx.CopyFrom(context.WithoutCancel(ctx), table, columns, src)
}

func (t *memberTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return t.tx.SendBatch(context.WithoutCancel(ctx), b)
}

func (t *memberTx) LargeObjects() pgx.LargeObjects { return t.tx.LargeObjects() }

func (t *memberTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return t.tx.Prepare(context.WithoutCancel(ctx), name, sql)
}

func (t *memberTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.tx.Exec(context.WithoutCancel(ctx), sql, args...)
}

func (t *memberTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.tx.Query(context.WithoutCancel(ctx), sql, args...)
}

func (t *memberTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return t.tx.QueryRow(context.WithoutCancel(ctx), sql, args...)
}

func (t *memberTx) Conn() *pgx.Conn { return t.tx.Conn() }
