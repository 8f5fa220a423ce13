package main

import (
	"io"
	"log/slog"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/runenv"
)

// serviceOptionsFrom parses the service's command line and environment as the
// worker does, without running anything.
func serviceOptionsFrom(args []string, env map[string]string) (*serviceOptions, error) {
	return newCommand("", usage, runService).parse(args, envOf(env), io.Discard)
}

// The service's options become its configuration in newServiceConfig, a pure
// function: each flag (or its variable) lands in its one place of the reference
// application's configuration or the environment's, and nothing else moves.
func TestServiceConfig(t *testing.T) {
	t.Parallel()
	const dead = "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable"
	// The configuration of a worker given nothing.
	base := func() serviceConfig {
		c := serviceConfig{
			env:             runenv.Config{DatabaseURL: runenv.DefaultDatabaseURL, PrivatePostgres: true, DataDir: defaultDataDir()},
			logFormat:       "text",
			logLevel:        slog.LevelInfo,
			trace:           "none",
			shutdownTimeout: 30 * time.Second,
		}
		c.app.HTTPAddr, c.app.Stream.Replicas = "127.0.0.1:8080", 1
		return c
	}
	onCommandLine := func(flag, instead string) warning {
		return warning{"a credential is on the command line, where every user of this machine can read it (ps, /proc/<pid>/cmdline)",
			[]any{"flag", "--" + flag, "instead", instead}}
	}
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want func(c *serviceConfig) // base, changed as the options say
	}{
		{"nothing given", nil, nil, func(*serviceConfig) {}},
		{"the HTTP side", []string{"--http-addr", ":0", "--metrics-addr", "127.0.0.1:9090"}, nil, func(c *serviceConfig) {
			c.app.HTTPAddr, c.app.MetricsAddr = ":0", "127.0.0.1:9090"
		}},
		{"the console, credentials on the command line", []string{"--console", "--console-token", "tok", "--console-user", "u", "--console-password", "pw", "--console-allow-plain-http"}, nil,
			func(c *serviceConfig) {
				c.app.Console = refapp.ConsoleConfig{Enabled: true, Token: "tok", BasicUser: "u", BasicPassword: "pw", AllowPlainHTTP: true}
				c.warnings = []warning{onCommandLine("console-token", "IDEM_CONSOLE_TOKEN, or --console-token-file"),
					onCommandLine("console-password", "IDEM_CONSOLE_PASSWORD, or --console-password-file")}
			}},
		{"the console from the environment: no warning", nil, map[string]string{"IDEM_CONSOLE": "yes", "IDEM_CONSOLE_TOKEN": "tok", "IDEM_CONSOLE_ALLOW_PLAIN_HTTP": "false"},
			func(c *serviceConfig) { c.app.Console = refapp.ConsoleConfig{Enabled: true, Token: "tok"} }},
		{"IDEM_CONSOLE=0 is off", nil, map[string]string{"IDEM_CONSOLE": "0"}, func(*serviceConfig) {}},
		{"the payment page", []string{"--pay-page"}, nil, func(c *serviceConfig) { c.app.PayPage = true }},
		{"the payment page from IDEM_PAY_PAGE", nil, map[string]string{"IDEM_PAY_PAGE": "1"}, func(c *serviceConfig) { c.app.PayPage = true }},
		{"IDEM_PAY_PAGE=false is off", nil, map[string]string{"IDEM_PAY_PAGE": "false"}, func(*serviceConfig) {}},
		{"the schema, no migrations", []string{"--schema", "billing", "--no-migrate"}, nil, func(c *serviceConfig) {
			c.app.Schema, c.app.NoMigrate = "billing", true
		}},
		{"IDEM_NO_MIGRATE: any value is on", nil, map[string]string{"IDEM_NO_MIGRATE": "0", "IDEM_SCHEMA": "s"}, func(c *serviceConfig) {
			c.app.Schema, c.app.NoMigrate = "s", true
		}},
		{"a database named on the command line: no private Postgres", []string{"--database-url", dead, "--data-dir", "/srv/idem"}, nil, func(c *serviceConfig) {
			c.env.DatabaseURL, c.env.PrivatePostgres, c.env.DataDir = dead, false, "/srv/idem"
		}},
		{"a database named in DATABASE_URL: no private Postgres", nil, map[string]string{"DATABASE_URL": dead, "IDEM_DATA_DIR": "/srv/idem"}, func(c *serviceConfig) {
			c.env.DatabaseURL, c.env.PrivatePostgres, c.env.DataDir = dead, false, "/srv/idem"
		}},
		{"a database password on the command line", []string{"--database-url", "postgres://u:hunter2@h/db"}, nil, func(c *serviceConfig) {
			c.env.DatabaseURL, c.env.PrivatePostgres = "postgres://u:hunter2@h/db", false
			c.warnings = []warning{onCommandLine("database-url", "DATABASE_URL, or a URL without its password and the password in PGPASSWORD or a password file (PGPASSFILE, ~/.pgpass)")}
		}},
		{"NATS", []string{"--nats-url", "nats://a:4222,nats://b:4222", "--nats-user", "u", "--nats-ca", "ca.pem"}, map[string]string{"IDEM_NATS_PASSWORD": "pw", "IDEM_NATS_CREDS": "c.creds"},
			func(c *serviceConfig) {
				c.env.NATSURL = "nats://a:4222,nats://b:4222"
				c.env.NATSAuth = runenv.NATSAuth{User: "u", Password: "pw", CAFile: "ca.pem", CredsFile: "c.creds"}
			}},
		{"roles", []string{"--roles", "relay,consumers"}, nil, func(c *serviceConfig) { c.app.DisableIngress = true }},
		{"roles from IDEM_ROLES", nil, map[string]string{"IDEM_ROLES": "ingress"}, func(c *serviceConfig) {
			c.app.DisableRelay, c.app.DisableConsumers = true, true
		}},
		{"--ack-wait reaches both consumers", []string{"--ack-wait", "7s"}, nil, func(c *serviceConfig) {
			c.app.Charges.AckWait, c.app.Emails.AckWait = 7*time.Second, 7*time.Second
		}},
		{"IDEM_ACK_WAIT", nil, map[string]string{"IDEM_ACK_WAIT": "9s"}, func(c *serviceConfig) {
			c.app.Charges.AckWait, c.app.Emails.AckWait = 9*time.Second, 9*time.Second
		}},
		{"--ack-wait over IDEM_ACK_WAIT, even one that does not parse", []string{"--ack-wait", "7s"}, map[string]string{"IDEM_ACK_WAIT": "soon"}, func(c *serviceConfig) {
			c.app.Charges.AckWait, c.app.Emails.AckWait = 7*time.Second, 7*time.Second
		}},
		{"a reconciler that looks later", []string{"--reconcile-after", "2m"}, nil, func(c *serviceConfig) { c.app.Reconcile.After = 2 * time.Minute }},
		{"no reconciler: the embedded broker fsyncs every write", nil, map[string]string{"IDEM_RECONCILE_AFTER": "off"}, func(c *serviceConfig) {
			c.app.DisableReconciler, c.env.EmbeddedNATSSyncAlways = true, true
		}},
		{"atomic publish: the relay and the stream", []string{"--atomic-publish"}, nil, func(c *serviceConfig) {
			c.app.Relay.AtomicPublish, c.app.Stream.AllowAtomicPublish = true, true
		}},
		{"IDEM_ATOMIC_PUBLISH", nil, map[string]string{"IDEM_ATOMIC_PUBLISH": "1"}, func(c *serviceConfig) {
			c.app.Relay.AtomicPublish, c.app.Stream.AllowAtomicPublish = true, true
		}},
		{"stream replicas", nil, map[string]string{"IDEM_STREAM_REPLICAS": "3"}, func(c *serviceConfig) { c.app.Stream.Replicas = 3 }},
		{"group commit off", []string{"--group-commit", "0"}, nil, func(*serviceConfig) {}},
		{"SMTP", []string{"--smtp-url", "smtps://u:p@mail.example:465", "--smtp-from", "billing <b@example.com>", "--smtp-ca", "/etc/ca.pem"}, nil,
			func(c *serviceConfig) {
				c.app.Email = refapp.EmailConfig{URL: "smtps://u:p@mail.example:465", From: "billing <b@example.com>"}
				c.smtpCA = "/etc/ca.pem" // read by runService, into Email.TLSConfig
				c.warnings = []warning{onCommandLine("smtp-url", "IDEM_SMTP_URL")}
			}},
		{"the deprecated --smtp-addr is smtp+insecure://", []string{"--smtp-addr", "127.0.0.1:1025"}, nil, func(c *serviceConfig) {
			c.app.Email.URL = "smtp+insecure://127.0.0.1:1025"
			c.warnings = []warning{{"--smtp-addr (IDEM_SMTP_ADDR) is deprecated: it means --smtp-url smtp+insecure://ADDR (plaintext, no AUTH); use --smtp-url",
				[]any{"smtp_url", "smtp+insecure://127.0.0.1:1025"}}}
		}},
		{"the log", []string{"--log-format", "json"}, map[string]string{"IDEM_LOG_LEVEL": "debug"}, func(c *serviceConfig) {
			c.logFormat, c.logLevel = "json", slog.LevelDebug
		}},
		{"--trace", []string{"--trace", "stderr"}, map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, func(c *serviceConfig) { c.trace = "stderr" }},
		{"OTEL_TRACES_EXPORTER", nil, map[string]string{"OTEL_TRACES_EXPORTER": "console"}, func(c *serviceConfig) { c.trace = "stderr" }},
		{"the shutdown timeout", []string{"--shutdown-timeout", "5s"}, nil, func(c *serviceConfig) { c.shutdownTimeout = 5 * time.Second }},
		{"IDEM_SHUTDOWN_TIMEOUT", nil, map[string]string{"IDEM_SHUTDOWN_TIMEOUT": "17s"}, func(c *serviceConfig) { c.shutdownTimeout = 17 * time.Second }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := serviceOptionsFrom(tc.args, tc.env)
			if err != nil {
				t.Fatal(err)
			}
			got, err := newServiceConfig(o)
			if err != nil {
				t.Fatal(err)
			}
			want := base()
			tc.want(&want)
			if !reflect.DeepEqual(got, want) {
				t.Errorf("newServiceConfig(%q, env %v):\n got %+v\nwant %+v", tc.args, tc.env, got, want)
			}
		})
	}
}

