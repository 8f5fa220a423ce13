// Command enqueue is the client CLI of idem: it mints an idempotency key for each
// intent, journals it (fsync) before the first send, sends it to the demo service
// and retries with the same key until a final response arrives. After a crash or an
// outage, `enqueue resume` re-sends every pending intent with its own key.
//
// Run `enqueue -h` for the commands, flags, output format and exit codes.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/idemkit/idem/client"
	"github.com/idemkit/idem/internal/buildinfo"
)

// Exit codes, part of the CLI's contract.
const (
	exitDone       = 0 // every intent is done
	exitError      = 1 // usage or I/O error
	exitIncomplete = 2 // some intent ended rejected, pending or expired
)

// summaryThreshold is the number of intents above which resume and list report
// progress and a summary on stderr. Below it the JSON lines speak for themselves.
const summaryThreshold = 20

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// options are the global flags, shared by every command.
type options struct {
	version      bool
	api          string
	journal      string
	scope        string
	dropResponse bool
	forgetKey    bool
	keyLifetime  time.Duration
	timeout      time.Duration
	maxAttempts  int
	lockWait     time.Duration
	verbose      bool
	json         bool // accepted for symmetry with worker: the output is always JSON lines
}

// defaultOptions takes the environment fallbacks; flags override them.
func defaultOptions(getenv func(string) string) options {
	o := options{
		api:         client.DefaultBaseURL,
		journal:     defaultJournalPath(getenv),
		keyLifetime: client.DefaultKeyLifetime,
		timeout:     client.DefaultTimeout,
		maxAttempts: client.DefaultMaxAttempts,
		lockWait:    30 * time.Second,
	}
	if v := getenv("IDEM_API"); v != "" {
		o.api = v
	}
	if v := getenv("IDEM_JOURNAL"); v != "" {
		o.journal = v
	}
	return o
}

// defaultJournalPath follows the XDG base directory spec: a journal is state (it must
// survive restarts but is not configuration), so $XDG_STATE_HOME, else
// ~/.local/state. It returns "" when there is no home directory; opening then fails
// with a message that asks for --journal.
func defaultJournalPath(getenv func(string) string) string {
	if d := getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "idem", "enqueue.journal")
	}
	home := getenv("HOME")
	if home == "" {
		home, _ = os.UserHomeDir()
	}
	if home != "" {
		return filepath.Join(home, ".local", "state", "idem", "enqueue.journal")
	}
	if d, err := os.UserConfigDir(); err == nil {
		return filepath.Join(d, "idem", "enqueue.journal")
	}
	return ""
}

// register adds the global flags to fs. Each flag's default is the current value, so
// registering on a command's flag set after the global parse keeps what was given
// before the command.
func (o *options) register(fs *flag.FlagSet) {
	fs.StringVar(&o.api, "api", o.api, "base `URL` of the idem service (env IDEM_API)")
	fs.StringVar(&o.journal, "journal", o.journal, "journal file `path` (env IDEM_JOURNAL; default $XDG_STATE_HOME/idem/enqueue.journal, else $HOME/.local/state/idem/enqueue.journal); created with its directory if missing")
	fs.StringVar(&o.scope, "scope", o.scope, "Idempotency-Scope (tenant or principal) for new intents")
	fs.BoolVar(&o.dropResponse, "drop-response", o.dropResponse, "fault switch: discard the first response as if the network lost it; the retry reuses the key")
	fs.BoolVar(&o.forgetKey, "forget-key", o.forgetKey, "fault switch: drop the first response AND wipe the key before the retry, so a new key is minted (negative control: a second effect)")
	fs.DurationVar(&o.keyLifetime, "key-lifetime", o.keyLifetime, "how long the client keeps re-sending a pending intent, counted from its creation, before reporting it expired (an expired intent is never re-sent); must be shorter than the server's request key lifetime (48h by default) and the consumers' inbox key lifetime (72h)")
	fs.DurationVar(&o.timeout, "timeout", o.timeout, "timeout of one attempt")
	fs.IntVar(&o.maxAttempts, "max-attempts", o.maxAttempts, "sends per intent in this run before leaving it pending for resume")
	fs.DurationVar(&o.lockWait, "lock-wait", o.lockWait, "how long to wait for another enqueue that holds the journal")
	fs.BoolVar(&o.verbose, "verbose", o.verbose, "log every attempt on stderr")
	fs.BoolVar(&o.version, "version", o.version, "print the version and exit")
	fs.BoolVar(&o.json, "json", o.json, "accepted for symmetry with worker --json: the output is always JSON lines")
}

