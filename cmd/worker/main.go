// Command worker runs idem's reference application (package refapp): the HTTP
// ingress of its charge and email API, the outbox relay and the consumers, over
// package worker; plus operator subcommands.
//
//	worker [flags]                              run the service
//	worker migrate [--print] [flags]            apply the schema (or print its SQL) and exit
//	worker partition [--convert] [flags]        partition idem_inbox and idem_outbox by day; maintain them
//	worker dead-letters list [filters]          list dead letters
//	worker dead-letters replay ID|filters|--all [--dry-run]
//	                                            put dead letters back on their way
//	worker inspect [--scope S] [flags] KEY      one key's whole life
//	worker stats [--json] [flags]               counts and lags
//	worker healthcheck [--json] [flags]         exit 0 if the worker at --http-addr is ready
//	worker consumers rename OLD NEW [--force]   rename a consumer, keeping its inbox
//
// Flags may come before or after the subcommand. Every shared flag has an
// environment fallback, named in worker -h, which also lists the exit codes (0 ok,
// 1 error, 2 usage error). With NATS_URL empty the
// worker starts an embedded JetStream server whose store lives under --data-dir;
// with no database named at all and none answering at the default URL, it starts a
// private Postgres from the machine's binaries there too. The data dir is
// absolute by default (per user, see runenv.DefaultDataDir), so the operator
// subcommands find a running worker's private Postgres and JetStream server from
// any working directory.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/idemkit/idem/internal/buildinfo"
	"github.com/idemkit/idem/internal/embeddednats"
	"github.com/idemkit/idem/internal/app/runenv"
	"github.com/idemkit/idem/internal/app/tracelog"
	"github.com/idemkit/idem/internal/app/refapp"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// options are the flags shared by every subcommand.
