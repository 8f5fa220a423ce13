package main

// The service: `worker` with no subcommand runs the reference application. Its
// options become its configuration in one pure function, newServiceConfig;
// runService does the I/O around it.

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/runenv"
	"github.com/idemkit/idem/app/tracelog"
	"github.com/idemkit/idem/embeddednats"
)

// serviceOptions are the service's flags.
type serviceOptions struct {
	db               dbOptions
	nats             natsOptions
	httpAddr         string
	metricsAddr      string
	streamReplicas   string
	console          bool
	consoleToken     string
	consoleUser      string
	consolePassword  string
	consolePlainHTTP bool
	payPage          bool
	smtpAddr         string // deprecated: smtpURL
	smtpURL          string
	smtpCA           string
	smtpFrom         string
	logFormat        string
	logLevel         string
	shutdownTimeout  time.Duration
	roles            string
	trace            string
	ackWait          positiveDuration
	reconcileAfter   string
	groupCommit      string
	noMigrate        bool
	atomicPublish    bool
	relay            string
	// The files the console's secrets may be read from instead (secrets.go).
	consoleTokenFile, consolePasswordFile string
	// otelTracesExporter is OTEL_TRACES_EXPORTER, which --trace defers to when empty.
	otelTracesExporter string
	src                sources
}

