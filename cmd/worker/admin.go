package main

// The operator subcommands that change or probe state: migrate, dead-letters,
// healthcheck. inspect.go and stats.go read.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/deadletter"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/outbox"
)

func openPool(ctx context.Context, url string) (*pgxpool.Pool, error) {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("database: no Postgres answers: %w", err)
	}
	return pool, nil
}

const migrateUsage = `usage: worker migrate [--print | --json] [flags]

Applies idem's schema and the application's tables, or with --print writes their
SQL (for goose, atlas or psql) without connecting. With --json it prints what it
applied as one JSON document, {"applied":["..."]} (empty when up to date).

Exit status: 0 ok, 1 error, 2 usage error.

flags:
`

// migrateOptions are the flags and arguments of worker migrate.
type migrateOptions struct {
	db            dbOptions
	print, asJSON bool
}

func (o *migrateOptions) flags(fs *flagSet) {
	o.db.flags(fs)
	fs.BoolVar(&o.print, "print", false, "write the SQL to stdout instead of applying it")
	fs.BoolVar(&o.asJSON, "json", false, "print what was applied as JSON")
}

func (o *migrateOptions) validate(args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("migrate: unexpected arguments %q", args)
	}
	if o.print && o.asJSON {
		return errors.New("migrate: --print writes SQL, not JSON: give one of --print and --json")
	}
	if err := pgschema.Validate(o.db.schema); err != nil {
		return fmt.Errorf("migrate: --schema: %w", err)
	}
	return nil
}

func runMigrate(o *migrateOptions, stdout, _ io.Writer) error {
	if o.print {
		sql, err := migrations.SQL(migrations.Config{Schema: o.db.schema})
		if err != nil {
			return err
		}
		fmt.Fprint(stdout, sql)
		fmt.Fprintf(stdout, "\n-- The reference application's tables.\n%s", refapp.SchemaSQL)
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, &o.db)
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := migrations.Apply(ctx, pool, migrations.Config{Schema: o.db.schema})
	if err != nil {
		return err
	}
	if err := refapp.Migrate(ctx, pool); err != nil {
		return err
	}
	if o.asJSON {
		names := make([]string, len(applied))
		for i, a := range applied {
			names[i] = fmt.Sprint(a)
		}
		return json.NewEncoder(stdout).Encode(struct {
			Applied []string `json:"applied"`
		}{names})
	}
	if len(applied) == 0 {
		fmt.Fprintln(stdout, "schema is up to date")
	}
	for _, a := range applied {
		fmt.Fprintln(stdout, "applied", a)
	}
	return nil
}

const deadLettersUsage = `usage:
  worker dead-letters list [--consumer C] [--reason PREFIX] [--since T] [--until T]
                           [--include-replayed] [--limit N] [--json] [flags]
  worker dead-letters replay (ID | --consumer C --reason PREFIX --since T ... | --all)
                           [--dry-run] [--force] [--json] [flags]

list prints dead letters not yet replayed (with --include-replayed, all), newest
first: a table, or JSON lines with --json (payloads whole).

replay puts dead letters back on their way: ID alone, every one the filters select,
or with --all every one not yet replayed. Each is written to the outbox with its
original key, addressed to the consumer that dead-lettered it (Idem-Replay-For: the
other consumers of the subject skip it), and published by the running relay. It
prints one JSON line per dead letter (id, consumer, key, action: replayed,
would-replay or refused, and the reason of a refusal) and a summary on stderr; its
output is JSON with or without --json (accepted for symmetry with list). The
filters select in bulk: --consumer, --reason (a prefix), --since and --until,
combined; --dry-run writes nothing and reports what would be replayed or refused.

A dead letter is refused when its consumer's inbox may have forgotten the key: past
its replay horizon, or filed before schema v3 with no horizon recorded. Replaying
it could run an effect twice. --force replays it anyway: it may run an effect twice
if the consumer had completed this key before. A dead letter without a valid key is
always refused: fix its producer instead.

T is a duration back from now (24h, 90m) or an RFC 3339 time. Flags may follow the
arguments.

Exit status: 0 ok; 1 an error, or (replay) some dead letter was refused; 2 a usage
error (unknown flag, bad flag value, a wrong combination of ID, filters and --all).
`

