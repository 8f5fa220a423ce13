package main

// Operator commands: inspect one key's whole life, and overall counts and lags.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/service"
)

// The operator queries, in one place.
const (
	sqlInspectRequest = `
SELECT scope, key, method, path, status, response_code, encode(fingerprint, 'hex'), created_at, expires_at
FROM idem_requests WHERE scope = $1 AND key = $2`
	sqlInspectOutbox = `
SELECT id, subject, msg_id, created_at, published_at, attempts, COALESCE(last_error, '')
FROM idem_outbox WHERE key = $1 ORDER BY id`
	sqlInspectInbox = `
SELECT consumer, status, COALESCE(convert_from(result, 'UTF8'), ''), lease_until, COALESCE(step, ''), created_at, completed_at, expires_at
FROM idem_inbox WHERE key = $1 ORDER BY consumer`
	sqlInspectDeadLetters = `
SELECT id, consumer, subject, reason, deliveries, created_at, replayed_at
FROM idem_dead_letters WHERE key = $1 ORDER BY id`
	sqlInspectLedger = `
SELECT id, account, amount_cents, created_at FROM ledger_entries WHERE idempotency_key = $1 ORDER BY id`

	sqlStatsRequests = `SELECT count(*) FROM idem_requests`
	sqlStatsOutbox   = `
SELECT count(*) FILTER (WHERE published_at IS NULL),
       count(*) FILTER (WHERE published_at IS NOT NULL),
       COALESCE(EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE published_at IS NULL)), 0)::float8
FROM idem_outbox`
	sqlStatsInbox       = `SELECT consumer, status, count(*) FROM idem_inbox GROUP BY 1, 2 ORDER BY 1, 2`
	sqlStatsDeadLetters = `SELECT count(*), count(*) FILTER (WHERE replayed_at IS NULL) FROM idem_dead_letters`
	sqlStatsLedger      = `SELECT count(*) FROM ledger_entries`
)

// keyLife is everything the database knows about one key.
type keyLife struct {
	Scope       string          `json:"scope"`
	Key         string          `json:"key"`
	Request     *requestRow     `json:"request,omitempty"`
	Outbox      []outboxRow     `json:"outbox"`
	Inbox       []inboxRow      `json:"inbox"`
	DeadLetters []deadLetterRow `json:"dead_letters"`
	Ledger      []ledgerRow     `json:"ledger_entries"`
}

type requestRow struct {
	Method, Path, Status string
	ResponseCode         *int
	Fingerprint          string
	CreatedAt, ExpiresAt time.Time
}

type outboxRow struct {
	ID          int64
	Subject     string
	MsgID       string
	CreatedAt   time.Time
	PublishedAt *time.Time
	Attempts    int
	LastError   string
}

type inboxRow struct {
	Consumer, Status, Result string
	LeaseUntil               *time.Time
	Step                     string
	CreatedAt                time.Time
	CompletedAt              *time.Time
	ExpiresAt                time.Time
}

type deadLetterRow struct {
	ID                int64
	Consumer, Subject string
	Reason            string
	Deliveries        int
	CreatedAt         time.Time
	ReplayedAt        *time.Time
}

type ledgerRow struct {
	ID          int64
	Account     string
	AmountCents int64
	CreatedAt   time.Time
}

func runInspect(args []string, stdout, stderr io.Writer) error {
	fs, o := newFlagSet("worker inspect", stderr)
	scope := fs.String("scope", "", "the Idempotency-Scope the key was sent with")
	asJSON := fs.Bool("json", false, "print JSON instead of text")
	fs.Usage = func() { fmt.Fprint(stderr, "usage: worker inspect [flags] KEY\n\n"); fs.PrintDefaults() }
	// Accept the key before or after the flags.
	var key string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		key, args = args[0], args[1:]
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if key == "" && fs.NArg() == 1 {
		key = fs.Arg(0)
	} else if key == "" || fs.NArg() > 0 {
		fs.Usage()
		return errors.New("inspect: want exactly one KEY")
	}
	if err := idem.ValidateScope(*scope); err != nil {
		return err
	}
	ctx := context.Background()
	pool, err := openPool(ctx, o)
	if err != nil {
		return err
	}
	defer pool.Close()
	life, err := inspectKey(ctx, pool, *scope, key)
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(life)
	}
	printLife(stdout, life)
	return nil
}

