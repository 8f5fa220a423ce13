package producer_test

import (
	"context"
	"errors"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/producer"
)

// roundTrips records what a pool sends: one entry per statement sent alone, and
// one per batch, listing the batch's statements.
type roundTrips struct {
	mu   sync.Mutex
	sent [][]string
	open []string // the batch being sent
}

func (r *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	if w := firstWords(d.SQL); !strings.HasPrefix(w, relayReading) {
		r.sent = append(r.sent, []string{w})
	}
	return ctx
}

// relayReading is the outbox's reading of which relay owns new rows: it runs in
// the background, beside requests, at most every few seconds, never in one.
const relayReading = "SELECT COALESCE(pg_get_expr("

func (r *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.open = []string{}
	return ctx
}

func (r *roundTrips) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.open = append(r.open, firstWords(d.SQL))
}

func (r *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sent = append(r.sent, r.open)
	r.open = nil
}

func (r *roundTrips) reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sent = nil
}

func (r *roundTrips) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var b strings.Builder
	for i, s := range r.sent {
		if i > 0 {
			b.WriteString(" | ")
		}
		b.WriteString(strings.Join(s, "; "))
	}
	return b.String()
}

// firstWords is a statement's first three words, enough to tell statements apart.
func firstWords(sql string) string {
	f := strings.Fields(sql)
	return strings.Join(f[:min(3, len(f))], " ")
}

var lockSpace = regexp.MustCompile(`(pg_advisory_xact_lock\()-?[0-9]+,`)

// tracedPool is a second pool on db whose every statement is recorded.
func tracedPool(t *testing.T, db *pgtest.DB, maxConns int32) (*pgxpool.Pool, *roundTrips) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	rt := &roundTrips{}
	cfg.ConnConfig.Tracer = rt
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Close waits for every acquired connection: a leaked one would hang it.
		closed := make(chan struct{})
		go func() { pool.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Error("pool.Close still waits after 10s: a connection was never released")
		}
	})
	return pool, rt
}

// writeRow is a handler's first step in these tests: it writes the request's row
// in Intent.Tx, or answers 500 and reports false.
func writeRow(w http.ResponseWriter, r *http.Request) (*producer.Intent, bool) {
	in, _ := producer.IntentFrom(r.Context())
	if _, err := in.Tx.Exec(r.Context(), `INSERT INTO test_writes (key) VALUES ($1)`, in.ScopedKey()); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return nil, false
	}
	return in, true
}

