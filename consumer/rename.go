package consumer

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/registry"
)

// ErrLikelyRenamed is matched by the error Run returns for a consumer that looks
// like a rename (see Config.Start): a new name with the stream and filter of a
// registered consumer that has settled messages; its message names them and the
// ways out.
var ErrLikelyRenamed = errors.New("consumer: likely renamed")

// likelyRenamedError refuses a consumer that looks like a rename; it matches
// ErrLikelyRenamed.
type likelyRenamedError struct {
	// Name is the refused consumer's; From the registered consumers of its stream
	// and filter it looks renamed from.
	Name string
	From []string
}

// Error names the old consumers and the ways out.
func (e *likelyRenamedError) Error() string {
	old := strings.Join(e.From, ", ")
	one := "OLD"
	if len(e.From) == 1 {
		one = e.From[0]
	}
	return fmt.Sprintf("consumer: likely renamed: %s is new to this installation, with the stream and filter of %s, which settled messages the stream may still hold; "+
		"backfilling would run them all again under a name whose inbox is empty. "+
		"If this is a rename, stop every worker of %s and run `worker consumers rename %s %s` (or consumer.Rename) so %s keeps its inbox; "+
		"if %s is retired, `worker consumers forget %s` (or consumer.Forget) first; "+
		"if %s is another consumer of the same messages, set its Config.Start explicitly: StartBackfill to run what the stream holds, StartNew to start with what is published from now on",
		e.Name, old, old, one, e.Name, e.Name, old, one, e.Name)
}

// Is makes the error match ErrLikelyRenamed.
func (e *likelyRenamedError) Is(target error) bool { return target == ErrLikelyRenamed }

// refuseRename returns a *likelyRenamedError for a consumer with the default Start
// that looks like a rename. A name with a durable consumer or a registration is a
// restart, and never refused.
func (c *Consumer) refuseRename(ctx context.Context) error {
	if c.cfg.Start != StartDefault || c.renameBackfills {
		return nil
	}
	from, err := registry.LikelyRenamedFrom(ctx, c.pool, c.inst.Schema(), registry.Consumer{Name: c.cfg.Name, Stream: c.stream, FilterSubject: c.cfg.Subject})
	if err != nil {
		return fmt.Errorf("consumer %s: %w", c.cfg.Name, err)
	}
	if len(from) == 0 {
		return nil
	}
	_, err = c.js.Consumer(ctx, c.stream, c.cfg.Name)
	switch {
	case err == nil, errors.Is(err, jetstream.ErrInvalidConsumerName):
		return nil // a restart; or a name the broker refuses when it is bound
	case !errors.Is(err, jetstream.ErrConsumerNotFound) && !errors.Is(err, jetstream.ErrStreamNotFound):
		return fmt.Errorf("consumer %s: look up its durable consumer: %w", c.cfg.Name, err)
	}
	return &likelyRenamedError{Name: c.cfg.Name, From: from}
}
