// Command partbench measures retention of idem_inbox and idem_outbox at scale, row
// deletes against partition drops, side by side in one run on one server:
//
//	go run ./cmd/partbench                  # 10M rows, about 15 minutes here
//	go run ./cmd/partbench -rows 1000000    # a quicker look
//
// For each table and layout (plain: the table as migrated and the collector's
// batched DELETE; partitioned: package partition, day partitions dropped whole) it
// creates a fresh database and fills the table in steps up to -rows with rows that
// expired over the past ten days (outbox rows: published, proven, past retention).
// For the inbox it measures at each step the claim (dedupe.Inbox.Claim of one
// fresh key in its own transaction, what a consumer does per message) -claims
// times: p50 and p99. Then it runs one collection round (worker.Collect: what the
// worker's collector does every minute) and reports its time, the WAL it wrote,
// and the table's size before, after, and after a plain VACUUM: row deletes leave
// dead tuples and a table that does not shrink; a dropped partition is gone.
//
// WAL is measured as the server's LSN advance during the round, so other load on
// the same server inflates it: run on a quiet server. The result goes to stdout
// as a table and to -json (default partbench-results.json).
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/worker"
)

// pastDays is how many past days of expired keys the inbox is filled with.
const pastDays = 10

type options struct {
	adminURL string
	tables   []partition.Table
	rows     int
	steps    []int
	claims   int
	json     string
	keep     bool
}

// Result is one layout's figures (the JSON contract of this program).
type Result struct {
	Table  string       `json:"table"`
	Layout string       `json:"layout"`
	Rows   int          `json:"rows"`
	Claims []ClaimPoint `json:"claims"`
	// The collection round.
	RoundSeconds        float64 `json:"round_seconds"`
	RowsDeleted         int64   `json:"rows_deleted"`
	PartitionsDropped   int     `json:"partitions_dropped"`
	WALBytes            int64   `json:"wal_bytes"`
	BytesBefore         int64   `json:"bytes_before"`
	BytesAfter          int64   `json:"bytes_after"`
	BytesAfterVacuum    int64   `json:"bytes_after_vacuum"`
	DeadTuplesAfter     int64   `json:"dead_tuples_after"`
	VacuumSeconds       float64 `json:"vacuum_seconds"`
	ClaimAfterRoundP50  float64 `json:"claim_after_round_p50_ms"`
	ClaimAfterRoundP99  float64 `json:"claim_after_round_p99_ms"`
	FillRowsPerSecond   float64 `json:"fill_rows_per_second"`
	PartitionsAtMaxRows int     `json:"partitions_at_max_rows"`
}

// ClaimPoint is the claim's latency with the inbox at Rows rows.
type ClaimPoint struct {
	Rows  int     `json:"rows"`
	P50ms float64 `json:"p50_ms"`
	P99ms float64 `json:"p99_ms"`
}

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "partbench:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout, stderr io.Writer) error {
	o, err := parse(args, stderr)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var results []Result
	for _, table := range o.tables {
		for _, layout := range []string{"plain", "partitioned"} {
			r, err := measure(ctx, o, table, layout, stderr)
			if err != nil {
				return fmt.Errorf("%s %s: %w", table, layout, err)
			}
			results = append(results, r)
		}
	}
	report(stdout, results)
	b, err := json.MarshalIndent(results, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(o.json, append(b, '\n'), 0o644)
}