func inspectKey(ctx context.Context, pool *pgxpool.Pool, scope, key string) (keyLife, error) {
	scoped := idem.ScopedKey(scope, idem.Key(key))
	life := keyLife{Scope: scope, Key: key}
	var r requestRow
	err := pool.QueryRow(ctx, sqlInspectRequest, scope, key).Scan(new(string), new(string), &r.Method, &r.Path, &r.Status, &r.ResponseCode, &r.Fingerprint, &r.CreatedAt, &r.ExpiresAt)
	switch {
	case err == nil:
		life.Request = &r
	case !errors.Is(err, pgx.ErrNoRows):
		return life, fmt.Errorf("inspect: request: %w", err)
	}
	if err := collect(ctx, pool, sqlInspectOutbox, scoped, &life.Outbox, func(row pgx.Row, x *outboxRow) error {
		return row.Scan(&x.ID, &x.Subject, &x.MsgID, &x.CreatedAt, &x.PublishedAt, &x.Attempts, &x.LastError)
	}); err != nil {
		return life, fmt.Errorf("inspect: outbox: %w", err)
	}
	if err := collect(ctx, pool, sqlInspectInbox, scoped, &life.Inbox, func(row pgx.Row, x *inboxRow) error {
		return row.Scan(&x.Consumer, &x.Status, &x.Result, &x.LeaseUntil, &x.Step, &x.CreatedAt, &x.CompletedAt, &x.ExpiresAt)
	}); err != nil {
		return life, fmt.Errorf("inspect: inbox: %w", err)
	}
	if err := collect(ctx, pool, sqlInspectDeadLetters, scoped, &life.DeadLetters, func(row pgx.Row, x *deadLetterRow) error {
		return row.Scan(&x.ID, &x.Consumer, &x.Subject, &x.Reason, &x.Deliveries, &x.CreatedAt, &x.ReplayedAt)
	}); err != nil {
		return life, fmt.Errorf("inspect: dead letters: %w", err)
	}
	if err := collect(ctx, pool, sqlInspectLedger, scoped, &life.Ledger, func(row pgx.Row, x *ledgerRow) error {
		return row.Scan(&x.ID, &x.Account, &x.AmountCents, &x.CreatedAt)
	}); err != nil {
		return life, fmt.Errorf("inspect: ledger: %w", err)
	}
	return life, nil
}

// collect runs a one-argument query and scans every row into a new T.
func collect[T any](ctx context.Context, pool *pgxpool.Pool, sql, arg string, out *[]T, scan func(pgx.Row, *T) error) error {
	rows, err := pool.Query(ctx, sql, arg)
	if err != nil {
		return err
	}
	defer rows.Close()
	*out = []T{}
	for rows.Next() {
		var x T
		if err := scan(rows, &x); err != nil {
			return err
		}
		*out = append(*out, x)
	}
	return rows.Err()
}

func printLife(w io.Writer, l keyLife) {
	ts := func(t *time.Time) string {
		if t == nil {
			return "-"
		}
		return t.UTC().Format(time.RFC3339Nano)
	}
	name := fmt.Sprintf("%q", l.Key)
	if l.Scope != "" {
		name += fmt.Sprintf(" in scope %q", l.Scope)
	}
	if l.Request == nil && len(l.Outbox)+len(l.Inbox)+len(l.DeadLetters)+len(l.Ledger) == 0 {
		fmt.Fprintf(w, "nothing is known about key %s (never seen, or past its lifetime and collected)\n", name)
		return
	}
	fmt.Fprintf(w, "key %s\n\n", name)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "1. HTTP request (idem_requests)")
	if r := l.Request; r != nil {
		code := "-"
		if r.ResponseCode != nil {
			code = fmt.Sprint(*r.ResponseCode)
		}
		fmt.Fprintf(tw, "\t%s %s\tanswered %s\tfingerprint %s…\tat %s\texpires %s\n", r.Method, r.Path, code, short(r.Fingerprint), ts(&r.CreatedAt), ts(&r.ExpiresAt))
	} else {
		fmt.Fprintln(tw, "\t(none: not sent through the ingress, or collected)")
	}
	fmt.Fprintln(tw, "2. Outbox (idem_outbox)")
	for _, o := range l.Outbox {
		state := "published " + ts(o.PublishedAt)
		if o.PublishedAt == nil {
			state = "NOT PUBLISHED yet"
		}
		fmt.Fprintf(tw, "\t#%d %s\tmsg-id %q\tenqueued %s\t%s\tattempts %d\t%s\n", o.ID, o.Subject, o.MsgID, ts(&o.CreatedAt), state, o.Attempts, o.LastError)
	}
	if len(l.Outbox) == 0 {
		fmt.Fprintln(tw, "\t(none)")
	}
	fmt.Fprintln(tw, "3. Inbox, per consumer (idem_inbox)")
	for _, in := range l.Inbox {
		fmt.Fprintf(tw, "\t%s\t%s\tclaimed %s\tcompleted %s\tlease %s\tstep %q\tresult %s\n", in.Consumer, in.Status, ts(&in.CreatedAt), ts(in.CompletedAt), ts(in.LeaseUntil), in.Step, in.Result)
	}
	if len(l.Inbox) == 0 {
		fmt.Fprintln(tw, "\t(none: not consumed yet)")
	}
	fmt.Fprintln(tw, "4. Dead letters (idem_dead_letters)")
	for _, d := range l.DeadLetters {
		fmt.Fprintf(tw, "\t#%d %s\t%s\tdeliveries %d\tat %s\treplayed %s\t%s\n", d.ID, d.Consumer, d.Subject, d.Deliveries, ts(&d.CreatedAt), ts(d.ReplayedAt), d.Reason)
	}
	if len(l.DeadLetters) == 0 {
		fmt.Fprintln(tw, "\t(none)")
	}
	fmt.Fprintln(tw, "5. Effects (ledger_entries)")
	for _, e := range l.Ledger {
		fmt.Fprintf(tw, "\t#%d\t%s\t%d cents\tat %s\n", e.ID, e.Account, e.AmountCents, ts(&e.CreatedAt))
	}
	if len(l.Ledger) == 0 {
		fmt.Fprintln(tw, "\t(none)")
	}
	if len(l.Ledger) > 1 {
		fmt.Fprintf(tw, "\tWARNING: %d ledger rows for one key\n", len(l.Ledger))
	}
	tw.Flush()
}