type options struct {
	databaseURL      string
	natsURL          string
	natsAuth         runenv.NATSAuth
	streamReplicas   string
	httpAddr         string
	dataDir          string
	smtpAddr         string // deprecated: smtpURL
	smtpURL          string
	smtpCA           string
	smtpFrom         string
	schema           string
	logFormat        string
	logLevel         string
	shutdownTimeout  time.Duration
	roles            string
	trace            string
	ackWait          time.Duration
	reconcileAfter   string
	groupCommit      string
	noMigrate        bool
	atomicPublish    bool
	metricsAddr      string
	console          bool
	consoleToken     string
	consoleUser      string
	consolePassword  string
	consolePlainHTTP bool
	version          bool
	// The files the secrets may be read from instead (secrets.go).
	consoleTokenFile, consolePasswordFile, natsPasswordFile string
	// envErrs are environment fallbacks that do not parse, reported by runService.
	envErrs []error
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// envBool reads a switch from the environment: set, and not 0 or false, is on.
func envBool(name string) bool {
	v := os.Getenv(name)
	return v != "" && v != "0" && v != "false"
}

func newFlagSet(name string, stderr io.Writer) (*flag.FlagSet, *options) {
	o := &options{}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.databaseURL, "database-url", env("DATABASE_URL", runenv.DefaultDatabaseURL), "Postgres URL (env DATABASE_URL)")
	fs.StringVar(&o.natsURL, "nats-url", env("NATS_URL", ""), "NATS server URL, or a comma-separated list of a cluster's; empty starts an embedded JetStream server (env NATS_URL)")
	fs.StringVar(&o.natsAuth.CredsFile, "nats-creds", env("IDEM_NATS_CREDS", ""), "NATS user credentials file (JWT and seed) (env IDEM_NATS_CREDS)")
	fs.StringVar(&o.natsAuth.NKeyFile, "nats-nkey", env("IDEM_NATS_NKEY", ""), "file holding the NATS user's nkey seed (env IDEM_NATS_NKEY)")
	fs.StringVar(&o.natsAuth.User, "nats-user", env("IDEM_NATS_USER", ""), "NATS user, with --nats-password (env IDEM_NATS_USER)")
	fs.StringVar(&o.natsAuth.Password, "nats-password", env("IDEM_NATS_PASSWORD", ""), "NATS password; as a flag every user of the machine can read it: prefer the env var or --nats-password-file (env IDEM_NATS_PASSWORD)")
	fs.StringVar(&o.natsAuth.CAFile, "nats-ca", env("IDEM_NATS_CA", ""), "PEM file of the CAs that sign the NATS server's certificate (env IDEM_NATS_CA)")
	fs.StringVar(&o.natsAuth.CertFile, "nats-cert", env("IDEM_NATS_CERT", ""), "client certificate for NATS mutual TLS, with --nats-key (env IDEM_NATS_CERT)")
	fs.StringVar(&o.natsAuth.KeyFile, "nats-key", env("IDEM_NATS_KEY", ""), "client key for NATS mutual TLS (env IDEM_NATS_KEY)")
	fs.StringVar(&o.streamReplicas, "stream-replicas", env("IDEM_STREAM_REPLICAS", "1"), "replicas of the stream the worker creates (3 on a three-node JetStream cluster); an existing stream is left as it is, with a warning when it has fewer (env IDEM_STREAM_REPLICAS)")
	fs.StringVar(&o.httpAddr, "http-addr", env("IDEM_HTTP_ADDR", "127.0.0.1:8080"), "HTTP listen address (env IDEM_HTTP_ADDR)")
	fs.StringVar(&o.metricsAddr, "metrics-addr", env("IDEM_METRICS_ADDR", ""), "serve /metrics on this address instead of the HTTP address, e.g. 127.0.0.1:9090 (env IDEM_METRICS_ADDR)")
	fs.BoolVar(&o.console, "console", envBool("IDEM_CONSOLE"),
		"serve the operator console at /console, on the listener of /metrics (env IDEM_CONSOLE)")
	fs.StringVar(&o.consoleToken, "console-token", env("IDEM_CONSOLE_TOKEN", ""), "require this token for the console (Authorization: Bearer, or its login page); as a flag every user of the machine can read it: prefer the env var or --console-token-file (env IDEM_CONSOLE_TOKEN)")
	fs.StringVar(&o.consoleUser, "console-user", env("IDEM_CONSOLE_USER", ""), "require HTTP basic auth for the console with this user (env IDEM_CONSOLE_USER)")
	fs.StringVar(&o.consolePassword, "console-password", env("IDEM_CONSOLE_PASSWORD", ""), "the basic-auth password of --console-user; as a flag every user of the machine can read it: prefer the env var or --console-password-file (env IDEM_CONSOLE_PASSWORD)")
	fs.BoolVar(&o.consolePlainHTTP, "console-allow-plain-http", envBool("IDEM_CONSOLE_ALLOW_PLAIN_HTTP"),
		"serve the console, with its token or password, over plain HTTP on a listener that is not loopback: only when a TLS-terminating proxy, or a network you trust, is the only way to it (env IDEM_CONSOLE_ALLOW_PLAIN_HTTP)")
	registerSecretFiles(fs, o)
	fs.BoolVar(&o.version, "version", false, "print the version and exit")
	fs.StringVar(&o.dataDir, "data-dir", env("IDEM_DATA_DIR", defaultDataDir()), "directory for the embedded JetStream store, the private Postgres, the worker's lock and its database record; "+
		"the operator commands find a running worker's files there (env IDEM_DATA_DIR; default $XDG_STATE_HOME/idem, else ~/.local/state/idem, /var/lib/idem for root)")
	fs.StringVar(&o.smtpURL, "smtp-url", env("IDEM_SMTP_URL", ""), "SMTP server of the email consumer; empty runs none. smtp://[user:password@]host[:port] (default port 587): STARTTLS when offered, "+
		"required with credentials, then AUTH PLAIN or LOGIN (?auth=plain|login picks one); smtps://... (default port 465): implicit TLS; smtp+insecure://host:port: plaintext, "+
		"no STARTTLS, no credentials, for a local sink such as mailpit. User and password are URL-escaped; logs show the URL without its password (env IDEM_SMTP_URL)")
	fs.StringVar(&o.smtpCA, "smtp-ca", env("IDEM_SMTP_CA", ""), "PEM `file` of the CA certificates to trust for --smtp-url's TLS instead of the system roots (env IDEM_SMTP_CA)")
	fs.StringVar(&o.smtpFrom, "smtp-from", env("IDEM_SMTP_FROM", ""), "sender `address` of the emails, envelope and From header (env IDEM_SMTP_FROM; default \"idem <idem@localhost>\")")
	fs.StringVar(&o.smtpAddr, "smtp-addr", env("IDEM_SMTP_ADDR", ""), "deprecated: SMTP server host:port, spoken to in plaintext without AUTH; the same as --smtp-url smtp+insecure://host:port (env IDEM_SMTP_ADDR)")
	fs.StringVar(&o.schema, "schema", env("IDEM_SCHEMA", ""), "Postgres schema of the idem_* tables; empty is public (env IDEM_SCHEMA)")
	fs.StringVar(&o.logFormat, "log-format", env("IDEM_LOG_FORMAT", "text"), "log format: text or json (env IDEM_LOG_FORMAT)")
	fs.StringVar(&o.logLevel, "log-level", env("IDEM_LOG_LEVEL", "info"), "log level: debug, info, warn, error (env IDEM_LOG_LEVEL)")
	shutdownTimeout := 30 * time.Second
	if v := os.Getenv("IDEM_SHUTDOWN_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			o.envErrs = append(o.envErrs, fmt.Errorf("IDEM_SHUTDOWN_TIMEOUT: want a positive duration such as 30s, got %q", v))
		} else {
			shutdownTimeout = d
		}
	}
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", shutdownTimeout, "how long in-flight work may take to finish after SIGTERM (env IDEM_SHUTDOWN_TIMEOUT)")
	fs.StringVar(&o.trace, "trace", env("IDEM_TRACE", ""), "span exporter: none, stderr, or otlp (OTLP/HTTP, configured by the OTEL_EXPORTER_OTLP_* variables; service name OTEL_SERVICE_NAME); empty follows OTEL_TRACES_EXPORTER, else none. Trace context is propagated either way (env IDEM_TRACE)")
	fs.StringVar(&o.roles, "roles", env("IDEM_ROLES", "all"), "components to run: all, or a comma list of ingress,relay,consumers (env IDEM_ROLES)")
	fs.BoolVar(&o.noMigrate, "no-migrate", env("IDEM_NO_MIGRATE", "") != "", "do not apply migrations at start; run `worker migrate` (or its --print SQL) yourself (env IDEM_NO_MIGRATE)")
	fs.Func("ack-wait", "how long JetStream waits for a consumer's ack before redelivering (env IDEM_ACK_WAIT; default 30s)", func(v string) (err error) {
		o.ackWait, err = parseAckWait(v)
		return err
	})
	fs.StringVar(&o.groupCommit, "group-commit", env("IDEM_GROUP_COMMIT", ""), "removed: group commit at the ingress is gone, every request has its own transaction; "+
		"empty or 0 is accepted, any other value is refused (env IDEM_GROUP_COMMIT)")
	fs.BoolVar(&o.atomicPublish, "atomic-publish", env("IDEM_ATOMIC_PUBLISH", "") != "", "the relay publishes each batch as one JetStream atomic batch, one PubAck (and with fsync on every write one fsync) per batch; "+
		"the stream the worker creates allows it; an existing stream that does not makes the relay publish message by message, with a warning; needs nats-server 2.12 or later (env IDEM_ATOMIC_PUBLISH)")
	fs.StringVar(&o.reconcileAfter, "reconcile-after", env("IDEM_RECONCILE_AFTER", ""), "how long a published intent may stay unsettled by a consumer before the reconciler looks for it in the stream and re-drives it if lost; "+
		"off runs the relay without a reconciler (env IDEM_RECONCILE_AFTER; default 5m)")
	return fs, o
}

