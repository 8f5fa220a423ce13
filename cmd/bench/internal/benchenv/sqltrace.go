package benchenv

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/cmd/bench/internal/measure"
)

// sqlTracer adds up, per SQL statement, how many times it ran and how long the
// client waited for it (round trip plus server time; COMMIT includes the WAL
// flush). It answers "where does a batch's wall time go" from the client's side.
type sqlTracer struct {
	mu    sync.Mutex
	stats map[string]*sqlStat
}

type sqlStat struct {
	Calls int
	Total time.Duration
}

type traceStartKey struct{}

type traceStart struct {
	sql   string
	start time.Time
}

func newSQLTracer() *sqlTracer { return &sqlTracer{stats: map[string]*sqlStat{}} }

// TraceQueryStart implements pgx.QueryTracer.
func (t *sqlTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, traceStartKey{}, traceStart{sql: data.SQL, start: time.Now()})
}

// TraceQueryEnd implements pgx.QueryTracer. For a query it fires when the first
// result arrives; the rows are read after, which is client time.
func (t *sqlTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	s, ok := ctx.Value(traceStartKey{}).(traceStart)
	if !ok {
		return
	}
	d := time.Since(s.start)
	name := statementName(s.sql)
	t.mu.Lock()
	defer t.mu.Unlock()
	st := t.stats[name]
	if st == nil {
		st = &sqlStat{}
		t.stats[name] = st
	}
	st.Calls++
	st.Total += d
}

// Reset forgets everything counted so far (the set-up's statements).
func (t *sqlTracer) Reset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stats = map[string]*sqlStat{}
}

// Print writes the statements by total time, as a share of wall × concurrency.
func (t *sqlTracer) Print(w io.Writer, label string, wall time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	names := make([]string, 0, len(t.stats))
	for n := range t.stats {
		names = append(names, n)
	}
	slices.SortFunc(names, func(a, b string) int { return int(t.stats[b].Total - t.stats[a].Total) })
	fmt.Fprintf(w, "[%s] SQL time by statement (client-side wait; wall %s):\n", label, wall.Round(time.Millisecond))
	for _, n := range names {
		st := t.stats[n]
		fmt.Fprintf(w, "[%s]   %8d calls %9.1f ms total %8.3f ms avg  %s\n", label, st.Calls, measure.Ms(st.Total), measure.Ms(st.Total)/float64(st.Calls), n)
	}
}

// statementName shortens a statement to its first words.
func statementName(sql string) string {
	s := strings.Join(strings.Fields(sql), " ")
	if len(s) > 70 {
		s = s[:70]
	}
	return s
}