// deadLetterFilter is the selection flags of both subcommands.
type deadLetterFilter struct {
	f     deadletter.Filter
	limit int
	set   []string // the selecting flags given, for messages
}

func (d *deadLetterFilter) register(fs *flagSet, defaultLimit int) {
	fs.Func("consumer", "only the dead letters of consumer `C`", func(v string) error {
		d.f.Consumer = v
		d.set = append(d.set, "--consumer")
		return nil
	})
	fs.Func("reason", "only dead letters whose reason starts with `PREFIX`", func(v string) error {
		d.f.ReasonPrefix = v
		d.set = append(d.set, "--reason")
		return nil
	})
	fs.Func("since", "only dead letters filed at or after `T` (a duration ago, or RFC 3339)", func(v string) (err error) {
		d.f.Since, err = parseSince(v, time.Now())
		d.set = append(d.set, "--since")
		return err
	})
	fs.Func("until", "only dead letters filed before `T` (a duration ago, or RFC 3339)", func(v string) (err error) {
		d.f.Until, err = parseSince(v, time.Now())
		d.set = append(d.set, "--until")
		return err
	})
	fs.BoolVar(&d.f.IncludeReplayed, "include-replayed", false, "also dead letters replayed before")
	fs.IntVar(&d.limit, "limit", defaultLimit, "at most `N` dead letters (0: no limit)")
}

// validate checks the selection of dead-letters sub (list or replay).
func (d *deadLetterFilter) validate(sub string) error {
	if d.limit < 0 {
		return fmt.Errorf("dead-letters %s: --limit must not be negative", sub)
	}
	d.f.Limit = d.limit
	return nil
}