// parseReconcileAfter reads --reconcile-after: a positive duration, "off", or empty
// for the default.
func parseReconcileAfter(v string) (after time.Duration, off bool, err error) {
	switch v {
	case "":
		return 0, false, nil
	case "off":
		return 0, true, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return 0, false, fmt.Errorf("--reconcile-after: want a positive duration such as 5m, or off; got %q", v)
	}
	return d, false, nil
}

// defaultDataDir is runenv.DefaultDataDir, or empty when there is none (no home
// directory): runenv.Open then says to set --data-dir.
func defaultDataDir() string {
	d, err := runenv.DefaultDataDir()
	if err != nil {
		return ""
	}
	return d
}

// checkGroupCommit refuses --group-commit (IDEM_GROUP_COMMIT) asking for group
// commit, which the ingress does not have: a worker started with it must not run
// as if it were on. Empty or 0 (off) starts.
func checkGroupCommit(v string) error {
	if v == "" || v == "0" {
		return nil
	}
	return fmt.Errorf("--group-commit (IDEM_GROUP_COMMIT) is %q, but group commit was removed from the ingress: "+
		"it let one request's SET LOCAL and session settings leak into the next request's handler. "+
		"Drop the flag or the variable; every request now runs in its own transaction", v)
}

// parseAckWait reads --ack-wait or IDEM_ACK_WAIT.
func parseAckWait(v string) (time.Duration, error) {
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("want a positive duration such as 30s, got %q", v)
	}
	return d, nil
}