const usageText = `usage: enqueue [flags] <command> [command flags] [flags]

Sends intents to the idem demo service so each takes effect once. Every intent gets
an idempotency key minted here and written to the journal (fsync) before the first
send; every retry, and every later 'enqueue resume', reuses that key.

Commands:
  charge --account A --amount-cents N       POST /v1/payments {"account","amount_cents"}
  email --to T --subject S [--body B]       POST /v1/emails {"to","subject","body"}
  resume                                    re-send every pending intent with its own key
  list                                      print every intent in the journal
  prune [--older-than D]                    drop finished intents older than D (default 168h)

Output: one JSON line per intent on stdout,
  {"key":"...","attempts":N,"status":"...","http_status":N,"response":{...}}
where status is done (a response was received and recorded), pending (not yet;
resume will re-send it with the same key), rejected (a final 4xx) or expired (older
than --key-lifetime, or dated in the future because the clock was set back; never
re-sent, reconcile it by hand). Two fields appear only when they apply:
"truncated":true (the response body was cut at 1 MiB; the intent is done) and
"error":"..." (why an intent expired, or why it is pending after a redirect, which
is never followed: fix --api, then resume). With more than 20 intents, resume and
list also report progress and a summary on stderr.

Environment:
  IDEM_API        the default of --api
  IDEM_JOURNAL    the default of --journal
  XDG_STATE_HOME  with HOME, where the journal is by default (see --journal)

Exit status:
  0  every intent is done
  1  usage error (unknown command or flag, a bad or missing flag value, an extra
     argument) or I/O error (the journal)
  2  some intent ended rejected, pending or expired (see its line's status)

Flags (before or after the command):
`

// run is the whole program, minus the process: arguments, environment and output
// streams come in, the exit code goes out.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	o := defaultOptions(getenv)
	root := flag.NewFlagSet("enqueue", flag.ContinueOnError)
	root.SetOutput(stderr)
	o.register(root)
	root.Usage = func() {
		fmt.Fprint(stderr, usageText)
		root.PrintDefaults()
	}
	if err := root.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitDone
		}
		return exitError
	}
	if o.version {
		fmt.Fprintln(stdout, buildinfo.Read())
		return exitDone
	}
	if root.NArg() == 0 {
		root.Usage()
		fmt.Fprintln(stderr, "\nenqueue: missing command")
		return exitError
	}
	cmd, rest := root.Arg(0), root.Args()[1:]

	fs := flag.NewFlagSet("enqueue "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usageText)
		fs.PrintDefaults() // the command's own flags, alphabetically among the global ones
	}
	o.register(fs)
	var (
		account                 string
		amountCents             int64
		emailTo, subject, body  string
		commandFlagsDescription string
		olderThan               time.Duration
	)
	switch cmd {
	case "charge":
		fs.StringVar(&account, "account", "", "account to charge (required)")
		fs.Int64Var(&amountCents, "amount-cents", 0, "amount in cents, > 0 (required)")
		commandFlagsDescription = "--account A --amount-cents N"
	case "email":
		fs.StringVar(&emailTo, "to", "", "recipient (required)")
		fs.StringVar(&subject, "subject", "", "subject (required)")
		fs.StringVar(&body, "body", "", "body")
		commandFlagsDescription = "--to T --subject S [--body B]"
	case "prune":
		fs.DurationVar(&olderThan, "older-than", 7*24*time.Hour, "prune finished intents whose response arrived longer ago than this")
	case "resume", "list":
	default:
		fmt.Fprintf(stderr, "enqueue: unknown command %q (want charge, email, resume, list or prune; see enqueue -h)\n", cmd)
		return exitError
	}
	if err := fs.Parse(rest); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitDone
		}
		return exitError
	}
	if o.version {
		fmt.Fprintln(stdout, buildinfo.Read())
		return exitDone
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "enqueue %s: unexpected argument %q\n", cmd, fs.Arg(0))
		return exitError
	}
	if err := o.validate(cmd); err != nil {
		fmt.Fprintf(stderr, "enqueue %s: %v\n", cmd, err)
		return exitError
	}
	if olderThan < 0 {
		fmt.Fprintf(stderr, "enqueue prune: --older-than must not be negative, got %v\n", olderThan)
		return exitError
	}

	var payload []byte
	var path string
	switch cmd {
	case "charge":
		if account == "" || amountCents <= 0 {
			fmt.Fprintf(stderr, "enqueue charge: need %s with a non-empty account and a positive amount\n", commandFlagsDescription)
			return exitError
		}
		path = "/v1/payments"
		payload, _ = json.Marshal(struct {
			Account     string `json:"account"`
			AmountCents int64  `json:"amount_cents"`
		}{account, amountCents})
	case "email":
		if emailTo == "" || subject == "" {
			fmt.Fprintf(stderr, "enqueue email: need %s\n", commandFlagsDescription)
			return exitError
		}
		path = "/v1/emails"
		payload, _ = json.Marshal(struct {
			To      string `json:"to"`
			Subject string `json:"subject"`
			Body    string `json:"body"`
		}{emailTo, subject, body})
	}

	logLevel := slog.LevelWarn
	if o.verbose {
		logLevel = slog.LevelDebug
	}
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: logLevel}))

	journal, err := openJournal(ctx, o)
	if err != nil {
		fmt.Fprintf(stderr, "enqueue %s: %v\n", cmd, err)
		return exitError
	}
	defer journal.Close()
	if n := journal.Torn(); n > 0 {
		// Not an error: the record being written when the last run died never
		// finished its fsync, so that run never sent it.
		logger.Warn("journal had a torn last record (a previous run died mid-write); dropped it", "bytes", n, "journal", journal.Path())
	}

	// The fault switches live in the transport, below the client (see fault.go).
	faults := newFaultTransport(o, journal, logger)
	var httpClient *http.Client // nil: the client's default
	if faults != nil {
		httpClient = &http.Client{Transport: faults}
	}
	c, err := client.New(client.Config{
		Store:       journal,
		BaseURL:     o.api,
		HTTPClient:  httpClient,
		Scope:       o.scope,
		MaxAttempts: o.maxAttempts,
		Timeout:     o.timeout,
		KeyLifetime: o.keyLifetime,
		Logger:      logger,
	})
	if err != nil {
		fmt.Fprintf(stderr, "enqueue %s: %v\n", cmd, err)
		return exitError
	}

	out := json.NewEncoder(stdout)
	switch cmd {
	case "charge", "email":
		return submit(ctx, c, client.Request{Path: path, Body: payload}, faults, out, stderr)
	case "resume":
		return resume(ctx, c, out, stderr)
	case "prune":
		return prune(journal, olderThan, stderr)
	default: // list
		return list(ctx, c, out, stderr)
	}
}