// TestRequestCostsTwoRoundTripsOfItsOwn pins what a request alone sends: BEGIN
// with the key's lock and the lookup of its record, the handler's own statement,
// and the outbox row, the key's record (written once, finished) and COMMIT
// together. With BEGIN and COMMIT sent by themselves (pgx's
// Tx) the transaction would take five round trips instead of three.
func TestRequestCostsTwoRoundTripsOfItsOwn(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	pool, rt := tracedPool(t, db, 4)
	h := newMiddleware(t, pool, producer.Config{}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, ok := writeRow(w, r)
		if !ok {
			return
		}
		if err := in.Enqueue(r.Context(), "test.charges.requested", []byte(`{}`), nil); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	for i, k := range []string{"rt-1", "rt-2"} { // the second finds every statement prepared
		rt.reset()
		if w := (req{path: "/ok", key: key(k)}).send(h); w.Code != http.StatusCreated {
			t.Fatalf("request %d: status %d: %s", i, w.Code, w.Body)
		}
		// No relay runs in this process, so after the commit Wake sends one NOTIFY
		// for the relays elsewhere, outside the transaction.
		want := "BEGIN; SELECT pg_advisory_xact_lock(space, $1); SELECT fingerprint, status, | INSERT INTO test_writes | INSERT INTO idem_outbox; INSERT INTO idem_requests; COMMIT | SELECT pg_notify($1, '')"
		// The lock's first key is the installation's lock space, a hash.
		if got := lockSpace.ReplaceAllString(rt.String(), "${1}space,"); got != want {
			t.Fatalf("request %d sent\n  %s\nwant\n  %s", i, got, want)
		}
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_outbox`); n != 2 {
		t.Fatalf("outbox rows = %d, want 2", n)
	}
}

// TestHandlerCannotEndTheRequestTx: Commit and Rollback of Intent.Tx are refused,
// and the request still commits once, with its row.
func TestHandlerCannotEndTheRequestTx(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	var commitErr, rollbackErr error
	h := newMiddleware(t, db.Pool, producer.Config{}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, ok := writeRow(w, r)
		if !ok {
			return
		}
		commitErr, rollbackErr = in.Tx.Commit(r.Context()), in.Tx.Rollback(r.Context())
		w.WriteHeader(http.StatusCreated)
	}))
	if w := (req{path: "/ok", key: key("end-1")}).send(h); w.Code != http.StatusCreated {
		t.Fatalf("status %d: %s", w.Code, w.Body)
	}
	if commitErr == nil || rollbackErr == nil {
		t.Fatalf("Commit = %v, Rollback = %v; want both refused", commitErr, rollbackErr)
	}
	if n := db.Count(t, `SELECT count(*) FROM test_writes`); n != 1 {
		t.Fatalf("test_writes = %d, want 1", n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_requests WHERE status = 'done'`); n != 1 {
		t.Fatalf("stored responses = %d, want 1", n)
	}
}

// TestHandlerSavepoints: a handler may nest transactions in Intent.Tx; what it
// rolls back is gone, what it commits commits with the request.
func TestHandlerSavepoints(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	h := newMiddleware(t, db.Pool, producer.Config{}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		in, _ := producer.IntentFrom(ctx)
		err := func() error {
			undone, err := in.Tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := undone.Exec(ctx, `INSERT INTO test_writes (key) VALUES ('undone')`); err != nil {
				return err
			}
			if err := undone.Rollback(ctx); err != nil {
				return err
			}
			kept, err := in.Tx.Begin(ctx)
			if err != nil {
				return err
			}
			inner, err := kept.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := inner.Exec(ctx, `INSERT INTO test_writes (key) VALUES ('kept')`); err != nil {
				return err
			}
			if err := inner.Commit(ctx); err != nil {
				return err
			}
			if err := kept.Commit(ctx); err != nil {
				return err
			}
			if err := kept.Commit(ctx); !errors.Is(err, pgx.ErrTxClosed) {
				return errors.New("a second Commit of a savepoint was not refused")
			}
			return nil
		}()
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	if w := (req{path: "/ok", key: key("sp-1")}).send(h); w.Code != http.StatusCreated {
		t.Fatalf("status %d: %s", w.Code, w.Body)
	}
	var keys []string
	rows, err := db.Pool.Query(context.Background(), `SELECT key FROM test_writes ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	if keys, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if strings.Join(keys, ",") != "kept" {
		t.Fatalf("test_writes = %v, want [kept]", keys)
	}
}

// TestFailedTransactionStoresNothing: a handler that ignores a failed statement
// leaves the transaction aborted. The batch with COMMIT then fails before COMMIT
// runs; the request answers an error, nothing of it is stored, and its connection
// is rolled back and goes back to the pool (one connection: the next request
// would wait forever for a leaked one).
func TestFailedTransactionStoresNothing(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	pool, _ := tracedPool(t, db, 1)
	h := newMiddleware(t, pool, producer.Config{}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, ok := writeRow(w, r)
		if !ok {
			return
		}
		if r.URL.Path == "/ignores-failure" {
			_, _ = in.Tx.Exec(r.Context(), `SELECT 1/0`) // ignored: the transaction is now aborted
		}
		w.WriteHeader(http.StatusCreated)
	}))
	w := (req{path: "/ignores-failure", key: key("fail-1")}).send(h)
	if w.Code < 500 {
		t.Fatalf("status %d, want a 5xx: %s", w.Code, w.Body)
	}
	if n := db.Count(t, `SELECT count(*) FROM test_writes`); n != 0 {
		t.Fatalf("test_writes = %d, want 0", n)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_requests`); n != 0 {
		t.Fatalf("idem_requests = %d, want 0: the claim was stored", n)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Fatalf("%d connections still acquired after the request", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r := (req{path: "/ok", key: key("fail-1"), ctx: ctx}).send(h)
	if r.Code != http.StatusCreated {
		t.Fatalf("retry: status %d, want 201: %s", r.Code, r.Body)
	}
	if n := db.Count(t, `SELECT count(*) FROM test_writes`); n != 1 {
		t.Fatalf("test_writes after the retry = %d, want 1", n)
	}
}

// A handler that keeps Intent.Tx past its return (a goroutine, say) gets
// pgx.ErrTxClosed from it, not a connection that is back in the pool.
func TestRequestTxAfterTheRequest(t *testing.T) {
	t.Parallel()
	db := newDB(t, pgtest.Options{})
	var kept pgx.Tx
	h := newMiddleware(t, db.Pool, producer.Config{}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, _ := producer.IntentFrom(r.Context())
		kept = in.Tx
		w.WriteHeader(http.StatusCreated)
	}))
	if w := (req{path: "/ok", key: key("after-1")}).send(h); w.Code != http.StatusCreated {
		t.Fatalf("status %d: %s", w.Code, w.Body)
	}
	ctx := context.Background()
	if _, err := kept.Exec(ctx, `INSERT INTO test_writes (key) VALUES ('late')`); !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("Exec after the request: %v, want ErrTxClosed", err)
	}
	var one int
	if err := kept.QueryRow(ctx, `SELECT 1`).Scan(&one); !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("QueryRow after the request: %v, want ErrTxClosed", err)
	}
	if err := kept.SendBatch(ctx, &pgx.Batch{}).Close(); !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("SendBatch after the request: %v, want ErrTxClosed", err)
	}
	if _, err := kept.Begin(ctx); !errors.Is(err, pgx.ErrTxClosed) {
		t.Errorf("Begin after the request: %v, want ErrTxClosed", err)
	}
	if n := db.Count(t, `SELECT count(*) FROM test_writes`); n != 0 {
		t.Fatalf("test_writes = %d, want 0", n)
	}
}