func (o *options) logger(w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	hopts := &slog.HandlerOptions{Level: level}
	switch o.logFormat {
	case "text":
		return slog.New(tracelog.New(slog.NewTextHandler(w, hopts))), nil
	case "json":
		return slog.New(tracelog.New(slog.NewJSONHandler(w, hopts))), nil
	}
	return nil, fmt.Errorf("--log-format must be text or json, not %q", o.logFormat)
}

const usage = `usage:
  worker [flags]                       run the service (ingress, relay, consumers)
  worker migrate [--print] [--json] [flags]
                                       apply the schema and exit (--print: write its SQL instead)
  worker partition [--convert] [--json]
                                       list and maintain the day partitions of idem_inbox and
                                       idem_outbox (--convert: partition the plain tables first)
  worker inspect [--scope S] [--json] KEY
                                       print everything known about one key
  worker stats [--json]                counts and lags (outbox backlog, inbox, dead letters)
  worker healthcheck [--json] [flags]  exit 0 if the worker at --http-addr is ready
  worker consumers rename OLD NEW [--force]
                                       rename a stopped consumer, keeping its inbox, attempts and
                                       dead letters; deletes OLD's durable consumer
  worker dead-letters list [--consumer C] [--reason PREFIX] [--since T] [--until T] [--json]
                                       list dead letters (newest first)
  worker dead-letters replay (ID | --consumer C --reason PREFIX --since T --until T | --all) [--dry-run] [--force] [--json]
                                       put dead letters back on their way with their keys, through
                                       the outbox, to the consumer that filed each one; filters select
                                       in bulk, --dry-run writes nothing (see worker dead-letters -h)

Flags may come before or after the subcommand (worker --database-url URL stats, or
worker stats --database-url URL); a subcommand's own flags (--json, --scope, the
dead-letter filters) are best put after it. --json prints JSON: one document for
stats, inspect, healthcheck and migrate, JSON lines for dead-letters list and replay.

Environment: every flag below that names an environment variable falls back to it
when not given. Also read: XDG_STATE_HOME and HOME (the default --data-dir), the
OTEL_* variables of --trace otlp.

Exit status:
  0  success (healthcheck: the worker is ready)
  1  error (inspect: nothing is known about the key; dead-letters replay: a dead
     letter was refused; healthcheck: not ready or unreachable)
  2  usage error: unknown subcommand or flag, a bad flag value, wrong arguments

flags:
`

func run(args []string, stdout, stderr io.Writer) int {
	if wantsVersion(args) {
		fmt.Fprintln(stdout, buildinfo.Read())
		return exitOK
	}
	shared, _ := newFlagSet("worker", io.Discard)
	cmd, args := splitCommand(args, shared, commands)
	var err error
	switch cmd {
	case "":
		err = runService(args, stderr)
	case "migrate":
		err = runMigrate(args, stdout, stderr)
	case "partition":
		err = runPartition(args, stdout, stderr)
	case "dead-letters":
		err = runDeadLetters(args, stdout, stderr)
	case "inspect":
		err = runInspect(args, stdout, stderr)
	case "stats":
		err = runStats(args, stdout, stderr)
	case "healthcheck":
		err = runHealthcheck(args, stdout, stderr)
	case "consumers":
		err = runConsumers(args, stdout, stderr)
	case "help":
		fs, _ := newFlagSet("worker", stderr)
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
		return exitOK
	default:
		err = usagef("unknown subcommand %q (want one of %s; see worker -h)", cmd, strings.Join(commands, ", "))
	}
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(stderr, "worker:", err)
	}
	return exitCode(err)
}

