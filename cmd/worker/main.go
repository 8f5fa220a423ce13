// Command worker is the idem service: the HTTP ingress of the demo API, the outbox
// relay and the consumers, plus operator subcommands.
//
//	worker [flags]                      run the service
//	worker migrate [flags]              apply the schema and exit
//	worker dead-letters list [flags]    list dead letters
//	worker dead-letters replay ID       re-publish one dead letter with its key
//
// Every flag has an environment fallback (DATABASE_URL, NATS_URL, IDEM_HTTP_ADDR,
// IDEM_DATA_DIR, IDEM_SMTP_ADDR). With NATS_URL empty the worker starts an embedded
// JetStream server whose store lives under --data-dir.
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
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/service"
	"github.com/idemkit/idem/migrations"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// options are the flags shared by every subcommand.
type options struct {
	databaseURL     string
	natsURL         string
	httpAddr        string
	dataDir         string
	smtpAddr        string
	logFormat       string
	logLevel        string
	shutdownTimeout time.Duration
	roles           string
	trace           string
	ackWait         time.Duration
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func newFlagSet(name string, stderr io.Writer) (*flag.FlagSet, *options) {
	o := &options{}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.databaseURL, "database-url", env("DATABASE_URL", service.DefaultDatabaseURL), "Postgres URL (env DATABASE_URL)")
	fs.StringVar(&o.natsURL, "nats-url", env("NATS_URL", ""), "NATS server URL; empty starts an embedded JetStream server (env NATS_URL)")
	fs.StringVar(&o.httpAddr, "http-addr", env("IDEM_HTTP_ADDR", "127.0.0.1:8080"), "HTTP listen address (env IDEM_HTTP_ADDR)")
	fs.StringVar(&o.dataDir, "data-dir", env("IDEM_DATA_DIR", "idem-data"), "directory for the embedded JetStream store (env IDEM_DATA_DIR)")
	fs.StringVar(&o.smtpAddr, "smtp-addr", env("IDEM_SMTP_ADDR", ""), "SMTP server host:port for the email consumer (env IDEM_SMTP_ADDR)")
	fs.StringVar(&o.logFormat, "log-format", env("IDEM_LOG_FORMAT", "text"), "log format: text or json")
	fs.StringVar(&o.logLevel, "log-level", env("IDEM_LOG_LEVEL", "info"), "log level: debug, info, warn, error")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 30*time.Second, "how long in-flight work may take to finish after SIGTERM")
	fs.StringVar(&o.trace, "trace", env("IDEM_TRACE", ""), "span exporter: empty for none (trace context is still propagated), or stderr")
	fs.StringVar(&o.roles, "roles", env("IDEM_ROLES", "all"), "components to run: all, or a comma list of ingress,relay,consumers")
	fs.Func("ack-wait", "how long JetStream waits for a consumer's ack before redelivering (env IDEM_ACK_WAIT; default 30s)", func(v string) (err error) {
		o.ackWait, err = parseAckWait(v)
		return err
	})
	return fs, o
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
		return slog.New(slog.NewTextHandler(w, hopts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, hopts)), nil
	}
	return nil, fmt.Errorf("--log-format must be text or json, not %q", o.logFormat)
}

const usage = `usage:
  worker [flags]                       run the service (ingress, relay, consumers)
  worker migrate [flags]               apply the schema and exit
  worker inspect [--scope S] KEY       print everything known about one key
  worker stats [--json]                counts and lags (outbox backlog, inbox, dead letters)
  worker healthcheck [flags]           exit 0 if the worker at --http-addr is ready
  worker dead-letters list [flags]     list dead letters (newest first)
  worker dead-letters replay [flags] ID
                                       re-publish dead letter ID with its original key

flags:
`

func run(args []string, stdout, stderr io.Writer) int {
	cmd := ""
	if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
		cmd, args = args[0], args[1:]
	}
	var err error
	switch cmd {
	case "":
		err = runService(args, stderr)
	case "migrate":
		err = runMigrate(args, stdout, stderr)
	case "dead-letters":
		err = runDeadLetters(args, stdout, stderr)
	case "inspect":
		err = runInspect(args, stdout, stderr)
	case "stats":
		err = runStats(args, stdout, stderr)
	case "healthcheck":
		err = runHealthcheck(args, stderr)
	case "help":
		fs, _ := newFlagSet("worker", stderr)
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
		return 0
	default:
		err = fmt.Errorf("unknown subcommand %q", cmd)
	}
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "worker:", err)
		return 1
	}
	return 0
}

func parse(name string, args []string, stderr io.Writer) (*options, []string, error) {
	fs, o := newFlagSet(name, stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage); fs.PrintDefaults() }
	if err := fs.Parse(args); err != nil {
		return nil, nil, err
	}
	return o, fs.Args(), nil
}