func (o *options) validate(cmd string) error {
	if o.maxAttempts < 1 {
		return fmt.Errorf("--max-attempts must be at least 1, got %d", o.maxAttempts)
	}
	if o.timeout <= 0 || o.keyLifetime <= 0 {
		return errors.New("--timeout and --key-lifetime must be positive")
	}
	if o.lockWait < 0 {
		return errors.New("--lock-wait must not be negative")
	}
	if (o.dropResponse || o.forgetKey) && (cmd == "resume" || cmd == "list" || cmd == "prune") {
		return errors.New("--drop-response and --forget-key apply to new intents (charge, email), not to " + cmd)
	}
	return nil
}

// openJournal opens the journal, waiting up to --lock-wait for another enqueue that
// holds it, so two invocations at once queue rather than fail.
func openJournal(ctx context.Context, o options) (*client.Journal, error) {
	if o.journal == "" {
		return nil, errors.New("no journal path: set --journal or IDEM_JOURNAL (no home directory to default to)")
	}
	ctx, cancel := context.WithTimeout(ctx, o.lockWait)
	defer cancel()
	j, err := client.OpenJournalContext(ctx, o.journal)
	if errors.Is(err, client.ErrJournalLocked) {
		return nil, fmt.Errorf("journal %s is in use by another enqueue (waited %v; see --lock-wait): %w", o.journal, o.lockWait, err)
	}
	return j, err
}

// line is one line of output, exactly the fields of the contract.
type line struct {
	Key        string          `json:"key"`
	Attempts   int             `json:"attempts"`
	Status     string          `json:"status"`
	HTTPStatus int             `json:"http_status"`
	Response   json.RawMessage `json:"response"`
	Truncated  bool            `json:"truncated,omitempty"`
	Error      string          `json:"error,omitempty"`
}

func writeLine(out *json.Encoder, r client.Result) error {
	return out.Encode(line{
		Key:        string(r.Key),
		Attempts:   r.Attempts,
		Status:     string(r.Status),
		HTTPStatus: r.HTTPStatus,
		Response:   r.Response,
		Truncated:  r.Truncated,
		Error:      r.Error,
	})
}