func (o *serviceOptions) flags(fs *flagSet) {
	o.db.flags(fs)
	o.nats.flags(fs)
	fs.stringVar(&o.streamReplicas, "stream-replicas", "IDEM_STREAM_REPLICAS", "1", "replicas of the stream the worker creates (3 on a three-node JetStream cluster); an existing stream is left as it is, with a warning when it has fewer (env IDEM_STREAM_REPLICAS)")
	httpAddrVar(fs, &o.httpAddr)
	fs.stringVar(&o.metricsAddr, "metrics-addr", "IDEM_METRICS_ADDR", "", "serve /metrics on this address instead of the HTTP address, e.g. 127.0.0.1:9090 (env IDEM_METRICS_ADDR)")
	fs.boolVar(&o.console, "console", "IDEM_CONSOLE", notOff,
		"serve the operator console at /console, on the listener of /metrics (env IDEM_CONSOLE)")
	fs.stringVar(&o.consoleToken, "console-token", "IDEM_CONSOLE_TOKEN", "", "require this token for the console (Authorization: Bearer, or its login page); as a flag every user of the machine can read it: prefer the env var or --console-token-file (env IDEM_CONSOLE_TOKEN)")
	secretFileVar(fs, &o.consoleTokenFile, "console-token", "IDEM_CONSOLE_TOKEN")
	fs.stringVar(&o.consoleUser, "console-user", "IDEM_CONSOLE_USER", "", "require HTTP basic auth for the console with this user (env IDEM_CONSOLE_USER)")
	fs.stringVar(&o.consolePassword, "console-password", "IDEM_CONSOLE_PASSWORD", "", "the basic-auth password of --console-user; as a flag every user of the machine can read it: prefer the env var or --console-password-file (env IDEM_CONSOLE_PASSWORD)")
	secretFileVar(fs, &o.consolePasswordFile, "console-password", "IDEM_CONSOLE_PASSWORD")
	fs.boolVar(&o.consolePlainHTTP, "console-allow-plain-http", "IDEM_CONSOLE_ALLOW_PLAIN_HTTP", notOff,
		"serve the console, with its token or password, over plain HTTP on a listener that is not loopback: only when a TLS-terminating proxy, or a network you trust, is the only way to it (env IDEM_CONSOLE_ALLOW_PLAIN_HTTP)")
	fs.boolVar(&o.payPage, "pay-page", "IDEM_PAY_PAGE", notOff,
		"serve the payment page at /pay on the HTTP address, a demonstration of the browser client that needs the ingress role; it shows ledger rows to whoever reaches that address (env IDEM_PAY_PAGE)")
	fs.stringVar(&o.smtpURL, "smtp-url", "IDEM_SMTP_URL", "", "SMTP server of the email consumer; empty runs none. smtp://[user:password@]host[:port] (default port 587): STARTTLS when offered, "+
		"required with credentials, then AUTH PLAIN or LOGIN (?auth=plain|login picks one); smtps://... (default port 465): implicit TLS; smtp+insecure://host:port: plaintext, "+
		"no STARTTLS, no credentials, for a local sink such as mailpit. User and password are URL-escaped; logs show the URL without its password (env IDEM_SMTP_URL)")
	fs.stringVar(&o.smtpCA, "smtp-ca", "IDEM_SMTP_CA", "", "PEM `file` of the CA certificates to trust for --smtp-url's TLS instead of the system roots (env IDEM_SMTP_CA)")
	fs.stringVar(&o.smtpFrom, "smtp-from", "IDEM_SMTP_FROM", "", "sender `address` of the emails, envelope and From header (env IDEM_SMTP_FROM; default \"idem <idem@localhost>\")")
	fs.stringVar(&o.smtpAddr, "smtp-addr", "IDEM_SMTP_ADDR", "", "deprecated: SMTP server host:port, spoken to in plaintext without AUTH; the same as --smtp-url smtp+insecure://host:port (env IDEM_SMTP_ADDR)")
	fs.stringVar(&o.logFormat, "log-format", "IDEM_LOG_FORMAT", "text", "log format: text or json (env IDEM_LOG_FORMAT)")
	fs.stringVar(&o.logLevel, "log-level", "IDEM_LOG_LEVEL", "info", "log level: debug, info, warn, error (env IDEM_LOG_LEVEL)")
	o.shutdownTimeout = 30 * time.Second
	fs.fallback("shutdown-timeout", "IDEM_SHUTDOWN_TIMEOUT", func(v string) error {
		d, err := parsePositiveDuration(v)
		if err == nil {
			o.shutdownTimeout = d
		}
		return err
	})
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", o.shutdownTimeout, "how long in-flight work may take to finish after SIGTERM (env IDEM_SHUTDOWN_TIMEOUT)")
	fs.stringVar(&o.trace, "trace", "IDEM_TRACE", "", "span exporter: none, stderr, or otlp (OTLP/HTTP, configured by the OTEL_EXPORTER_OTLP_* variables; service name OTEL_SERVICE_NAME); empty follows OTEL_TRACES_EXPORTER, else none. Trace context is propagated either way (env IDEM_TRACE)")
	o.otelTracesExporter = fs.getenv("OTEL_TRACES_EXPORTER")
	fs.stringVar(&o.roles, "roles", "IDEM_ROLES", "all", "components to run: all, or a comma list of ingress,relay,consumers (env IDEM_ROLES)")
	fs.boolVar(&o.noMigrate, "no-migrate", "IDEM_NO_MIGRATE", anyValue, "do not apply migrations at start; run `worker migrate` (or its --print SQL) yourself (env IDEM_NO_MIGRATE)")
	fs.valueVar(&o.ackWait, "ack-wait", "IDEM_ACK_WAIT", "how long JetStream waits for a consumer's ack before redelivering (env IDEM_ACK_WAIT; default 30s)")
	fs.stringVar(&o.groupCommit, "group-commit", "IDEM_GROUP_COMMIT", "", "removed: group commit at the ingress is gone, every request has its own transaction; "+
		"empty or 0 is accepted, any other value is refused (env IDEM_GROUP_COMMIT)")
	fs.boolVar(&o.atomicPublish, "atomic-publish", "IDEM_ATOMIC_PUBLISH", anyValue, "the relay publishes each batch as one JetStream atomic batch, one PubAck (and with fsync on every write one fsync) per batch; "+
		"the stream the worker creates allows it; an existing stream that does not makes the relay publish message by message, with a warning; needs nats-server 2.12 or later (env IDEM_ATOMIC_PUBLISH)")
	fs.stringVar(&o.relay, "relay", "IDEM_RELAY", "", "which relay publishes the outbox: log (reads committed rows from a logical replication slot: wal_level = logical and a role that may replicate), "+
		"poll (claims pending rows), or empty for log where it can run, else poll; the worker logs which and why at start (env IDEM_RELAY)")
	fs.stringVar(&o.reconcileAfter, "reconcile-after", "IDEM_RECONCILE_AFTER", "", "how long a published intent may stay unsettled by a consumer before the reconciler looks for it in the stream and re-drives it if lost; "+
		"off runs the relay without a reconciler (env IDEM_RECONCILE_AFTER; default 5m)")
	o.src = fs.src
}