func runService(args []string, stderr io.Writer) error {
	fs, o := newFlagSet("worker", stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage); fs.PrintDefaults() }
	if err := fs.Parse(args); err != nil {
		return err
	}
	rest := fs.Args()
	// With no database named at all, a fresh machine gets a private Postgres when
	// none answers at the default URL.
	explicitDB := os.Getenv("DATABASE_URL") != ""
	fs.Visit(func(f *flag.Flag) { explicitDB = explicitDB || f.Name == "database-url" })
	if len(rest) > 0 {
		return fmt.Errorf("unexpected arguments %q", rest)
	}
	log, err := o.logger(stderr)
	if err != nil {
		return err
	}
	fset, err := faults.FromEnv()
	if err != nil {
		return err
	}
	cfg := service.Config{
		PrivatePostgres: !explicitDB,
		DatabaseURL:     o.databaseURL,
		NATSURL:         o.natsURL,
		DataDir:         o.dataDir,
		HTTPAddr:        o.httpAddr,
		SMTPAddr:        o.smtpAddr,
		Faults:          fset,
		Logger:          log,
	}
	if err := applyRoles(&cfg, o.roles); err != nil {
		return err
	}
	ackWait := o.ackWait
	if v := os.Getenv("IDEM_ACK_WAIT"); v != "" && ackWait == 0 {
		if ackWait, err = parseAckWait(v); err != nil {
			return fmt.Errorf("IDEM_ACK_WAIT: %w", err)
		}
	}
	// Zero keeps the consumers' default. The lifetime check at start counts it in
	// each consumer's redelivery horizon.
	cfg.ChargeConsumer.AckWait, cfg.EmailConsumer.AckWait = ackWait, ackWait
	switch o.trace {
	case "":
	case "stderr":
		exp, err := stdouttrace.New(stdouttrace.WithWriter(stderr))
		if err != nil {
			return fmt.Errorf("--trace: %w", err)
		}
		tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp))
		defer tp.Shutdown(context.Background()) //nolint:errcheck
		cfg.TracerProvider = tp
	default:
		return fmt.Errorf("--trace must be empty or stderr, not %q", o.trace)
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	svc, err := service.Start(ctx, cfg)
	if err != nil {
		return err
	}
	log.Info("worker ready", "http", svc.HTTPAddr(), "nats", svc.NATSURL())

	select {
	case <-ctx.Done():
	case err := <-svc.Errors():
		log.Error("component failed; shutting down", "err", err)
	}
	stop() // a second signal now gets Go's default behaviour: exit at once

	log.Info("shutting down: stop fetching, finish in-flight batches", "timeout", o.shutdownTimeout)
	sctx, cancel := context.WithTimeout(context.Background(), o.shutdownTimeout)
	defer cancel()
	if err := svc.Shutdown(sctx); err != nil {
		return err
	}
	log.Info("worker stopped")
	return nil
}

func applyRoles(cfg *service.Config, roles string) error {
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

func runMigrate(args []string, stdout, stderr io.Writer) error {
	o, _, err := parse("worker migrate", args, stderr)
	if err != nil {
		return err
	}
	ctx := context.Background()
	pool, err := openPool(ctx, o)
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := migrations.Apply(ctx, pool)
	if err != nil {
		return err
	}
	if len(applied) == 0 {
		fmt.Fprintln(stdout, "schema is up to date")
	}
	for _, a := range applied {
		fmt.Fprintln(stdout, "applied", a)
	}
	return nil
}

func runDeadLetters(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return errors.New("dead-letters: want list or replay ID")
	}
	sub, args := args[0], args[1:]
	o, rest, err := parse("worker dead-letters "+sub, args, stderr)
	if err != nil {
		return err
	}
	ctx := context.Background()
	pool, err := openPool(ctx, o)
	if err != nil {
		return err
	}
	defer pool.Close()
	switch sub {
	case "list":
		dls, err := consumer.ListDeadLetters(ctx, pool, 1000)
		if err != nil {
			return err
		}
		enc := json.NewEncoder(stdout)
		for _, dl := range dls {
			if err := enc.Encode(dl); err != nil {
				return err
			}
		}
		fmt.Fprintf(stderr, "%d dead letters\n", len(dls))
		return nil
	case "replay":
		if len(rest) != 1 {
			return errors.New("dead-letters replay: want exactly one ID")
		}
		id, err := strconv.ParseInt(rest[0], 10, 64)
		if err != nil {
			return fmt.Errorf("dead-letters replay: bad ID %q", rest[0])
		}
		if o.natsURL == "" {
			// The embedded server records its URL in the data dir while it runs.
			b, err := os.ReadFile(filepath.Join(o.dataDir, service.NATSURLFile))
			if err != nil {
				return fmt.Errorf("dead-letters replay: no --nats-url and no running embedded server under --data-dir %s: %w", o.dataDir, err)
			}
			o.natsURL = strings.TrimSpace(string(b))
		}
		nc, err := nats.Connect(o.natsURL)
		if err != nil {
			return fmt.Errorf("dead-letters replay: connect to NATS: %w", err)
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		dl, err := consumer.ReplayDeadLetter(ctx, pool, js, id)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "replayed dead letter %d (key %q, subject %s)\n", dl.ID, dl.Key, dl.Subject)
		return nil
	}
	return fmt.Errorf("dead-letters: unknown subcommand %q (want list or replay)", sub)
}

// runHealthcheck asks a running worker's /readyz; for container health checks,
// where the image has no curl.
func runHealthcheck(args []string, stderr io.Writer) error {
	o, _, err := parse("worker healthcheck", args, stderr)
	if err != nil {
		return err
	}
	client := &http.Client{Timeout: 3 * time.Second}
	resp, err := client.Get("http://" + o.httpAddr + "/readyz")
	if err != nil {
		return fmt.Errorf("healthcheck: %w", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("healthcheck: %s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}