func parse(name string, args []string, stderr io.Writer) (*options, *flag.FlagSet, []string, error) {
	fs, o := newFlagSet(name, stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage); fs.PrintDefaults() }
	if err := fs.Parse(args); err != nil {
		return nil, nil, nil, usageError{err}
	}
	if err := o.readSecretFiles(); err != nil {
		return nil, nil, nil, err
	}
	return o, fs, fs.Args(), nil
}

func runService(args []string, stderr io.Writer) error {
	o, fs, rest, err := parse("worker", args, stderr)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return usagef("unexpected arguments %q", rest)
	}
	if len(o.envErrs) > 0 {
		return usageError{errors.Join(o.envErrs...)}
	}
	log, err := o.logger(stderr)
	if err != nil {
		return usageError{err}
	}
	warnSecretsOnCommandLine(fs, o, log)
	faults, err := faultsFromEnv()
	if err != nil {
		return err
	}
	if err := checkLegacyDataDir(fs, o); err != nil {
		return err
	}
	cfg := refapp.Config{
		HTTPAddr:    o.httpAddr,
		MetricsAddr: o.metricsAddr,
		Schema:      o.schema,
		NoMigrate:   o.noMigrate,
		Logger:      log,
		Console: refapp.ConsoleConfig{Enabled: o.console, Token: o.consoleToken,
			BasicUser: o.consoleUser, BasicPassword: o.consolePassword, AllowPlainHTTP: o.consolePlainHTTP},
	}
	if cfg.Stream.Replicas, err = strconv.Atoi(o.streamReplicas); err != nil || cfg.Stream.Replicas < 1 {
		return usagef("--stream-replicas (IDEM_STREAM_REPLICAS) must be a whole number of at least 1, not %q", o.streamReplicas)
	}
	if cfg.Email, err = o.emailConfig(log); err != nil {
		return err
	}
	if cfg.Email.Enabled() {
		log.Info("email consumer enabled", "smtp", refapp.RedactSMTPURL(cfg.Email.URL))
	}
	if err := applyRoles(&cfg, o.roles); err != nil {
		return usageError{err}
	}
	ackWait := o.ackWait
	if v := os.Getenv("IDEM_ACK_WAIT"); v != "" && ackWait == 0 {
		if ackWait, err = parseAckWait(v); err != nil {
			return usagef("IDEM_ACK_WAIT: %w", err)
		}
	}
	// Zero keeps the consumers' default. The lifetime check at start counts it in
	// each consumer's redelivery horizon.
	cfg.Charges.AckWait, cfg.Emails.AckWait = ackWait, ackWait
	if cfg.Reconcile.After, cfg.DisableReconciler, err = parseReconcileAfter(o.reconcileAfter); err != nil {
		return usageError{err}
	}
	if err := checkGroupCommit(o.groupCommit); err != nil {
		return usageError{err}
	}
	cfg.Relay.AtomicPublish, cfg.Stream.AllowAtomicPublish = o.atomicPublish, o.atomicPublish
	exporter, err := traceExporter(o.trace, os.Getenv)
	if err != nil {
		return err
	}
	tp, shutdownTracing, err := setupTracing(context.Background(), exporter, stderr)
	if err != nil {
		return err
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := shutdownTracing(ctx); err != nil {
			log.Warn("tracing: flushing spans at exit failed", "err", err)
		}
	}()
	cfg.TracerProvider = tp

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	ctx = withFaults(ctx, faults, log)
	e, err := runenv.Open(ctx, runenv.Config{
		DatabaseURL:     o.databaseURL,
		PrivatePostgres: !databaseURLExplicit(fs),
		NATSURL:         o.natsURL,
		NATSAuth:        o.natsAuth,
		DataDir:         o.dataDir,
		Logger:          log,
		// Without a reconciler nothing would find what a crash of the broker
		// loses: then, and only then, the broker must fsync every write.
		EmbeddedNATSSyncAlways: cfg.DisableReconciler,
	})
	if err != nil {
		return err
	}
	defer e.Close(context.Background()) //nolint:errcheck
	log.Info("connected", "database", runenv.Redact(e.DatabaseURL), "nats", embeddednats.Redact(e.NATSURL), "data_dir", e.DataDir)
	svc, err := refapp.Start(ctx, e.Pool, e.NC, cfg)
	if err != nil {
		return err
	}
	log.Info("worker ready", "http", svc.Addr())
	if o.console {
		addr := svc.Addr()
		if m := svc.MetricsAddr(); m != "" {
			addr = m
		}
		log.Info("operator console", "url", "http://"+addr+refapp.ConsolePath)
	}

	var failure error
	select {
	case <-ctx.Done():
	case failure = <-svc.Failed():
		log.Error("component failed; shutting down", "err", failure)
	}
	stop() // a second signal now gets Go's default behaviour: exit at once

	log.Info("shutting down: stop fetching, finish in-flight batches", "timeout", o.shutdownTimeout)
	sctx, cancel := context.WithTimeout(context.Background(), o.shutdownTimeout)
	defer cancel()
	serr := svc.Shutdown(sctx)
	if failure != nil {
		// Exit non-zero, so that a supervisor restarts a worker that lost a part.
		return failure
	}
	if serr != nil {
		return serr
	}
	log.Info("worker stopped")
	return nil
}

