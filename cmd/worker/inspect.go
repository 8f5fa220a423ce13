package main

// worker inspect KEY: everything idem knows about one idempotency key. This file
// also holds what the operator commands share: finding the database (the one the
// worker of --data-dir recorded, including the private Postgres a zero-setup
// worker started there), and printing.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/pgembed"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/runenv"
	"github.com/idemkit/idem/internal/ops"
	"github.com/idemkit/idem/internal/pgschema"
)

// opsTimeout bounds an operator command: it reads, and should never hang a shell.
const opsTimeout = 60 * time.Second

const inspectUsage = `usage: worker inspect [flags] KEY

Prints the whole life of one idempotency key: the HTTP request record, the outbox
messages, each consumer's inbox claim, dead letters, and the reference
application's rows (payments, emails, ledger_entries). KEY is the key the client
sent; give its tenant with --scope, or paste a scoped key as logged past the
ingress. Flags may follow KEY. --json prints the report as one JSON document.

Exit status: 0 when the key is known; 1 when nothing is known about it (the report
is still printed, naming other scopes that know the key) or on an error; 2 on a
usage error.

flags:
`

// inspectOptions are the flags and the argument of worker inspect.
type inspectOptions struct {
	db     dbOptions
	scope  string
	asJSON bool
	key    idem.Key
}

func (o *inspectOptions) flags(fs *flagSet) {
	o.db.flags(fs)
	fs.StringVar(&o.scope, "scope", "", "the key's Idempotency-Scope (tenant); empty for none")
	fs.BoolVar(&o.asJSON, "json", false, "print JSON instead of text")
}

func (o *inspectOptions) validate(args []string) error {
	if len(args) != 1 {
		return fmt.Errorf("inspect: want exactly one KEY, got %d arguments (see worker inspect -h)", len(args))
	}
	// A scoped key pasted from a log or from the outbox is split back into scope
	// and key; a bare key parses as itself, with no scope.
	keyScope, key, err := idem.ParseScopedKey(args[0])
	if err != nil {
		return fmt.Errorf("inspect: %w", err)
	}
	if keyScope != "" {
		if o.scope != "" && o.scope != keyScope {
			return fmt.Errorf("inspect: KEY is scoped to %q but --scope says %q", keyScope, o.scope)
		}
		o.scope = keyScope
	}
	if err := idem.ValidateScope(o.scope); err != nil {
		return fmt.Errorf("inspect: --scope: %w", err)
	}
	if err := pgschema.Validate(o.db.schema); err != nil {
		return fmt.Errorf("inspect: --schema: %w", err)
	}
	o.key = key
	return nil
}

func runInspect(o *inspectOptions, stdout, _ io.Writer) error {
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, &o.db)
	if err != nil {
		return err
	}
	defer pool.Close()
	r, err := ops.New(pool, ops.Config{Schema: o.db.schema, Effects: refapp.InspectEffects})
	if err != nil {
		return fmt.Errorf("inspect: %w", err)
	}
	rep, err := r.Inspect(ctx, o.scope, o.key)
	if err != nil {
		return fmt.Errorf("inspect: %w", err)
	}
	if o.asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else {
		writeKeyReport(stdout, rep)
	}
	if !rep.Known {
		// A script asking "did this intent arrive?" reads the exit status.
		return fmt.Errorf("inspect: nothing is known about key %q (%s)", rep.Key, scopeName(rep.Scope))
	}
	return nil
}

// scopeName describes a scope in messages.
func scopeName(scope string) string {
	if scope == "" {
		return "no scope"
	}
	return fmt.Sprintf("scope %q", scope)
}

