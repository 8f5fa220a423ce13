package producer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// requestTx is a request's own transaction, on a connection the middleware holds
// for the request. The middleware begins it in the round trip that locks the key
// and looks its record up, and commits it in the round trip that writes the outbox
// rows and the key's record: a request costs the middleware two round trips of its own, where pgx's
// Tx, which sends BEGIN and COMMIT by themselves, costs four. The handler's
// statements come in between.
//
// The handler sees it as Intent.Tx, a pgx.Tx it may query, batch and copy
// through, and nest savepoints in (Begin), but not end: its Commit and Rollback
// return an error, since ending the request's transaction belongs to the
// middleware.
type requestTx struct {
	conn       *pgxpool.Conn // nil once the transaction has ended and the connection is back
	savepoints int           // savepoints made so far, which names the next one
}

var errRequestTx = errors.New("producer: the middleware commits or rolls back the request's transaction, not the handler")

// errCommitRolledBack is the answer of a COMMIT that found the transaction
// already failed: Postgres then rolls back and says so in the command tag.
var errCommitRolledBack = errors.New("producer: commit: the transaction had failed and was rolled back")

// begin acquires a connection and sends BEGIN, lock (the key's lock) and lookup
// (the key's record) in one round trip. scan reads the lookup's row, or is given
// pgx.ErrNoRows; its error is returned. The transaction is open, possibly failed,
// after any error but an acquire's: the caller ends it with rollback.
func begin(ctx context.Context, pool *pgxpool.Pool, lock string, lockArgs []any, lookup string, lookupArgs []any, scan func(pgx.Row) error) (*requestTx, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("producer: begin: %w", err)
	}
	t := &requestTx{conn: conn}
	b := &pgx.Batch{}
	b.Queue(sqlBeginRequest)
	b.Queue(lock, lockArgs...)
	b.Queue(lookup, lookupArgs...).QueryRow(scan)
	return t, conn.SendBatch(ctx, b).Close()
}

// commit sends b, then COMMIT, in one round trip. Postgres skips what follows a
// failed statement up to the batch's end, so the COMMIT runs only if every
// statement before it succeeded; after a failure the transaction is left open
// (failed) for rollback.
func (t *requestTx) commit(ctx context.Context, b *pgx.Batch) error {
	var tag pgconn.CommandTag
	b.Queue(sqlCommitRequest).Exec(func(ct pgconn.CommandTag) error {
		tag = ct
		return nil
	})
	if err := t.conn.SendBatch(ctx, b).Close(); err != nil {
		// If the COMMIT itself failed, Postgres has rolled back (the connection is
		// idle); otherwise the transaction is left failed: rollback tells them apart.
		return err
	}
	// Ended: the connection goes back now, not after the response is written.
	t.conn.Release()
	t.conn = nil
	if tag.String() != "COMMIT" {
		return errCommitRolledBack
	}
	return nil
}