func parse(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("partbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	def := os.Getenv("DATABASE_URL")
	if def == "" {
		def = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	fs.StringVar(&o.adminURL, "database-url", def, "server to create the scratch databases on (env DATABASE_URL)")
	fs.IntVar(&o.rows, "rows", 10_000_000, "inbox rows at the end of the fill")
	steps := fs.String("steps", "0,0.1,0.25,0.5,1", "fractions of -rows at which the claim is measured")
	fs.IntVar(&o.claims, "claims", 2000, "claims measured at each step")
	fs.StringVar(&o.json, "json", "partbench-results.json", "write the results as JSON to this file")
	fs.BoolVar(&o.keep, "keep", false, "keep the scratch databases")
	tables := fs.String("tables", "idem_inbox,idem_outbox", "tables to measure, comma-separated")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if o.rows < 1 || o.claims < 1 {
		return o, fmt.Errorf("-rows and -claims must be positive")
	}
	for _, s := range strings.Split(*steps, ",") {
		f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
		if err != nil || f < 0 || f > 1 {
			return o, fmt.Errorf("-steps: %q is not a fraction between 0 and 1", s)
		}
		o.steps = append(o.steps, int(f*float64(o.rows)))
	}
	slices.Sort(o.steps)
	for _, t := range strings.Split(*tables, ",") {
		t := partition.Table(strings.TrimSpace(t))
		if !slices.Contains(partition.Tables(), t) {
			return o, fmt.Errorf("-tables: %q is not one of %v", t, partition.Tables())
		}
		o.tables = append(o.tables, t)
	}
	return o, nil
}

// scratch is one layout's database.
type scratch struct {
	pool  *pgxpool.Pool
	inst  *install.Installation // no broker: the bench touches tables only
	name  string
	drop  func()
	inbox *dedupe.Inbox
	table partition.Table
}

func newScratch(ctx context.Context, o options, table partition.Table, layout string) (*scratch, error) {
	admin, err := pgx.Connect(ctx, o.adminURL)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	defer admin.Close(ctx)
	var b [4]byte
	_, _ = rand.Read(b[:])
	name := "idem_partbench_" + strings.TrimPrefix(string(table), "idem_") + "_" + layout + "_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		return nil, err
	}
	u, err := url.Parse(o.adminURL)
	if err != nil {
		return nil, err
	}
	u.Path = "/" + name
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		return nil, err
	}
	s := &scratch{pool: pool, name: name, table: table}
	s.drop = func() {
		pool.Close()
		if o.keep {
			fmt.Fprintln(os.Stderr, "kept database", name)
			return
		}
		c, err := pgx.Connect(context.Background(), o.adminURL)
		if err == nil {
			_, _ = c.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
			c.Close(context.Background())
		}
	}
	if _, err := migrations.Apply(ctx, pool, migrations.Config{}); err != nil {
		s.drop()
		return nil, err
	}
	if s.inst, err = install.New(pool, nil, install.Config{Stream: install.Stream{Name: "PARTBENCH", Subjects: []string{"partbench.>"}},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}); err != nil {
		s.drop()
		return nil, err
	}
	s.inbox = dedupe.New(s.inst)
	if layout == "partitioned" {
		if err := s.partition(ctx); err != nil {
			s.drop()
			return nil, err
		}
	}
	return s, nil
}

// partition converts the empty tables and gives the measured one the past days a
// long-running installation has: the ten days of rows the fill writes, all expired.
func (s *scratch) partition(ctx context.Context) error {
	if _, err := partition.Convert(ctx, s.pool, partition.Config{}); err != nil {
		return err
	}
	// Today's and the days ahead first: a round drops past days that are empty.
	if _, err := partition.Maintain(ctx, s.pool, partition.Config{KeyLifetime: time.Hour}); err != nil {
		return err
	}
	today := time.Now().UTC().Truncate(partition.Day)
	for d := -pastDays; d < 0; d++ {
		from := today.AddDate(0, 0, d)
		sql := fmt.Sprintf(`CREATE TABLE %[1]s_p%[2]s PARTITION OF %[1]s FOR VALUES FROM ('%[3]s') TO ('%[4]s')`,
			s.table, from.Format("20060102"), from.Format(time.RFC3339), from.AddDate(0, 0, 1).Format(time.RFC3339))
		if _, err := s.pool.Exec(ctx, sql); err != nil {
			return err
		}
	}
	return nil
}