func (o *serviceOptions) validate(args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("unexpected arguments %q", args)
	}
	return nil
}

func (o *serviceOptions) secrets() []*secret {
	return append([]*secret{
		{flag: "console-token", env: "IDEM_CONSOLE_TOKEN", value: &o.consoleToken, file: o.consoleTokenFile},
		{flag: "console-password", env: "IDEM_CONSOLE_PASSWORD", value: &o.consolePassword, file: o.consolePasswordFile},
	}, o.nats.secrets()...)
}

// serviceConfig is what the service runs with.
type serviceConfig struct {
	// app is the reference application's configuration, but for what runService
	// makes: Logger, TracerProvider, and Email.TLSConfig (from smtpCA).
	app refapp.Config
	// env is where the worker finds Postgres and NATS, but for Logger.
	env runenv.Config
	// smtpCA is the PEM file of the CAs to trust for SMTP's TLS (--smtp-ca).
	smtpCA    string
	logFormat string // text or json
	logLevel  slog.Level
	// trace is the span exporter: none, stderr or otlp.
	trace           string
	shutdownTimeout time.Duration
	// warnings are logged once there is a log.
	warnings []warning
}

// warning is a line for the log, with its attributes.
type warning struct {
	msg  string
	args []any
}

// newServiceConfig turns the service's options into its configuration, with
// defaults left to the parts (a zero means theirs). It does no I/O: the secrets'
// files were read before, and the file of --smtp-ca is runService's to read.
// An error in the options is a usage error here, before anything starts (but
// for --trace, exit status 1 as ever).
func newServiceConfig(o *serviceOptions) (serviceConfig, error) {
	c := serviceConfig{
		app: refapp.Config{
			HTTPAddr:    o.httpAddr,
			MetricsAddr: o.metricsAddr,
			Schema:      o.db.schema,
			NoMigrate:   o.noMigrate,
			Console: refapp.ConsoleConfig{Enabled: o.console, Token: o.consoleToken,
				BasicUser: o.consoleUser, BasicPassword: o.consolePassword, AllowPlainHTTP: o.consolePlainHTTP},
			PayPage: o.payPage,
		},
		env: runenv.Config{
			DatabaseURL:     o.db.databaseURL,
			PrivatePostgres: !o.db.databaseNamed(),
			NATSURL:         o.nats.url,
			NATSAuth:        o.nats.auth,
			DataDir:         o.db.dataDir,
		},
		smtpCA:          o.smtpCA,
		logFormat:       o.logFormat,
		shutdownTimeout: o.shutdownTimeout,
		warnings:        secretWarnings(o),
	}
	if err := c.logLevel.UnmarshalText([]byte(o.logLevel)); err != nil {
		return c, usagef("--log-level: %w", err)
	}
	if o.logFormat != "text" && o.logFormat != "json" {
		return c, usagef("--log-format must be text or json, not %q", o.logFormat)
	}
	var err error
	if c.app.Stream.Replicas, err = strconv.Atoi(o.streamReplicas); err != nil || c.app.Stream.Replicas < 1 {
		return c, usagef("--stream-replicas (IDEM_STREAM_REPLICAS) must be a whole number of at least 1, not %q", o.streamReplicas)
	}
	if c.app.Email, err = emailConfig(o, &c.warnings); err != nil {
		return c, err
	}
	if err := applyRoles(&c.app, o.roles); err != nil {
		return c, usageError{err}
	}
	if c.app.PayPage && c.app.DisableIngress {
		return c, usagef("--pay-page (IDEM_PAY_PAGE) posts to the ingress on the same address: add ingress to --roles (IDEM_ROLES), or leave the page off")
	}
	// Zero keeps the consumers' default. The lifetime check at start counts it in
	// each consumer's redelivery horizon.
	c.app.Charges.AckWait, c.app.Emails.AckWait = time.Duration(o.ackWait), time.Duration(o.ackWait)
	if c.app.Reconcile.After, c.app.DisableReconciler, err = parseReconcileAfter(o.reconcileAfter); err != nil {
		return c, usageError{err}
	}
	// Without a reconciler nothing would find what a crash of the broker loses:
	// then, and only then, the embedded broker must fsync every write.
	c.env.EmbeddedNATSSyncAlways = c.app.DisableReconciler
	if err := checkGroupCommit(o.groupCommit); err != nil {
		return c, usageError{err}
	}
	c.app.Relay.AtomicPublish, c.app.Stream.AllowAtomicPublish = o.atomicPublish, o.atomicPublish
	switch o.relay {
	case "", "log", "poll":
		c.app.Relay.Mode = o.relay
	default:
		return c, usagef("--relay (IDEM_RELAY) is log, poll or empty, not %q", o.relay)
	}
	if c.trace, err = traceExporter(o.trace, o.otelTracesExporter); err != nil {
		return c, err
	}
	return c, nil
}

