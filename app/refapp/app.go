package refapp

import (
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/producer"
	"github.com/idemkit/idem/worker"
)

// The reference application's topology: part of its public contract.
const (
	// StreamName is the JetStream stream of the application.
	StreamName = "IDEM"
	// StreamSubjects is the stream's subject filter.
	StreamSubjects = "idem.>"
	// SubjectCharge carries POST /v1/payments.
	SubjectCharge = "idem.payments.charge"
	// SubjectEmail carries POST /v1/emails.
	SubjectEmail = "idem.emails.send"
	// ChargeConsumer is the durable consumer (and inbox consumer) of charges.
	ChargeConsumer = "charges"
	// EmailConsumer is the durable consumer (and inbox consumer) of emails.
	EmailConsumer = "emails"
)

// Config configures the reference application. The zero value runs every role with
// the defaults and no email consumer.
type Config struct {
	// HTTPAddr is the HTTP listen address of Start (default 127.0.0.1:8080; ":0"
	// picks a port).
	HTTPAddr string
	// MetricsAddr, when set, serves /metrics on a listener of its own at this
	// address, and not on HTTPAddr: the API can face clients while the metrics
	// stay on an internal interface. Default: /metrics on HTTPAddr.
	MetricsAddr string
	// HTTP bounds the HTTP server's waits and headers.
	HTTP HTTPConfig
	// Console, when Enabled, serves the operator console (package console) at
	// /console on the listener of /metrics: MetricsAddr when set, else HTTPAddr.
	Console ConsoleConfig
	// PayPage serves the payment page at /pay on HTTPAddr, the listener of POST
	// /v1/payments (one origin): a demonstration of the browser client, with
	// switches that drop or hold responses and wipe the client's journal. Its
	// GET /pay/ledger shows the ledger rows of any key or account to whoever
	// reaches the listener, so keep it off where clients you do not trust connect.
	// It needs the ingress role.
	PayPage bool
	// Email, when it names an SMTP server (Email.URL, or the deprecated
	// Email.Addr), runs the email consumer sending through that server. Without
	// one emails stay queued in the stream.
	Email EmailConfig

	// Roles: every worker runs all of them unless disabled, so several workers can
	// split the work (two relays, three consumer workers, ...).
	DisableIngress, DisableRelay, DisableConsumers, DisableRetention bool
	// DisableReconciler runs the relay without the reconciler (see
	// worker.Config.DisableReconciler): the negative control of the chaos tests.
	DisableReconciler bool

	// Schema of the idem_* tables (default public); NoMigrate leaves migrations
	// (idem's and the application's) to the operator.
	Schema    string
	NoMigrate bool

	// Tuning of the parts; names, subjects and handlers are filled in.
	Stream    install.Stream
	Charges   consumer.Config
	Emails    consumer.Config
	Relay     worker.RelayConfig
	Reconcile worker.ReconcileConfig
	Ingress   producer.Config
	Retention worker.RetentionConfig
	// ClientResendHorizon (default 24h, as worker.Config.ClientResendHorizon).
	ClientResendHorizon time.Duration

	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// TracerProvider records ingress and consumer spans (default: none; the trace
	// context is still carried through the outbox headers).
	TracerProvider trace.TracerProvider
	// Observer is told every component's events, after the metrics.
	Observer idem.Observer
}

// HTTPConfig bounds what one client can hold of the HTTP server. The zero value of
// every field means its default. Requests in flight are bounded separately, by the
// ingress (producer.Config.MaxInFlight, set from the database pool by the worker):
// beyond it a request gets 503 with Retry-After.
type HTTPConfig struct {
	// ReadHeaderTimeout bounds reading a request's headers (default 10s).
	ReadHeaderTimeout time.Duration
	// ReadTimeout bounds reading a whole request, body included (default 30s): a
	// client that trickles its body cannot hold a connection forever.
	ReadTimeout time.Duration
	// WriteTimeout bounds a request from the end of its headers to the end of the
	// response (default 30s). It must exceed the ingress's Wait (5s by default)
	// plus the handler's own time.
	WriteTimeout time.Duration
	// IdleTimeout bounds a keep-alive connection between requests (default 2m).
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds a request's header block (default 64 KiB; 431 beyond).
	MaxHeaderBytes int
}

// ConsoleConfig turns on the operator console and says who may use it. On a
// listener that is not loopback, Start refuses a console without Token or
// BasicUser, and one with them unless AllowPlainHTTP: the application serves no
// TLS, and the token or password would cross the network in the clear.
type ConsoleConfig struct {
	Enabled bool
	// Token, when set, is required (Authorization: Bearer, or the login page).
	Token string
	// BasicUser and BasicPassword, when BasicUser is set, require basic auth.
	BasicUser, BasicPassword string
	// AllowPlainHTTP serves the console with its credentials on a listener that
	// is not loopback. Set it only when a TLS-terminating proxy, or a network you
	// trust, is the only way to that listener.
	AllowPlainHTTP bool
}

func (c HTTPConfig) withDefaults() HTTPConfig {
	if c.ReadHeaderTimeout == 0 {
		c.ReadHeaderTimeout = 10 * time.Second
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = 30 * time.Second
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = 30 * time.Second
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = 2 * time.Minute
	}
	if c.MaxHeaderBytes == 0 {
		c.MaxHeaderBytes = 64 << 10
	}
	return c
}

// InstallConfig is the installation of the application: stream IDEM on idem.>,
// in Schema.
func (c Config) InstallConfig() install.Config {
	stream := c.Stream
	stream.Name, stream.Subjects = StreamName, []string{StreamSubjects}
	return install.Config{Schema: c.Schema, Stream: stream, Logger: c.Logger, TracerProvider: c.TracerProvider, Observer: c.Observer}
}

// WorkerConfig is the worker.Config of the application: the charge consumer and
// (with an SMTP server in Email) the email consumer, the relay, the ingress
// middleware and retention, each as enabled.
func (c Config) WorkerConfig() (worker.Config, error) {
	wc := worker.Config{
		NoMigrate:           c.NoMigrate,
		Relay:               c.Relay,
		DisableRelay:        c.DisableRelay,
		Reconcile:           c.Reconcile,
		DisableReconciler:   c.DisableReconciler,
		Retention:           c.Retention,
		DisableRetention:    c.DisableRetention,
		ClientResendHorizon: c.ClientResendHorizon,
	}
	if !c.DisableIngress {
		ic := c.Ingress
		if ic.Scope == nil {
			// The contract: a client names its tenant in Idempotency-Scope. Run the
			// application behind something that sets or verifies that header.
			ic.ScopeFromHeader = true
		}
		wc.Ingress = &ic
	}
	if !c.DisableConsumers {
		charges := c.Charges
		charges.Name, charges.Subject = ChargeConsumer, SubjectCharge
		charges.Handler, charges.BatchHandler, charges.External = nil, ChargeHandler{}, nil
		wc.Consumers = append(wc.Consumers, charges)
		if c.Email.Enabled() {
			h, err := NewEmailHandler(c.Email)
			if err != nil {
				return worker.Config{}, fmt.Errorf("refapp: %w", err)
			}
			emails := c.Emails
			emails.Name, emails.Subject = EmailConsumer, SubjectEmail
			emails.Handler, emails.BatchHandler, emails.External = nil, nil, h
			wc.Consumers = append(wc.Consumers, emails)
		}
	}
	return wc, nil
}
