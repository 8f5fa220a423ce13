package install

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/natssubject"
)

// Stream describes the installation's stream. Name and Subjects are required; the
// zero value of every other field means its default.
type Stream struct {
	// Name of the JetStream stream, e.g. "ORDERS". Required.
	Name string
	// Subjects the stream stores, e.g. []string{"orders.>"}. Required. The outbox
	// refuses at enqueue a subject none of them matches.
	Subjects []string
	// MaxAge is how long the stream keeps a message (default 24h).
	// It must be shorter than every consumer's inbox key lifetime: a message older
	// than every remembered key would run its effect again if redelivered. It
	// applies when the stream is created; an existing stream keeps its own, and
	// the worker checks that one.
	MaxAge time.Duration
	// Duplicates is JetStream's Msg-Id de-duplication window (default 2m).
	Duplicates time.Duration
	// Replicas (default 1).
	Replicas int
	// AllowAtomicPublish lets the stream take atomic batches, which the relay
	// sends with worker.RelayConfig.AtomicPublish (nats-server 2.12 or later).
	AllowAtomicPublish bool
}

// defaultDuplicateWindow is the stream's default Msg-Id de-duplication window.
const defaultDuplicateWindow = 2 * time.Minute

// Validate reports a stream the installation cannot use.
func (s Stream) Validate() error {
	switch {
	case s.Name == "":
		return errors.New("install: Stream.Name is required")
	case len(s.Subjects) == 0:
		return fmt.Errorf("install: stream %s: Subjects are required", s.Name)
	case s.MaxAge < 0, s.Duplicates < 0, s.Replicas < 0:
		return fmt.Errorf("install: stream %s: MaxAge, Duplicates and Replicas must not be negative", s.Name)
	}
	for _, f := range s.Subjects {
		if err := natssubject.ValidateFilter(f); err != nil {
			return fmt.Errorf("install: stream %s: %w", s.Name, err)
		}
	}
	return nil
}

// WithDefaults returns s with zero fields replaced by their defaults: the stream
// as the worker creates it.
func (s Stream) WithDefaults() Stream {
	if s.MaxAge == 0 {
		s.MaxAge = defaultStreamMaxAge
	}
	if s.Duplicates == 0 {
		s.Duplicates = defaultDuplicateWindow
	}
	if s.Replicas == 0 {
		s.Replicas = 1
	}
	return s
}

// EnsureStream creates the installation's stream when it is absent and returns
// it. An existing stream is left as it is: its operator may have tuned it (the
// worker reads its real MaxAge for the lifetime invariant).
func (i *Installation) EnsureStream(ctx context.Context) (jetstream.Stream, error) {
	cfg := i.cfg.Stream
	if i.js == nil {
		return nil, fmt.Errorf("install: stream %s: the installation has no NATS connection", cfg.Name)
	}
	s, err := i.js.Stream(ctx, cfg.Name)
	if err == nil {
		return s, nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("install: look up stream %s: %w", cfg.Name, err)
	}
	cfg = cfg.WithDefaults()
	s, err = i.js.CreateStream(ctx, jetstream.StreamConfig{
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
		return i.js.Stream(ctx, cfg.Name)
	}
	if err != nil {
		return nil, fmt.Errorf("install: create stream %s: %w", cfg.Name, err)
	}
	return s, nil
}