func short(hexs string) string {
	if len(hexs) > 12 {
		return hexs[:12]
	}
	return hexs
}

// stats is a snapshot of counts and lags.
type stats struct {
	Requests           int64                       `json:"requests"`
	OutboxPending      int64                       `json:"outbox_pending"`
	OutboxPublished    int64                       `json:"outbox_published"`
	OutboxOldestSecs   float64                     `json:"outbox_oldest_unpublished_seconds"`
	Inbox              map[string]map[string]int64 `json:"inbox"`
	DeadLetters        int64                       `json:"dead_letters"`
	DeadLettersPending int64                       `json:"dead_letters_not_replayed"`
	LedgerEntries      int64                       `json:"ledger_entries"`
	Consumers          map[string]consumerLag      `json:"jetstream_consumers,omitempty"`
}

type consumerLag struct {
	Pending     uint64 `json:"num_pending"`
	AckPending  int    `json:"num_ack_pending"`
	Redelivered int    `json:"num_redelivered"`
}

func runStats(args []string, stdout, stderr io.Writer) error {
	fs, o := newFlagSet("worker stats", stderr)
	asJSON := fs.Bool("json", false, "print JSON instead of text")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := openPool(ctx, o)
	if err != nil {
		return err
	}
	defer pool.Close()
	st := stats{Inbox: map[string]map[string]int64{}}
	if err := pool.QueryRow(ctx, sqlStatsRequests).Scan(&st.Requests); err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	if err := pool.QueryRow(ctx, sqlStatsOutbox).Scan(&st.OutboxPending, &st.OutboxPublished, &st.OutboxOldestSecs); err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	rows, err := pool.Query(ctx, sqlStatsInbox)
	if err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	var consumer, status string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&consumer, &status, &n}, func() error {
		if st.Inbox[consumer] == nil {
			st.Inbox[consumer] = map[string]int64{}
		}
		st.Inbox[consumer][status] = n
		return nil
	})
	if err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	if err := pool.QueryRow(ctx, sqlStatsDeadLetters).Scan(&st.DeadLetters, &st.DeadLettersPending); err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	if err := pool.QueryRow(ctx, sqlStatsLedger).Scan(&st.LedgerEntries); err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	st.Consumers = consumerLags(ctx, o, stderr)

	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(st)
	}
	tw := tabwriter.NewWriter(stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "requests (idem_requests)\t%d\n", st.Requests)
	fmt.Fprintf(tw, "outbox pending\t%d\t(oldest unpublished %.1fs)\n", st.OutboxPending, st.OutboxOldestSecs)
	fmt.Fprintf(tw, "outbox published (kept until expiry)\t%d\n", st.OutboxPublished)
	for c, m := range st.Inbox {
		for s, n := range m {
			fmt.Fprintf(tw, "inbox %s %s\t%d\n", c, s, n)
		}
	}
	fmt.Fprintf(tw, "dead letters\t%d\t(%d not replayed)\n", st.DeadLetters, st.DeadLettersPending)
	fmt.Fprintf(tw, "ledger entries\t%d\n", st.LedgerEntries)
	for name, lag := range st.Consumers {
		fmt.Fprintf(tw, "jetstream consumer %s\tpending %d\tack-pending %d\tredelivered %d\n", name, lag.Pending, lag.AckPending, lag.Redelivered)
	}
	return tw.Flush()
}

// consumerLags reads the durable consumers' lag from JetStream when a server is
// known (--nats-url, or the embedded server's URL file); otherwise it says so.
func consumerLags(ctx context.Context, o *options, stderr io.Writer) map[string]consumerLag {
	url := o.natsURL
	if url == "" {
		b, err := os.ReadFile(filepath.Join(o.dataDir, service.NATSURLFile))
		if err != nil {
			fmt.Fprintln(stderr, "stats: no --nats-url and no running embedded server under --data-dir; JetStream lag not shown")
			return nil
		}
		url = strings.TrimSpace(string(b))
	}
	nc, err := nats.Connect(url, nats.Timeout(3*time.Second))
	if err != nil {
		fmt.Fprintf(stderr, "stats: NATS at %s: %v; JetStream lag not shown\n", url, err)
		return nil
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil
	}
	s, err := js.Stream(ctx, idem.StreamName)
	if err != nil {
		fmt.Fprintf(stderr, "stats: stream %s: %v\n", idem.StreamName, err)
		return nil
	}
	out := map[string]consumerLag{}
	lister := s.ListConsumers(ctx)
	for info := range lister.Info() {
		out[info.Name] = consumerLag{Pending: info.NumPending, AckPending: info.NumAckPending, Redelivered: info.NumRedelivered}
	}
	return out
}