// legacyDataDir is where earlier versions kept the data dir by default: relative
// to the working directory, so each directory a worker ran in had its own.
const legacyDataDir = "idem-data"

// checkLegacyDataDir refuses to start a worker with no data dir named in a
// directory holding an earlier version's data dir. That one holds the earlier
// worker's private Postgres and JetStream store (outbox rows not yet published,
// the keys of requests already executed); the default one would start on an
// empty database and stream, and the clients' retries would execute again.
func checkLegacyDataDir(fs *flag.FlagSet, o *options) error {
	named := os.Getenv("IDEM_DATA_DIR") != ""
	fs.Visit(func(f *flag.Flag) { named = named || f.Name == "data-dir" })
	if named {
		return nil
	}
	fi, err := os.Stat(legacyDataDir)
	if err != nil || !fi.IsDir() {
		return nil
	}
	old, err := filepath.Abs(legacyDataDir)
	if err != nil || old == o.dataDir {
		return nil
	}
	return fmt.Errorf("the working directory holds %s, the data dir of an earlier version (its private Postgres and JetStream store), "+
		"but this version's default data dir is %s: starting there would begin on an empty database and stream, "+
		"abandon the old outbox and execute the clients' retries again. Name the data dir: keep the old one with "+
		"--data-dir %s (or IDEM_DATA_DIR), or, with no worker running, move it to the default (mv %s %s, when that does not exist yet); "+
		"rename or remove %s only if its data is no longer wanted",
		old, o.dataDir, old, old, o.dataDir, old)
}

func applyRoles(cfg *refapp.Config, roles string) error {
	if roles == "all" || roles == "" {
		return nil
	}
	cfg.DisableIngress, cfg.DisableRelay, cfg.DisableConsumers = true, true, true
	for _, r := range splitComma(roles) {
		switch r {
		case "ingress":
			cfg.DisableIngress = false
		case "relay":
			cfg.DisableRelay = false
		case "consumers":
			cfg.DisableConsumers = false
		default:
			return fmt.Errorf("--roles: unknown role %q (want ingress, relay, consumers)", r)
		}
	}
	return nil
}

func splitComma(s string) []string {
	var out []string
	start := 0
	for i := 0; i <= len(s); i++ {
		if i == len(s) || s[i] == ',' {
			if i > start {
				out = append(out, s[start:i])
			}
			start = i + 1
		}
	}
	return out
}
