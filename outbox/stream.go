package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
)

// StreamConfig describes the IDEM stream. The zero value means the defaults.
type StreamConfig struct {
	// MaxAge is how long the stream keeps a message (default 24h). It must be shorter
	// than the inbox key lifetime: a message older than every remembered key would
	// run its effect again if redelivered.
	MaxAge time.Duration
	// Duplicates is JetStream's Msg-Id de-duplication window (default 2m).
	Duplicates time.Duration
	// Replicas (default 1).
	Replicas int
}

// DefaultStreamMaxAge is the stream's default MaxAge.
const DefaultStreamMaxAge = 24 * time.Hour

func (c StreamConfig) withDefaults() StreamConfig {
	if c.MaxAge == 0 {
		c.MaxAge = DefaultStreamMaxAge
	}
	if c.Duplicates == 0 {
		c.Duplicates = 2 * time.Minute
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	return c
}

// EnsureStream creates stream IDEM (subjects idem.>) when it is absent and returns
// it. An existing stream is left as it is: its operator may have tuned it.
func EnsureStream(ctx context.Context, js jetstream.JetStream, cfg StreamConfig) (jetstream.Stream, error) {
	s, err := js.Stream(ctx, idem.StreamName)
	if err == nil {
		return s, nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("outbox: look up stream %s: %w", idem.StreamName, err)
	}
	cfg = cfg.withDefaults()
	s, err = js.CreateStream(ctx, jetstream.StreamConfig{
		Name:       idem.StreamName,
		Subjects:   []string{idem.StreamSubjects},
		Storage:    jetstream.FileStorage,
		MaxAge:     cfg.MaxAge,
		Duplicates: cfg.Duplicates,
		Replicas:   cfg.Replicas,
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		// Another worker created it between our look-up and create.
		return js.Stream(ctx, idem.StreamName)
	}
	if err != nil {
		return nil, fmt.Errorf("outbox: create stream %s: %w", idem.StreamName, err)
	}
	return s, nil
}