// emailConfig is the email consumer's configuration from the flags: the SMTP
// server from --smtp-url, or from the deprecated --smtp-addr (which means
// smtp+insecure://ADDR: plaintext, no AUTH).
// Without either the worker runs no email consumer.
func emailConfig(o *serviceOptions, warnings *[]warning) (refapp.EmailConfig, error) {
	cfg := refapp.EmailConfig{URL: o.smtpURL, From: o.smtpFrom}
	switch {
	case o.smtpURL != "" && o.smtpAddr != "":
		return cfg, usagef("--smtp-addr (IDEM_SMTP_ADDR) is a deprecated form of --smtp-url (IDEM_SMTP_URL): give one, not both")
	case o.smtpAddr != "":
		cfg.URL = "smtp+insecure://" + o.smtpAddr
		*warnings = append(*warnings, warning{"--smtp-addr (IDEM_SMTP_ADDR) is deprecated: it means --smtp-url smtp+insecure://ADDR (plaintext, no AUTH); use --smtp-url",
			[]any{"smtp_url", cfg.URL}})
	}
	if o.smtpCA != "" && cfg.URL == "" {
		return cfg, usagef("--smtp-ca (IDEM_SMTP_CA) needs --smtp-url")
	}
	if o.smtpFrom != "" && cfg.URL == "" {
		return cfg, usagef("--smtp-from (IDEM_SMTP_FROM) needs --smtp-url")
	}
	if cfg.URL != "" {
		// Validate now, for a message at start rather than a failed consumer.
		if _, err := refapp.NewEmailHandler(cfg); err != nil {
			return cfg, usageError{fmt.Errorf("--smtp-url: %w", err)}
		}
	}
	return cfg, nil
}

// runService runs the service until a signal, or until a part fails.
func runService(o *serviceOptions, _, stderr io.Writer) error {
	c, err := newServiceConfig(o)
	if err != nil {
		return err
	}
	log := newLogger(c.logFormat, c.logLevel, stderr)
	for _, w := range c.warnings {
		log.Warn(w.msg, w.args...)
	}
	faults, err := faultsFromEnv()
	if err != nil {
		return err
	}
	if err := checkLegacyDataDir(c.env.DataDir, o.db.src.given("data-dir")); err != nil {
		return err
	}
	if c.app.Email.TLSConfig, err = loadSMTPCA(c.smtpCA); err != nil {
		return err
	}
	if c.app.Email.Enabled() {
		log.Info("email consumer enabled", "smtp", refapp.RedactSMTPURL(c.app.Email.URL))
	}
	tp, shutdownTracing, err := setupTracing(context.Background(), c.trace, stderr)
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
	c.app.TracerProvider, c.app.Logger, c.env.Logger = tp, log, log

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	ctx = withFaults(ctx, faults, log)
	e, err := runenv.Open(ctx, c.env)
	if err != nil {
		return err
	}
	defer e.Close(context.Background()) //nolint:errcheck
	log.Info("connected", "database", runenv.Redact(e.DatabaseURL), "nats", embeddednats.Redact(e.NATSURL), "data_dir", e.DataDir)
	svc, err := refapp.Start(ctx, e.Pool, e.NC, c.app)
	if err != nil {
		return err
	}
	return serve(ctx, stop, svc, c, log)
}

