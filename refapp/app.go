package refapp

import (
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
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
	// Email, when Email.Addr is set, runs the email consumer sending through that
	// SMTP server. Without it emails stay queued in the stream.
	Email EmailConfig

	// Roles: every worker runs all of them unless disabled, so several workers can
	// split the work (two relays, three consumer workers, ...).
	DisableIngress, DisableRelay, DisableConsumers, DisableRetention bool

	// Schema of the idem_* tables (default public); NoMigrate leaves migrations
	// (idem's and the application's) to the operator.
	Schema    string
	NoMigrate bool

	// Tuning of the parts; names, subjects and handlers are filled in.
	Stream    outbox.StreamConfig
	Charges   consumer.Config
	Emails    consumer.Config
	Relay     outbox.RelayConfig
	Ingress   producer.Config
	Retention worker.RetentionConfig
	// ClientResendHorizon (default worker.DefaultClientResendHorizon).
	ClientResendHorizon time.Duration

	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// TracerProvider records ingress and consumer spans (default: none; the trace
	// context is still carried through the outbox headers).
	TracerProvider trace.TracerProvider
	// Observer is told every component's events, after the metrics.
	Observer idem.Observer
}

// WorkerConfig is the worker.Config of the application: stream IDEM on idem.>, the
// charge consumer and (with Email.Addr) the email consumer, the relay, the ingress
// middleware and retention, each as enabled.
func (c Config) WorkerConfig() (worker.Config, error) {
	stream := c.Stream
	stream.Name, stream.Subjects = StreamName, []string{StreamSubjects}
	wc := worker.Config{
		Schema:              c.Schema,
		NoMigrate:           c.NoMigrate,
		Stream:              stream,
		Relay:               c.Relay,
		DisableRelay:        c.DisableRelay,
		Retention:           c.Retention,
		DisableRetention:    c.DisableRetention,
		ClientResendHorizon: c.ClientResendHorizon,
		Logger:              c.Logger,
		TracerProvider:      c.TracerProvider,
		Observer:            c.Observer,
	}
	if !c.DisableIngress {
		ic := c.Ingress
		wc.Ingress = &ic
	}
	if !c.DisableConsumers {
		charges := c.Charges
		charges.Name, charges.Subject = ChargeConsumer, SubjectCharge
		charges.Handler, charges.BatchHandler, charges.External = nil, ChargeHandler{}, nil
		wc.Consumers = append(wc.Consumers, charges)
		if c.Email.Addr != "" {
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
