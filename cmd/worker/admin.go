package main

// The operator subcommands that change or probe state: migrate, dead-letters,
// healthcheck. inspect.go and stats.go read.

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/internal/app/refapp"
)

func openPool(ctx context.Context, o *options) (*pgxpool.Pool, error) {
	pool, err := pgxpool.New(ctx, o.databaseURL)
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

func runMigrate(args []string, stdout, stderr io.Writer) error {
	var print, asJSON bool
	o, fs, rest, err := parseOps("worker migrate", migrateUsage, args, stderr, func(fs *flag.FlagSet) {
		fs.BoolVar(&print, "print", false, "write the SQL to stdout instead of applying it")
		fs.BoolVar(&asJSON, "json", false, "print what was applied as JSON")
	})
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return usagef("migrate: unexpected arguments %q", rest)
	}
	if print && asJSON {
		return usagef("migrate: --print writes SQL, not JSON: give one of --print and --json")
	}
	if err := pgschema.Validate(o.schema); err != nil {
		return usagef("migrate: --schema: %w", err)
	}
	if print {
		sql, err := migrations.SQL(migrations.Config{Schema: o.schema})
		if err != nil {
			return err
		}
		fmt.Fprint(stdout, sql)
		fmt.Fprintf(stdout, "\n-- The reference application's tables.\n%s", refapp.SchemaSQL)
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, o, fs)
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := migrations.Apply(ctx, pool, migrations.Config{Schema: o.schema})
	if err != nil {
		return err
	}
	if err := refapp.Migrate(ctx, pool); err != nil {
		return err
	}
	if asJSON {
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

flags:
`

// deadLetterFilter is the selection flags of both subcommands.
type deadLetterFilter struct {
	f     consumer.Filter
	limit int
	set   []string // the selecting flags given, for messages
}

func (d *deadLetterFilter) register(fs *flag.FlagSet, defaultLimit int) {
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

func runDeadLetters(args []string, stdout, stderr io.Writer) error {
	// Flags may precede list or replay: find it the way run finds the subcommand.
	known, _ := newFlagSet("worker dead-letters", io.Discard)
	new(deadLetterFilter).register(known, 0)
	sub, args := splitCommand(args, known, []string{"list", "replay"})
	switch sub {
	case "":
		if slices.ContainsFunc(args, func(a string) bool { return a == "-h" || a == "-help" || a == "--help" }) {
			fmt.Fprint(stderr, deadLettersUsage)
			return flag.ErrHelp
		}
		return usagef("dead-letters: want list or replay (see worker dead-letters -h)")
	case "list", "replay":
	default:
		return usagef("dead-letters: unknown subcommand %q (want list or replay)", sub)
	}
	var (
		sel         deadLetterFilter
		asJSON, all bool
		opts        consumer.ReplayOptions
	)
	o, fs, rest, err := parseOps("worker dead-letters "+sub, deadLettersUsage, args, stderr, func(fs *flag.FlagSet) {
		if sub == "list" {
			sel.register(fs, 100)
			fs.BoolVar(&asJSON, "json", false, "print JSON lines instead of a table")
			return
		}
		sel.register(fs, 0)
		fs.BoolVar(&asJSON, "json", false, "accepted for symmetry: replay always prints JSON lines")
		fs.BoolVar(&all, "all", false, "replay every dead letter not yet replayed")
		fs.BoolVar(&opts.DryRun, "dry-run", false, "write nothing: print what would be replayed and what refused")
		fs.BoolVar(&opts.Force, "force", false, "replay dead letters past (or with an unknown) replay horizon; may run an effect twice if the consumer had completed this key before")
	})
	if err != nil {
		return err
	}
	if sel.limit < 0 {
		return usagef("dead-letters %s: --limit must not be negative", sub)
	}
	sel.f.Limit = sel.limit
	id := int64(0)
	switch {
	case sub == "list" && len(rest) > 0:
		return usagef("dead-letters list: unexpected arguments %q", rest)
	case sub == "replay" && len(rest) > 1:
		return usagef("dead-letters replay: want at most one ID, got %q", rest)
	case sub == "replay" && len(rest) == 1:
		if id, err = strconv.ParseInt(rest[0], 10, 64); err != nil || id <= 0 {
			return usagef("dead-letters replay: bad ID %q", rest[0])
		}
		if all || len(sel.set) > 0 || sel.f.IncludeReplayed || sel.limit != 0 {
			return usagef("dead-letters replay: give an ID or a selection (filters, --all), not both")
		}
	case sub == "replay" && all && len(sel.set) > 0:
		return usagef("dead-letters replay: --all selects every dead letter; drop it to replay only what %s select", strings.Join(sel.set, ", "))
	case sub == "replay" && !all && len(sel.set) == 0:
		return usagef("dead-letters replay: want an ID, a filter (--consumer, --reason, --since, --until) or --all")
	}

	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, o, fs)
	if err != nil {
		return err
	}
	defer pool.Close()
	dls, err := consumer.NewDeadLetters(pool, o.schema)
	if err != nil {
		return err
	}
	switch {
	case sub == "list":
		return listDeadLetters(ctx, dls, sel.f, asJSON, stdout, stderr)
	case id > 0:
		return replayDeadLetter(ctx, dls, id, opts, stdout, stderr)
	default:
		rep, err := dls.Replay(ctx, sel.f, opts)
		if werr := writeReplayReport(rep, opts, stdout, stderr); err == nil {
			err = werr
		}
		return err
	}
}

func listDeadLetters(ctx context.Context, dls *consumer.DeadLetters, f consumer.Filter, asJSON bool, stdout, stderr io.Writer) error {
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
func replayState(dl consumer.DeadLetter, now time.Time) string {
	var s string
	_, _, keyErr := idem.ParseScopedKey(dl.Key)
	switch {
	case keyErr != nil:
		s = "never (no valid key)"
	case dl.Consumer == outbox.RelayConsumer:
		s = "any time (never published)"
	case dl.InboxExpiresAt == nil:
		s = "horizon unknown (--force)"
	case dl.InboxExpiresAt.After(now):
		s = "for " + human(dl.InboxExpiresAt.Sub(now))
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
func replayDeadLetter(ctx context.Context, dls *consumer.DeadLetters, id int64, opts consumer.ReplayOptions, stdout, stderr io.Writer) error {
	res, err := dls.ReplayID(ctx, id, opts)
	if err != nil && !errors.Is(err, consumer.ErrReplayRefused) {
		return err
	}
	return writeReplayReport(consumer.ReplayReport{Results: []consumer.ReplayResult{res}}, opts, stdout, stderr)
}

// writeReplayReport prints one JSON line per dead letter and the summary; an
// error when any was refused, for the exit status.
func writeReplayReport(rep consumer.ReplayReport, opts consumer.ReplayOptions, stdout, stderr io.Writer) error {
	enc := json.NewEncoder(stdout)
	for _, r := range rep.Results {
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	refused := rep.Count(consumer.ActionRefused)
	switch {
	case len(rep.Results) == 0:
		fmt.Fprintln(stderr, "no dead letters selected")
	case opts.DryRun:
		fmt.Fprintf(stderr, "dry run: would replay %d, would refuse %d; nothing was written\n", rep.Count(consumer.ActionWouldReplay), refused)
	default:
		replayed := rep.Count(consumer.ActionReplayed)
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

// runHealthcheck asks a running worker's /readyz; for container health checks,
// where the image has no curl.
func runHealthcheck(args []string, stdout, stderr io.Writer) error {
	var asJSON bool
	o, _, rest, err := parseOps("worker healthcheck", healthcheckUsage, args, stderr, func(fs *flag.FlagSet) {
		fs.BoolVar(&asJSON, "json", false, "print the status as JSON")
	})
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return usagef("healthcheck: unexpected arguments %q", rest)
	}
	st := healthStatus{URL: "http://" + o.httpAddr + "/readyz"}
	err = checkReady(&st)
	if asJSON {
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