func measure(ctx context.Context, o options, table partition.Table, layout string, progress io.Writer) (Result, error) {
	r := Result{Table: string(table), Layout: layout, Rows: o.rows}
	s, err := newScratch(ctx, o, table, layout)
	if err != nil {
		return r, err
	}
	defer s.drop()
	logf := func(format string, args ...any) {
		fmt.Fprintf(progress, "[%s %s %s] %s\n", time.Now().Format("15:04:05"), table, layout, fmt.Sprintf(format, args...))
	}

	// Fill, measuring the claim at each step.
	filled := 0
	fillTime := time.Duration(0)
	for _, step := range o.steps {
		for filled < step {
			n := min(500_000, step-filled)
			t0 := time.Now()
			if err := s.fill(ctx, filled, n, o.rows); err != nil {
				return r, err
			}
			fillTime += time.Since(t0)
			filled += n
			logf("filled %d/%d rows (%.0f rows/s)", filled, o.rows, float64(filled)/fillTime.Seconds())
		}
		if _, err := s.pool.Exec(ctx, `ANALYZE `+string(table)); err != nil {
			return r, err
		}
		if table != partition.Inbox {
			continue
		}
		p50, p99, err := s.claims(ctx, o.claims, fmt.Sprintf("step%d", step))
		if err != nil {
			return r, err
		}
		r.Claims = append(r.Claims, ClaimPoint{Rows: step, P50ms: p50, P99ms: p99})
		logf("claim at %d rows: p50 %.3f ms, p99 %.3f ms", step, p50, p99)
	}
	if fillTime > 0 {
		r.FillRowsPerSecond = float64(filled) / fillTime.Seconds()
	}
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM pg_inherits WHERE inhparent = $1::regclass`, string(table)).Scan(&r.PartitionsAtMaxRows); err != nil {
		return r, err
	}

	// One collection round.
	if _, err := s.pool.Exec(ctx, `CHECKPOINT`); err != nil {
		logf("CHECKPOINT needs superuser; WAL figures include its absence: %v", err)
	}
	if r.BytesBefore, err = s.size(ctx); err != nil {
		return r, err
	}
	lsn0, err := s.lsn(ctx)
	if err != nil {
		return r, err
	}
	logf("collection round: %s", map[string]string{"plain": "batched row deletes (1000 per statement)", "partitioned": "partition drops"}[layout])
	t0 := time.Now()
	dropped := 0
	if layout == "partitioned" {
		past := func() (int, error) {
			parts, err := partition.List(ctx, s.pool, partition.Config{}, table)
			n := 0
			for _, p := range parts {
				if !p.Default && p.To.Before(time.Now()) {
					n++
				}
			}
			return n, err
		}
		before, err := past()
		if err != nil {
			return r, err
		}
		if r.RowsDeleted, err = worker.Collect(ctx, s.inst, worker.RetentionConfig{}); err != nil {
			return r, err
		}
		after, err := past()
		if err != nil {
			return r, err
		}
		dropped = before - after
	} else if r.RowsDeleted, err = worker.Collect(ctx, s.inst, worker.RetentionConfig{}); err != nil {
		return r, err
	}
	r.RoundSeconds = time.Since(t0).Seconds()
	r.PartitionsDropped = dropped
	lsn1, err := s.lsn(ctx)
	if err != nil {
		return r, err
	}
	r.WALBytes = lsn1 - lsn0
	if r.BytesAfter, err = s.size(ctx); err != nil {
		return r, err
	}
	if err := s.pool.QueryRow(ctx, `SELECT COALESCE(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables WHERE relname LIKE $1 || '%'`, string(table)).Scan(&r.DeadTuplesAfter); err != nil {
		return r, err
	}
	logf("round: %.1f s, %d rows deleted, %d partitions dropped, WAL %s", r.RoundSeconds, r.RowsDeleted, dropped, mib(r.WALBytes))
	t0 = time.Now()
	if _, err := s.pool.Exec(ctx, `VACUUM `+string(table)); err != nil {
		return r, err
	}
	r.VacuumSeconds = time.Since(t0).Seconds()
	if r.BytesAfterVacuum, err = s.size(ctx); err != nil {
		return r, err
	}
	if table == partition.Inbox {
		if r.ClaimAfterRoundP50, r.ClaimAfterRoundP99, err = s.claims(ctx, o.claims, "after"); err != nil {
			return r, err
		}
	}
	if table == partition.Inbox {
		logf("after the round and VACUUM: %s; claim p50 %.3f ms, p99 %.3f ms", mib(r.BytesAfterVacuum), r.ClaimAfterRoundP50, r.ClaimAfterRoundP99)
	} else {
		logf("after the round and VACUUM: %s", mib(r.BytesAfterVacuum))
	}
	return r, nil
}

// fill inserts n expired rows, numbered from first, spread evenly over the past
// ten days (so each past day's partition gets its share). Inbox rows are keys
// whose lifetime ended; outbox rows were published, proven complete and are past
// their retention, with a 100-byte payload.
func (s *scratch) fill(ctx context.Context, first, n, total int) error {
	sql := sqlFillInbox
	if s.table == partition.Outbox {
		sql = sqlFillOutbox
	}
	if _, err := s.pool.Exec(ctx, sql, first, first+n-1, total); err != nil {
		return fmt.Errorf("fill: %w", err)
	}
	return nil
}

// The instant e of row g: from ten days before today's UTC midnight to it.
const (
	sqlFillInbox = `
INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, created_at, completed_at, expires_at)
SELECT 'bench', 'fill-' || g, 'bench.claim', sha256(g::text::bytea), 'done', e - interval '72 hours', e - interval '72 hours', e
FROM generate_series($1::bigint, $2::bigint) AS g
CROSS JOIN LATERAL (SELECT date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                           - interval '10 days' + (g::float8 / $3::float8) * interval '10 days' AS e) AS x`

	sqlFillOutbox = `
INSERT INTO idem_outbox (key, subject, msg_id, headers, payload, created_at, published_at, attempts,
                         stream, stream_seq, completed_at, expires_at)
SELECT 'fill-' || g, 'bench.charge', 'bench.charge fill-' || g, '{}', convert_to(repeat('x', 100), 'UTF8'),
       e, e, 1, 'BENCH', g, e, e + interval '1 minute'
FROM generate_series($1::bigint, $2::bigint) AS g
CROSS JOIN LATERAL (SELECT date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                           - interval '10 days' + (g::float8 / ($3::float8 + 1)) * interval '10 days' + interval '1 second' AS e) AS x`
)

// claims measures n claims and settlements of one fresh key each, in their own
// transactions.
func (s *scratch) claims(ctx context.Context, n int, tag string) (p50, p99 float64, err error) {
	lat := make([]time.Duration, 0, n)
	for i := range n {
		tx, err := s.pool.Begin(ctx)
		if err != nil {
			return 0, 0, err
		}
		key := fmt.Sprintf("claim-%s-%d", tag, i)
		t0 := time.Now()
		id := dedupe.ID{Key: key, Message: "bench.claim"}
		cl := dedupe.Claim{Key: key, Message: id.Message, Payload: []byte(key)}
		v, err := s.inbox.Claim(ctx, tx, "bench", []dedupe.Claim{cl})
		if err == nil && v[id] == dedupe.Fresh {
			err = s.inbox.Settle(ctx, tx, "bench", []dedupe.Settlement{{Claim: cl}}, time.Hour)
		}
		lat = append(lat, time.Since(t0))
		if err != nil {
			tx.Rollback(ctx) //nolint:errcheck
			return 0, 0, err
		}
		if v[id] != dedupe.Fresh {
			tx.Rollback(ctx) //nolint:errcheck
			return 0, 0, fmt.Errorf("claim %s: %s, want fresh", key, v[id])
		}
		if err := tx.Commit(ctx); err != nil {
			return 0, 0, err
		}
	}
	slices.Sort(lat)
	ms := func(q float64) float64 { return float64(lat[int(q*float64(len(lat)-1))].Microseconds()) / 1000 }
	return ms(0.5), ms(0.99), nil
}

// size is the measured table's bytes on disk, heap and indexes, every partition
// included.
func (s *scratch) size(ctx context.Context) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `
SELECT COALESCE(sum(pg_total_relation_size(c.oid)), 0)::bigint
FROM pg_class c WHERE c.relkind = 'r' AND c.relname LIKE replace($1, '_', '\_') || '%'`, string(s.table)).Scan(&n)
	return n, err
}

func (s *scratch) lsn(ctx context.Context) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint`).Scan(&n)
	return n, err
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