func submit(ctx context.Context, c *client.Client, req client.Request, faults *faultTransport, out *json.Encoder, stderr io.Writer) int {
	res, forgotten, err := submitIntent(ctx, c, req, faults)
	if err != nil && !errors.Is(err, client.ErrStillPending) {
		// The intent could not be journaled (or its result recorded). If it has a
		// key, say so: the journal may still hold it for resume.
		fmt.Fprintf(stderr, "enqueue: %v\n", err)
		if res.Key == "" {
			return exitError
		}
	}
	if forgotten != "" {
		fmt.Fprintf(stderr, "enqueue: --forget-key: key %s was wiped after the first send; the retry went out as a new intent with key %s\n", forgotten, res.Key)
	}
	if werr := writeLine(out, res); werr != nil {
		fmt.Fprintf(stderr, "enqueue: write output: %v\n", werr)
		return exitError
	}
	if err != nil && errors.Is(err, client.ErrStillPending) {
		fmt.Fprintf(stderr, "enqueue: %v\n", err)
		if errors.Is(err, client.ErrRedirected) {
			fmt.Fprintln(stderr, "enqueue: the service URL answers with a redirect; fix --api (or IDEM_API) first")
		}
		fmt.Fprintln(stderr, "enqueue: the intent is journaled; run 'enqueue resume' to send it again with the same key")
	}
	if err != nil && !errors.Is(err, client.ErrStillPending) {
		return exitError
	}
	return exitFor([]client.Result{res})
}

func resume(ctx context.Context, c *client.Client, out *json.Encoder, stderr io.Writer) int {
	var writeErr error
	results, err := c.Resume(ctx, func(done, total int, r client.Result) {
		// Stream the lines as intents finish: a long resume shows its work.
		if werr := writeLine(out, r); werr != nil && writeErr == nil {
			writeErr = werr
		}
		if total > summaryThreshold && (done%10 == 0 || done == total) {
			fmt.Fprintf(stderr, "resume: %d/%d\n", done, total)
		}
	})
	if writeErr != nil {
		fmt.Fprintf(stderr, "enqueue: write output: %v\n", writeErr)
		return exitError
	}
	var expired []string
	for _, r := range results {
		if r.Status == client.IntentExpired {
			expired = append(expired, string(r.Key))
		}
	}
	if len(expired) > 0 {
		fmt.Fprintf(stderr, "resume: skipped %d expired intent(s), older than the key lifetime and never re-sent: %s\n",
			len(expired), strings.Join(expired, " "))
	}
	if len(results) > summaryThreshold {
		fmt.Fprintf(stderr, "resume: %s\n", summarize(results))
	}
	code := exitFor(results)
	// Intents left pending explain themselves in their lines; anything else (the
	// journal failing under us) is an I/O error.
	for _, e := range unjoin(err) {
		if !errors.Is(e, client.ErrStillPending) {
			fmt.Fprintf(stderr, "enqueue resume: %v\n", e)
			code = exitError
		}
	}
	return code
}

// prune drops old finished intents. It prints a count on stderr and nothing on
// stdout: there are no intents to report.
func prune(j *client.Journal, olderThan time.Duration, stderr io.Writer) int {
	n, err := j.Prune(time.Now().Add(-olderThan))
	if err != nil {
		fmt.Fprintf(stderr, "enqueue prune: %v\n", err)
		return exitError
	}
	fmt.Fprintf(stderr, "prune: removed %d finished intent(s) older than %v; pending intents are never pruned\n", n, olderThan)
	return exitDone
}

func list(ctx context.Context, c *client.Client, out *json.Encoder, stderr io.Writer) int {
	results, err := c.List(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "enqueue list: %v\n", err)
		return exitError
	}
	for _, r := range results {
		if err := writeLine(out, r); err != nil {
			fmt.Fprintf(stderr, "enqueue: write output: %v\n", err)
			return exitError
		}
	}
	if len(results) > summaryThreshold {
		fmt.Fprintf(stderr, "list: %s\n", summarize(results))
	}
	return exitFor(results)
}

// summarize counts results per status, in a fixed order: "57 intents: 50 done, ...".
func summarize(results []client.Result) string {
	counts := map[client.IntentStatus]int{}
	for _, r := range results {
		counts[r.Status]++
	}
	parts := []string{}
	for _, s := range []client.IntentStatus{client.IntentDone, client.IntentPending, client.IntentRejected, client.IntentExpired} {
		parts = append(parts, fmt.Sprintf("%d %s", counts[s], s))
	}
	return fmt.Sprintf("%d intents: %s", len(results), strings.Join(parts, ", "))
}

func exitFor(results []client.Result) int {
	for _, r := range results {
		if r.Status != client.IntentDone {
			return exitIncomplete
		}
	}
	return exitDone
}

// unjoin lists the errors inside an errors.Join, or err itself.
func unjoin(err error) []error {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}
