package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
)

// StreamConfig describes the user's stream. Name and Subjects are required; the
// zero value of every other field means its default.
type StreamConfig struct {
	// Name of the JetStream stream, e.g. "ORDERS". Required.
	Name string
	// Subjects the stream stores, e.g. []string{"orders.>"}. Required.
	Subjects []string
	// MaxAge is how long the stream keeps a message (default DefaultStreamMaxAge).
	// It must be shorter than the inbox key lifetime: a message older than every
	// remembered key would run its effect again if redelivered. It applies when
	// EnsureStream creates the stream; an existing stream keeps its own.
	MaxAge time.Duration
	// Duplicates is JetStream's Msg-Id de-duplication window (default 2m).
	Duplicates time.Duration
	// Replicas (default 1).
	Replicas int
	// AllowAtomicPublish lets the stream take atomic batches, which
	// RelayConfig.AtomicPublish sends (nats-server 2.12 or later).
	AllowAtomicPublish bool
}

// DefaultStreamMaxAge is the stream's default MaxAge.
const DefaultStreamMaxAge = 24 * time.Hour

// DefaultDuplicateWindow is the stream's default Msg-Id de-duplication window.
const DefaultDuplicateWindow = 2 * time.Minute

// Validate reports a configuration EnsureStream cannot use.
func (c StreamConfig) Validate() error {
	switch {
	case c.Name == "":
		return errors.New("outbox: stream: Name is required")
	case len(c.Subjects) == 0:
		return fmt.Errorf("outbox: stream %s: Subjects are required", c.Name)
	case c.MaxAge < 0, c.Duplicates < 0, c.Replicas < 0:
		return fmt.Errorf("outbox: stream %s: MaxAge, Duplicates and Replicas must not be negative", c.Name)
	}
	for _, f := range c.Subjects {
		if err := idem.ValidateFilter(f); err != nil {
			return fmt.Errorf("outbox: stream %s: %w", c.Name, err)
		}
	}
	return nil
}

// WithDefaults returns c with zero fields replaced by their defaults.
func (c StreamConfig) WithDefaults() StreamConfig {
	if c.MaxAge == 0 {
		c.MaxAge = DefaultStreamMaxAge
	}
	if c.Duplicates == 0 {
		c.Duplicates = DefaultDuplicateWindow
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	return c
}

// EnsureStream creates the stream when it is absent and returns it. An existing
// stream is left as it is: its operator may have tuned it (the worker reads its real
// MaxAge for the lifetime invariant).
func EnsureStream(ctx context.Context, js jetstream.JetStream, cfg StreamConfig) (jetstream.Stream, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s, err := js.Stream(ctx, cfg.Name)
	if err == nil {
		return s, nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("outbox: look up stream %s: %w", cfg.Name, err)
	}
	cfg = cfg.WithDefaults()
	s, err = js.CreateStream(ctx, jetstream.StreamConfig{
		Name:       cfg.Name,
		Subjects:   cfg.Subjects,
		Storage:    jetstream.FileStorage,
		MaxAge:     cfg.MaxAge,
		Duplicates: cfg.Duplicates,
		Replicas:   cfg.Replicas,

		AllowAtomicPublish: cfg.AllowAtomicPublish,
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		// Another worker created it between our look-up and create.
		return js.Stream(ctx, cfg.Name)
	}
	if err != nil {
		return nil, fmt.Errorf("outbox: create stream %s: %w", cfg.Name, err)
	}
	return s, nil
}