// serve waits for a signal or a failed part, then shuts the service down within
// the shutdown timeout.
func serve(ctx context.Context, stop context.CancelFunc, svc *refapp.Service, c serviceConfig, log *slog.Logger) error {
	log.Info("worker ready", "http", svc.Addr())
	if c.app.Console.Enabled {
		addr := svc.Addr()
		if m := svc.MetricsAddr(); m != "" {
			addr = m
		}
		log.Info("operator console", "url", "http://"+addr+refapp.ConsolePath)
	}
	if c.app.PayPage {
		log.Info("payment page", "url", "http://"+svc.Addr()+refapp.PayPagePath)
	}
	var failure error
	select {
	case <-ctx.Done():
	case failure = <-svc.Failed():
		log.Error("component failed; shutting down", "err", failure)
	}
	stop() // a second signal now gets Go's default behaviour: exit at once

	log.Info("shutting down: stop fetching, finish in-flight batches", "timeout", c.shutdownTimeout)
	sctx, cancel := context.WithTimeout(context.Background(), c.shutdownTimeout)
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

func newLogger(format string, level slog.Level, w io.Writer) *slog.Logger {
	hopts := &slog.HandlerOptions{Level: level}
	if format == "json" {
		return slog.New(tracelog.New(slog.NewJSONHandler(w, hopts)))
	}
	return slog.New(tracelog.New(slog.NewTextHandler(w, hopts)))
}

// loadSMTPCA reads the CA file of --smtp-ca; none (empty) is the system roots.
func loadSMTPCA(file string) (*tls.Config, error) {
	if file == "" {
		return nil, nil
	}
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("--smtp-ca: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("--smtp-ca: %s holds no PEM certificate", file)
	}
	return &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}, nil
}

// positiveDuration is a flag's duration that must be above zero; zero (not
// given) leaves the default to the part it configures.
type positiveDuration time.Duration

func (d *positiveDuration) Set(v string) error {
	p, err := parsePositiveDuration(v)
	*d = positiveDuration(p)
	return err
}

func (d *positiveDuration) String() string {
	if d == nil || *d == 0 {
		return ""
	}
	return time.Duration(*d).String()
}

// parsePositiveDuration reads --ack-wait, IDEM_ACK_WAIT and IDEM_SHUTDOWN_TIMEOUT.
func parsePositiveDuration(v string) (time.Duration, error) {
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("want a positive duration such as 30s, got %q", v)
	}
	return d, nil
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

// legacyDataDir is where earlier versions kept the data dir by default: relative
// to the working directory, so each directory a worker ran in had its own.
const legacyDataDir = "idem-data"

// checkLegacyDataDir refuses to start a worker with no data dir named in a
// directory holding an earlier version's data dir. That one holds the earlier
// worker's private Postgres and JetStream store (outbox rows not yet published,
// the keys of requests already executed); the default one would start on an
// empty database and stream, and the clients' retries would execute again.
func checkLegacyDataDir(dataDir string, named bool) error {
	if named {
		return nil
	}
	fi, err := os.Stat(legacyDataDir)
	if err != nil || !fi.IsDir() {
		return nil
	}
	old, err := filepath.Abs(legacyDataDir)
	if err != nil || old == dataDir {
		return nil
	}
	return fmt.Errorf("the working directory holds %s, the data dir of an earlier version (its private Postgres and JetStream store), "+
		"but this version's default data dir is %s: starting there would begin on an empty database and stream, "+
		"abandon the old outbox and execute the clients' retries again. Name the data dir: keep the old one with "+
		"--data-dir %s (or IDEM_DATA_DIR), or, with no worker running, move it to the default (mv %s %s, when that does not exist yet); "+
		"rename or remove %s only if its data is no longer wanted",
		old, dataDir, old, old, dataDir, old)
}