// Every mistake in the service's options is found before anything starts: a
// usage error (exit 2), but for --trace (exit 1, as ever).
func TestServiceConfigRefuses(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		env  map[string]string
		code int
		want string
	}{
		{[]string{"extra"}, nil, exitUsage, `unexpected arguments ["extra"]`},
		{nil, map[string]string{"IDEM_ACK_WAIT": "soon"}, exitUsage, `IDEM_ACK_WAIT: want a positive duration such as 30s, got "soon"`},
		{nil, map[string]string{"IDEM_SHUTDOWN_TIMEOUT": "-1s"}, exitUsage, `IDEM_SHUTDOWN_TIMEOUT: want a positive duration such as 30s, got "-1s"`},
		{[]string{"--ack-wait", "0s"}, nil, exitUsage, "want a positive duration"},
		{[]string{"--log-level", "loud"}, nil, exitUsage, "--log-level"},
		{nil, map[string]string{"IDEM_LOG_FORMAT": "xml"}, exitUsage, `--log-format must be text or json, not "xml"`},
		{[]string{"--stream-replicas", "0"}, nil, exitUsage, "--stream-replicas (IDEM_STREAM_REPLICAS) must be a whole number of at least 1"},
		{nil, map[string]string{"IDEM_STREAM_REPLICAS": "three"}, exitUsage, `not "three"`},
		{[]string{"--roles", "ingress,cook"}, nil, exitUsage, `unknown role "cook"`},
		{[]string{"--pay-page", "--roles", "relay,consumers"}, nil, exitUsage, "--pay-page (IDEM_PAY_PAGE) posts to the ingress on the same address: add ingress to --roles"},
		{[]string{"--reconcile-after", "0s"}, nil, exitUsage, "--reconcile-after: want a positive duration"},
		{nil, map[string]string{"IDEM_GROUP_COMMIT": "8"}, exitUsage, "group commit was removed"},
		{[]string{"--smtp-url", "smtp://h:25", "--smtp-addr", "h:25"}, nil, exitUsage, "not both"},
		{[]string{"--smtp-ca", "/etc/ca.pem"}, nil, exitUsage, "--smtp-ca (IDEM_SMTP_CA) needs --smtp-url"},
		{nil, map[string]string{"IDEM_SMTP_FROM": "a@b"}, exitUsage, "--smtp-from (IDEM_SMTP_FROM) needs --smtp-url"},
		{[]string{"--smtp-url", "ftp://u:hunter2@h"}, nil, exitUsage, "scheme must be smtp"},
		{[]string{"--trace", "jaeger"}, nil, exitError, "--trace must be none, stderr or otlp"},
		{nil, map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, exitError, `OTEL_TRACES_EXPORTER="zipkin"`},
	} {
		o, err := serviceOptionsFrom(tc.args, tc.env)
		if err == nil {
			_, err = newServiceConfig(o)
		}
		if exitCode(err) != tc.code || err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q, env %v: %v (exit %d); want exit %d and %q", tc.args, tc.env, err, exitCode(err), tc.code, tc.want)
		}
	}
}