// rollback ends the transaction if it is still open and returns the connection to
// the pool; a no-op for what has ended. It uses its own deadline: the request's
// context may be cancelled (the client left), and the ROLLBACK must still reach
// the server so that the connection goes back clean. A connection released inside
// a transaction is closed by the pool rather than reused.
func (t *requestTx) rollback(ctx context.Context) error {
	if t.conn == nil {
		return nil
	}
	defer func() {
		t.conn.Release()
		t.conn = nil
	}()
	if t.conn.Conn().PgConn().TxStatus() == 'I' || t.conn.Conn().IsClosed() {
		return nil // no transaction left to end
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if _, err := t.conn.Exec(rctx, sqlRollbackRequest); err != nil {
		return fmt.Errorf("producer: rollback: %w", err)
	}
	return nil
}

// pgx.Tx, for the handler.

func (t *requestTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.conn == nil {
		return nil, pgx.ErrTxClosed
	}
	t.savepoints++
	sp := &savepointTx{t: t, name: fmt.Sprintf("idem_sp_%d", t.savepoints)}
	if _, err := t.conn.Exec(ctx, sqlSavepoint+sp.name); err != nil {
		return nil, err
	}
	return sp, nil
}

func (t *requestTx) Commit(context.Context) error   { return errRequestTx }
func (t *requestTx) Rollback(context.Context) error { return errRequestTx }

// The statements below fail with pgx.ErrTxClosed once the request's transaction
// has ended, as pgx's own Tx does, rather than on a connection back in the pool.

func (t *requestTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if t.conn == nil {
		return 0, pgx.ErrTxClosed
	}
	return t.conn.CopyFrom(ctx, table, columns, src)
}

func (t *requestTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.conn == nil {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects needs a pgx transaction of pgx's own making: one is made over the
// request's, with a query that changes nothing, in its own round trip. It is never
// ended; the request's transaction is.
func (t *requestTx) LargeObjects() pgx.LargeObjects {
	if t.conn == nil {
		return pgx.LargeObjects{} // ended: its methods panic, as they would on any closed Tx's
	}
	tx, err := t.conn.Conn().BeginTx(context.Background(), pgx.TxOptions{BeginQuery: sqlNoop})
	if err != nil {
		// The connection is broken, and LargeObjects cannot say so: the empty
		// value's methods panic, which the middleware answers as a handler panic,
		// rolled back. Every other statement would fail on this connection anyway.
		return pgx.LargeObjects{}
	}
	return tx.LargeObjects()
}

func (t *requestTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.conn == nil {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Conn().Prepare(ctx, name, sql)
}

func (t *requestTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.conn == nil {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return t.conn.Exec(ctx, sql, args...)
}

func (t *requestTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.conn == nil {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Query(ctx, sql, args...)
}

func (t *requestTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.conn == nil {
		return closedRow{}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

// Conn is nil once the transaction has ended.
func (t *requestTx) Conn() *pgx.Conn {
	if t.conn == nil {
		return nil
	}
	return t.conn.Conn()
}

// closedRow answers QueryRow for an ended requestTx.
type closedRow struct{}

func (closedRow) Scan(...any) error { return pgx.ErrTxClosed }

// savepointTx is a transaction the handler nested in the request's (Tx.Begin): a
// savepoint, which the handler commits (RELEASE) or rolls back (ROLLBACK TO), as
// with pgx's own nested transactions.
type savepointTx struct {
	t      *requestTx
	name   string
	closed bool
}

func (s *savepointTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if s.closed {
		return nil, pgx.ErrTxClosed
	}
	return s.t.Begin(ctx)
}

func (s *savepointTx) Commit(ctx context.Context) error {
	return s.end(ctx, sqlReleaseSavepoint)
}

func (s *savepointTx) Rollback(ctx context.Context) error {
	return s.end(ctx, sqlRollbackToSavepoint)
}

// end releases or rolls back to the savepoint, once; through the request's Tx,
// so after the request it answers pgx.ErrTxClosed.
func (s *savepointTx) end(ctx context.Context, sql string) error {
	if s.closed {
		return pgx.ErrTxClosed
	}
	s.closed = true
	_, err := s.t.Exec(ctx, sql+s.name)
	return err
}

func (s *savepointTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	return s.t.CopyFrom(ctx, table, columns, src)
}

func (s *savepointTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return s.t.SendBatch(ctx, b)
}

func (s *savepointTx) LargeObjects() pgx.LargeObjects { return s.t.LargeObjects() }

func (s *savepointTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return s.t.Prepare(ctx, name, sql)
}

func (s *savepointTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return s.t.Exec(ctx, sql, args...)
}

func (s *savepointTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return s.t.Query(ctx, sql, args...)
}

func (s *savepointTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return s.t.QueryRow(ctx, sql, args...)
}

func (s *savepointTx) Conn() *pgx.Conn { return s.t.Conn() }