// parseSince reads a time flag: a duration back from now, or an RFC 3339 time.
func parseSince(v string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(v); err == nil {
		if d < 0 {
			return time.Time{}, fmt.Errorf("want a duration back from now such as 24h, not %q", v)
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, v)
	if err != nil {
		return time.Time{}, fmt.Errorf("want a duration such as 24h or an RFC 3339 time such as 2025-01-31T12:00:00Z, not %q", v)
	}
	return t, nil
}

// deadLettersListOptions are the flags of worker dead-letters list.
type deadLettersListOptions struct {
	db     dbOptions
	sel    deadLetterFilter
	asJSON bool
}

func (o *deadLettersListOptions) flags(fs *flagSet) {
	o.db.flags(fs)
	o.sel.register(fs, 100)
	fs.BoolVar(&o.asJSON, "json", false, "print JSON lines instead of a table")
}

func (o *deadLettersListOptions) validate(args []string) error {
	if err := o.sel.validate("list"); err != nil {
		return err
	}
	if len(args) > 0 {
		return fmt.Errorf("dead-letters list: unexpected arguments %q", args)
	}
	return nil
}

func runDeadLettersList(o *deadLettersListOptions, stdout, stderr io.Writer) error {
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	dls, done, err := openDeadLetters(ctx, &o.db)
	if err != nil {
		return err
	}
	defer done()
	return listDeadLetters(ctx, dls, o.sel.f, o.asJSON, stdout, stderr)
}

// deadLettersReplayOptions are the flags and arguments of worker dead-letters
// replay.
type deadLettersReplayOptions struct {
	db          dbOptions
	sel         deadLetterFilter
	asJSON, all bool
	opts        deadletter.ReplayOptions
	id          int64 // 0: the selection
}

func (o *deadLettersReplayOptions) flags(fs *flagSet) {
	o.db.flags(fs)
	o.sel.register(fs, 0)
	fs.BoolVar(&o.asJSON, "json", false, "accepted for symmetry: replay always prints JSON lines")
	fs.BoolVar(&o.all, "all", false, "replay every dead letter not yet replayed")
	fs.BoolVar(&o.opts.DryRun, "dry-run", false, "write nothing: print what would be replayed and what refused")
	fs.BoolVar(&o.opts.Force, "force", false, "replay dead letters past (or with an unknown) replay horizon; may run an effect twice if the consumer had completed this key before")
}

func (o *deadLettersReplayOptions) validate(args []string) error {
	if err := o.sel.validate("replay"); err != nil {
		return err
	}
	switch {
	case len(args) > 1:
		return fmt.Errorf("dead-letters replay: want at most one ID, got %q", args)
	case len(args) == 1:
		id, err := strconv.ParseInt(args[0], 10, 64)
		if err != nil || id <= 0 {
			return fmt.Errorf("dead-letters replay: bad ID %q", args[0])
		}
		if o.all || len(o.sel.set) > 0 || o.sel.f.IncludeReplayed || o.sel.limit != 0 {
			return errors.New("dead-letters replay: give an ID or a selection (filters, --all), not both")
		}
		o.id = id
	case o.all && len(o.sel.set) > 0:
		return fmt.Errorf("dead-letters replay: --all selects every dead letter; drop it to replay only what %s select", strings.Join(o.sel.set, ", "))
	case !o.all && len(o.sel.set) == 0:
		return errors.New("dead-letters replay: want an ID, a filter (--consumer, --reason, --since, --until) or --all")
	}
	return nil
}

func runDeadLettersReplay(o *deadLettersReplayOptions, stdout, stderr io.Writer) error {
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	dls, done, err := openDeadLetters(ctx, &o.db)
	if err != nil {
		return err
	}
	defer done()
	if o.id > 0 {
		return replayDeadLetter(ctx, dls, o.id, o.opts, stdout, stderr)
	}
	rep, err := dls.Replay(ctx, o.sel.f, o.opts)
	if werr := writeReplayReport(rep, o.opts, stdout, stderr); err == nil {
		err = werr
	}
	return err
}

// openDeadLetters opens the database of d for the dead-letter commands.
func openDeadLetters(ctx context.Context, d *dbOptions) (*deadletter.Queue, func(), error) {
	pool, err := openOpsPool(ctx, d)
	if err != nil {
		return nil, nil, err
	}
	// The dead letters need no broker: a replay goes through the outbox, which the
	// running workers' relays publish. A dead letter's subject was a stream's
	// once, whichever stream that was: the outbox takes any subject back.
	cfg := refapp.Config{Schema: d.schema}.InstallConfig()
	cfg.Stream.Subjects = []string{">"}
	inst, err := install.New(pool, nil, cfg)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return deadletter.New(inst), pool.Close, nil
}

func listDeadLetters(ctx context.Context, dls *deadletter.Queue, f deadletter.Filter, asJSON bool, stdout, stderr io.Writer) error {
	list, err := dls.Find(ctx, f)
	if err != nil {
		return err
	}
	if asJSON {
		enc := json.NewEncoder(stdout)
		for _, dl := range list {
			if err := enc.Encode(dl); err != nil {
				return err
			}
		}
	} else {
		tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tFILED\tCONSUMER\tKEY\tDELIVERIES\tREPLAY\tREASON")
		now := time.Now()
		for _, dl := range list {
			fmt.Fprintf(tw, "%d\t%s ago\t%s\t%q\t%d\t%s\t%s\n", dl.ID, human(now.Sub(dl.CreatedAt)), dl.Consumer, dl.Key, dl.Deliveries,
				replayState(dl, now), strings.ReplaceAll(dl.Reason, "\n", " "))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	more := ""
	if f.Limit > 0 && len(list) == f.Limit {
		more = " (--limit reached; there may be more)"
	}
	fmt.Fprintf(stderr, "%s%s\n", plural(len(list), "dead letter"), more)
	return nil
}

// replayState says whether dl may be replayed now, for the table.
func replayState(dl deadletter.Letter, now time.Time) string {
	var s string
	_, _, keyErr := idem.ParseScopedKey(dl.Key)
	switch {
	case keyErr != nil:
		s = "never (no valid key)"
	case dl.Consumer == outbox.RelayConsumer:
		s = "any time (never published)"
	case dl.ReplayBy == nil:
		s = "horizon unknown (--force)"
	case dl.ReplayBy.After(now):
		s = "for " + human(dl.ReplayBy.Sub(now))
	default:
		s = "past horizon (--force)"
	}
	if dl.ReplayedAt != nil {
		s = "replayed " + human(now.Sub(*dl.ReplayedAt)) + " ago; " + s
	}
	return s
}

// replayDeadLetter is replay ID: one dead letter, replayed before or not, waiting
// for a replay of it that is running at the same moment.
func replayDeadLetter(ctx context.Context, dls *deadletter.Queue, id int64, opts deadletter.ReplayOptions, stdout, stderr io.Writer) error {
	res, err := dls.ReplayID(ctx, id, opts)
	if err != nil && !errors.Is(err, deadletter.ErrReplayRefused) {
		return err
	}
	return writeReplayReport(deadletter.ReplayReport{Results: []deadletter.ReplayResult{res}}, opts, stdout, stderr)
}

// writeReplayReport prints one JSON line per dead letter and the summary; an
// error when any was refused, for the exit status.
func writeReplayReport(rep deadletter.ReplayReport, opts deadletter.ReplayOptions, stdout, stderr io.Writer) error {
	enc := json.NewEncoder(stdout)
	for _, r := range rep.Results {
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	refused := rep.Count(deadletter.ActionRefused)
	switch {
	case len(rep.Results) == 0:
		fmt.Fprintln(stderr, "no dead letters selected")
	case opts.DryRun:
		fmt.Fprintf(stderr, "dry run: would replay %d, would refuse %d; nothing was written\n", rep.Count(deadletter.ActionWouldReplay), refused)
	default:
		replayed := rep.Count(deadletter.ActionReplayed)
		queued := ""
		if replayed > 0 {
			queued = "; the replays are queued in the outbox for the running relay to publish"
		}
		fmt.Fprintf(stderr, "replayed %d, refused %d%s\n", replayed, refused, queued)
	}
	if refused > 0 {
		return fmt.Errorf("dead-letters replay: %s refused (see the reason on each line; --force replays those past their replay horizon, never those without a key)",
			plural(refused, "dead letter"))
	}
	return nil
}

const healthcheckUsage = `usage: worker healthcheck [--json] [flags]

Asks the worker at --http-addr whether it is ready (GET /readyz); for container
health checks, where the image has no curl. --json prints the answer as one JSON
document: {"ready":bool,"url":"...","http_status":N,"body":"...","error":"..."}.

Exit status: 0 ready; 1 not ready or unreachable; 2 usage error.

flags:
`

// healthStatus is what healthcheck --json prints.
type healthStatus struct {
	Ready      bool   `json:"ready"`
	URL        string `json:"url"`
	HTTPStatus int    `json:"http_status,omitempty"`
	Body       string `json:"body,omitempty"`
	Error      string `json:"error,omitempty"`
}

// healthcheckOptions are the flags of worker healthcheck, which asks a running
// worker's /readyz; for container health checks, where the image has no curl.
type healthcheckOptions struct {
	httpAddr string
	asJSON   bool
}

func (o *healthcheckOptions) flags(fs *flagSet) {
	httpAddrVar(fs, &o.httpAddr)
	fs.BoolVar(&o.asJSON, "json", false, "print the status as JSON")
}

func (o *healthcheckOptions) validate(args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("healthcheck: unexpected arguments %q", args)
	}
	return nil
}

func runHealthcheck(o *healthcheckOptions, stdout, _ io.Writer) error {
	st := healthStatus{URL: "http://" + o.httpAddr + "/readyz"}
	err := checkReady(&st)
	if o.asJSON {
		if st.Error = ""; err != nil {
			st.Error = err.Error()
		}
		if werr := json.NewEncoder(stdout).Encode(st); werr != nil && err == nil {
			err = werr
		}
	}
	return err
}

func checkReady(st *healthStatus) error {
	client := &http.Client{Timeout: 3 * time.Second}
	resp, err := client.Get(st.URL)
	if err != nil {
		return fmt.Errorf("healthcheck: %w", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	st.HTTPStatus, st.Body = resp.StatusCode, strings.TrimSpace(string(body))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("healthcheck: %s: %s", resp.Status, st.Body)
	}
	st.Ready = true
	return nil
}