// openOpsPool connects to the database like openPool. When the user named no
// database (neither --database-url nor DATABASE_URL), it goes where the worker of
// --data-dir runs, as that worker recorded it (runenv.DatabaseFile): its private
// Postgres, or the default URL, and checks that it reached the recorded database.
// A data dir without a record (a worker of an earlier version) gets the old
// guess: the default URL, else the private Postgres under --data-dir. It takes no
// lock: it runs beside the worker.
func openOpsPool(ctx context.Context, d *dbOptions) (*pgxpool.Pool, error) {
	if d.databaseNamed() || d.dataDir == "" {
		return openPool(ctx, d.databaseURL)
	}
	rec, err := runenv.ReadDatabaseRecord(d.dataDir)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(d.dataDir, pgembed.Subdir)
	recordFile := filepath.Join(d.dataDir, runenv.DatabaseFile)
	var pool *pgxpool.Pool
	url := d.databaseURL
	switch {
	case rec == nil:
		return openGuessedPool(ctx, d, dir)
	case rec.Private:
		private, err := pgembed.URL(dir)
		if err != nil {
			return nil, fmt.Errorf("the worker of data dir %s runs on its private Postgres (%s), but: %w", d.dataDir, recordFile, err)
		}
		url = private
		if pool, err = openPool(ctx, private); err != nil {
			return nil, fmt.Errorf("the worker of data dir %s runs on its private Postgres under %s (%s): is the worker running? %w",
				d.dataDir, dir, runenv.Redact(private), err)
		}
	default:
		if runenv.Redact(d.databaseURL) != rec.URL {
			return nil, fmt.Errorf("the worker of data dir %s runs on the database at %s (%s): give it with --database-url or DATABASE_URL",
				d.dataDir, rec.URL, recordFile)
		}
		if pool, err = openPool(ctx, d.databaseURL); err != nil {
			return nil, err
		}
	}
	if err := rec.Check(ctx, pool, d.dataDir, url); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// openGuessedPool is openOpsPool for a data dir without a database record: the
// default URL, and when nothing answers there the private Postgres under dir.
func openGuessedPool(ctx context.Context, d *dbOptions, dir string) (*pgxpool.Pool, error) {
	pool, err := openPool(ctx, d.databaseURL)
	if err == nil {
		return pool, nil
	}
	private, perr := pgembed.URL(dir)
	if perr != nil {
		return nil, fmt.Errorf("%w (and no private Postgres was ever started under %s: set --database-url or DATABASE_URL)", err, dir)
	}
	pool, perr = openPool(ctx, private)
	if perr != nil {
		return nil, fmt.Errorf("%w; nor does the worker's private Postgres under %s (%s): is the worker running? %v",
			err, dir, runenv.Redact(private), perr)
	}
	return pool, nil
}

// writeKeyReport prints rep for a person: one section per hop of the intent's
// path, times with their age, and what deserves attention at the end.
func writeKeyReport(w io.Writer, rep *ops.KeyReport) {
	p := &printer{w: w, now: rep.AsOf}
	scope := "no scope"
	if rep.Scope != "" {
		scope = fmt.Sprintf("scope %q; past the ingress the key is %q", rep.Scope, rep.ScopedKey)
	}
	p.line(0, "key %q (%s)", rep.Key, scope)
	p.line(0, "as of %s", rep.AsOf.UTC().Format(timeLayout))

	if !rep.Known {
		p.line(0, "")
		p.line(0, "Nothing is known about this key: no request record, outbox message, inbox claim, dead letter or application row.")
		if len(rep.OtherScopes) > 0 {
			var names []string
			for _, s := range rep.OtherScopes {
				if s == "" {
					names = append(names, "no scope")
				} else {
					names = append(names, fmt.Sprintf("%q", s))
				}
			}
			p.line(0, "The key is known in other scopes: %s. Did you mean --scope?", strings.Join(names, ", "))
		}
		p.line(0, "Never sent, mistyped, or older than its key lifetime (expired records are collected).")
		return
	}

	p.section("HTTP request")
	if f := rep.InFlight; f != nil {
		since := "its start is not visible to this role"
		if f.Since != nil {
			since = "running since " + p.time(*f.Since)
		}
		p.line(1, "in flight now: backend pid %d, %s; %s waiting; its record is written when it commits", f.PID, since, plural(int(f.Waiting), "duplicate"))
	}
	switch q := rep.Request; {
	case q == nil && rep.InFlight != nil:
		// Its record comes with its commit.
	case q == nil:
		p.line(1, "none (the messages were enqueued without the HTTP ingress, or the record expired)")
	default:
		code := "no response yet"
		if q.ResponseCode != nil {
			code = fmt.Sprintf("%d", *q.ResponseCode)
		}
		p.line(1, "%s %s -> %s, %s", q.Method, q.Path, code, q.Status)
		p.field("created", p.time(q.CreatedAt))
		p.field("expires", p.time(q.ExpiresAt))
		p.field("fingerprint", short(q.Fingerprint))
		if q.ResponseBody != nil {
			p.field("response", clip(q.ResponseBody.String()))
		}
	}

	p.section(fmt.Sprintf("outbox (%s)", plural(len(rep.Outbox), "message")))
	for _, m := range rep.Outbox {
		p.line(1, "#%d %s: %s", m.ID, m.Subject, m.Summary())
		p.field("msg_id", fmt.Sprintf("%q", m.MsgID))
		p.field("created", p.time(m.CreatedAt))
		if m.PublishedAt != nil {
			where := ""
			if m.Stream != nil && m.StreamSeq != nil {
				where = fmt.Sprintf(" into %s at sequence %d", *m.Stream, *m.StreamSeq)
			}
			p.field("published", p.time(*m.PublishedAt)+where+", "+plural(m.Attempts, "attempt"))
		}
		if m.CompletedAt != nil {
			p.field("complete", p.time(*m.CompletedAt)+": every consumer that reads it settled it")
		}
		if m.LastError != nil {
			p.field("last_error", *m.LastError)
		}
		p.field("payload", clip(m.Payload.String()))
	}

	p.section(fmt.Sprintf("inbox (%s)", plural(len(rep.Inbox), "consumer")))
	for _, in := range rep.Inbox {
		p.line(1, "%s: %s", in.Consumer, in.Status)
		p.field("created", p.time(in.CreatedAt))
		if in.CompletedAt != nil {
			p.field("completed", p.time(*in.CompletedAt))
		}
		if in.LeaseUntil != nil {
			p.field("lease_until", fmt.Sprintf("%s, %s", p.time(*in.LeaseUntil), plural(in.LeaseAttempts, "acquisition")))
		}
		if in.Step != nil {
			p.field("step", *in.Step)
		}
		p.field("expires", p.time(in.ExpiresAt))
		if in.Result != nil {
			p.field("result", clip(in.Result.String()))
		}
	}

	p.section(fmt.Sprintf("dead letters (%d)", len(rep.DeadLetters)))
	for _, d := range rep.DeadLetters {
		replayed := "not replayed"
		if d.ReplayedAt != nil {
			replayed = "replayed " + p.time(*d.ReplayedAt)
		}
		p.line(1, "#%d %s on %s after %s: %s", d.ID, d.Consumer, d.Subject, plural(d.Deliveries, "delivery"), replayed)
		p.field("reason", d.Reason)
		p.field("created", p.time(d.CreatedAt))
	}

	p.section("application rows")
	writeEffectRows(p, rep.Effects.Tables)

	// idem's own notes first, then the application's (its double effects).
	if notes := append(attention(rep), rep.Effects.Attention...); len(notes) > 0 {
		p.section("attention")
		for _, n := range notes {
			p.line(1, "! %s", n)
		}
	}
}

// writeEffectRows prints the application's rows, one line per row: the table's
// name, then column=value for each column.
func writeEffectRows(p *printer, tables []ops.EffectTable) {
	width := 0
	for _, t := range tables {
		if len(t.Rows) > 0 {
			width = max(width, len(t.Name))
		}
	}
	if width == 0 {
		p.line(1, "none")
		return
	}
	for _, t := range tables {
		for _, row := range t.Rows {
			cells := make([]string, len(row))
			for i, v := range row {
				name := fmt.Sprintf("col%d", i+1)
				if i < len(t.Columns) {
					name = t.Columns[i]
				}
				cells[i] = name + "=" + cellValue(v)
			}
			p.line(1, "%-*s  %s", width, t.Name, strings.Join(cells, " "))
		}
	}
}

// cellValue shows one value on a line of column=value pairs: bare when it is one
// plain word, quoted otherwise, so the pairs stay apart.
func cellValue(v string) string {
	v = clip(v)
	if v == "" || strings.ContainsAny(v, " \t\"=") || strings.ContainsFunc(v, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
		return strconv.Quote(v)
	}
	return v
}

// attention lists what an operator should look at in idem's rows: anything that is
// not the quiet end state of an intent (everything published and claimed). The
// application adds its own notes (refapp.InspectEffects: double effects).
func attention(rep *ops.KeyReport) []string {
	var notes []string
	if q := rep.Request; q != nil && q.Status != "done" {
		notes = append(notes, "the request has not finished: still running, or its worker died and a retry will take the key over")
	}
	for _, m := range rep.Outbox {
		switch {
		case m.PublishedAt == nil && m.DeadLetteredAt == nil:
			n := fmt.Sprintf("outbox #%d waits to be published since %s: is the relay running?", m.ID, human(rep.AsOf.Sub(m.CreatedAt)))
			if m.LastError != nil {
				n += " last error: " + *m.LastError
			}
			notes = append(notes, n)
		case m.AlertedAt != nil:
			notes = append(notes, fmt.Sprintf("outbox #%d was published but never settled by every consumer before its horizon: see its dead letters", m.ID))
		case m.CompletedAt == nil && m.DeadLetteredAt == nil:
			var waiting []string
			for _, d := range m.Deliveries {
				if d.State == ops.DeliveryNotYet || d.State == ops.DeliveryInProgress {
					waiting = append(waiting, d.Consumer)
				}
			}
			if len(waiting) > 0 {
				notes = append(notes, fmt.Sprintf("outbox #%d is published but not yet settled by %s: is that consumer running? (the reconciler re-drives it if the stream lost it)",
					m.ID, strings.Join(waiting, ", ")))
			} else if len(m.Deliveries) == 0 {
				notes = append(notes, fmt.Sprintf("outbox #%d: no registered consumer reads %s", m.ID, m.Subject))
			}
		}
	}
	for _, in := range rep.Inbox {
		if in.Status == "leased" && in.LeaseUntil != nil && in.LeaseUntil.Before(rep.AsOf) {
			notes = append(notes, fmt.Sprintf("%s's lease ran out: its worker died mid-effect; the next delivery takes it over at step %s",
				in.Consumer, deref(in.Step, "(none)")))
		}
	}
	for _, d := range rep.DeadLetters {
		if d.ReplayedAt == nil {
			notes = append(notes, fmt.Sprintf("dead letter #%d is not replayed: fix the cause, then `worker dead-letters replay %d`", d.ID, d.ID))
		}
	}
	return notes
}

const timeLayout = "2006-01-02 15:04:05.000Z"

// printer writes indented lines and formats times relative to the snapshot.
type printer struct {
	w   io.Writer
	now time.Time
}

func (p *printer) line(indent int, format string, args ...any) {
	fmt.Fprintf(p.w, "%s%s\n", strings.Repeat("  ", indent), fmt.Sprintf(format, args...))
}

func (p *printer) section(title string) {
	fmt.Fprintf(p.w, "\n%s\n", title)
}

func (p *printer) field(label, value string) {
	fmt.Fprintf(p.w, "      %-12s %s\n", label, value)
}

// time shows a timestamp in UTC with how long ago (or how far ahead) it is.
func (p *printer) time(t time.Time) string {
	d := p.now.Sub(t)
	rel := human(d) + " ago"
	if d < 0 {
		rel = "in " + human(-d)
	}
	return fmt.Sprintf("%s (%s)", t.UTC().Format(timeLayout), rel)
}

// human rounds a duration to what a person reads at a glance: 850ms, 42s, 3m12s,
// 5h, 5h3m, 3d4h.
func human(d time.Duration) string {
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	case d < 48*time.Hour:
		d = d.Round(time.Minute)
		h, m := d/time.Hour, (d%time.Hour)/time.Minute
		if m == 0 {
			return fmt.Sprintf("%dh", h)
		}
		return fmt.Sprintf("%dh%dm", h, m)
	}
	d = d.Round(time.Hour)
	return fmt.Sprintf("%dd%dh", d/(24*time.Hour), (d%(24*time.Hour))/time.Hour)
}

func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	if strings.HasSuffix(noun, "y") {
		return fmt.Sprintf("%d %sies", n, strings.TrimSuffix(noun, "y"))
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// short shows the first 8 bytes of a hex fingerprint: enough to compare by eye.
func short(hex string) string {
	if len(hex) > 16 {
		return hex[:16] + "..."
	}
	return hex
}

// clip keeps long payloads to one readable line; --json has them whole.
func clip(s string) string {
	const limit = 200
	s = strings.NewReplacer("\r", `\r`, "\n", `\n`).Replace(s)
	if len(s) > limit {
		return strings.ToValidUTF8(s[:limit], "") + fmt.Sprintf("... (%d bytes; --json shows all)", len(s))
	}
	return s
}

func deref(s *string, def string) string {
	if s == nil {
		return def
	}
	return *s
}