func report(w io.Writer, rs []Result) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "table\tlayout\trows\tround s\tdeleted rows\tdropped partitions\tWAL\tsize before\tafter\tafter VACUUM\tdead tuples")
	for _, r := range rs {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%.2f\t%d\t%d\t%s\t%s\t%s\t%s\t%d\n", r.Table, r.Layout, r.Rows, r.RoundSeconds, r.RowsDeleted,
			r.PartitionsDropped, mib(r.WALBytes), mib(r.BytesBefore), mib(r.BytesAfter), mib(r.BytesAfterVacuum), r.DeadTuplesAfter)
	}
	tw.Flush()
	var inbox []Result
	for _, r := range rs {
		if r.Table == string(partition.Inbox) {
			inbox = append(inbox, r)
		}
	}
	if len(inbox) > 0 {
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprint(tw, "inbox claim p50 / p99 ms at rows")
		for _, c := range inbox[0].Claims {
			fmt.Fprintf(tw, "\t%d", c.Rows)
		}
		fmt.Fprintln(tw, "\tafter the round")
		for _, r := range inbox {
			fmt.Fprint(tw, r.Layout)
			for _, c := range r.Claims {
				fmt.Fprintf(tw, "\t%.3f / %.3f", c.P50ms, c.P99ms)
			}
			fmt.Fprintf(tw, "\t%.3f / %.3f\n", r.ClaimAfterRoundP50, r.ClaimAfterRoundP99)
		}
		tw.Flush()
	}
	fmt.Fprintln(w)
	for i := 0; i+1 < len(rs); i += 2 {
		plain, part := rs[i], rs[i+1]
		if part.RoundSeconds > 0 && part.WALBytes > 0 {
			fmt.Fprintf(w, "%s plain/partitioned: round time %.0f×, WAL %.0f×\n", plain.Table, plain.RoundSeconds/part.RoundSeconds, float64(plain.WALBytes)/float64(part.WALBytes))
		}
	}
}
