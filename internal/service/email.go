package service

import (
	"context"
	"errors"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/demo"
	"github.com/idemkit/idem/internal/faults"
)

// EmailConsumerName is the durable consumer (and inbox consumer) of emails.
const EmailConsumerName = "emails"

// emailConfig is the idem.emails.send consumer: an external effect (SMTP cannot
// join a Postgres transaction), with the worker's logger, metrics and fault points.
func (s *Service) emailConfig(smtpAddr string) (consumer.ExternalConfig, error) {
	if smtpAddr == "" {
		return consumer.ExternalConfig{}, errors.New("service: the email consumer needs an SMTP address (--smtp-addr, IDEM_SMTP_ADDR)")
	}
	h, err := demo.NewEmailHandler(demo.EmailConfig{Addr: smtpAddr})
	if err != nil {
		return consumer.ExternalConfig{}, err
	}
	ec := s.cfg.EmailConsumer
	ec.Name, ec.Subject, ec.Handler = EmailConsumerName, idem.SubjectEmail, h
	if ec.Logger == nil {
		ec.Logger = s.log
	}
	if ec.TracerProvider == nil {
		ec.TracerProvider = s.cfg.TracerProvider
	}
	if s.Metrics != nil {
		ec.OnOutcome = s.Metrics.ConsumerOutcome
	}
	if s.cfg.Faults.Armed(faults.EmailAfterSend) {
		ec.AfterPerform = func(_ context.Context, _ *consumer.Delivery, err error) error {
			if err == nil { // only after a send the server accepted
				s.cfg.Faults.Hit(faults.EmailAfterSend)
			}
			return nil
		}
	}
	return ec, nil
}

// startEmails runs the email consumer until ctx is cancelled.
func (s *Service) startEmails(ctx context.Context, smtpAddr string) error {
	ec, err := s.emailConfig(smtpAddr)
	if err != nil {
		return err
	}
	x, err := consumer.NewExternal(s.Pool, s.JS, ec)
	if err != nil {
		return err
	}
	s.log.Info("email consumer sends through SMTP", "addr", smtpAddr)
	s.run("emails consumer", func() error { return x.Run(ctx) })
	return nil
}
