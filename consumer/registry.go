package consumer

import (
	"context"
	"fmt"

	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/registry"
)

// ErrStillRunning is wrapped by Rename's error when the consumer to rename was
// seen lately: a consumer must be stopped everywhere before it is renamed.
var ErrStillRunning = registry.ErrStillRunning

// Rename gives a registered consumer a new name and keeps everything it knows:
// its inbox rows, attempts and dead letters move to the new name with its
// registry entry, so the renamed consumer folds what it settled under the old
// name. Stop every worker running the old name first (one seen within the last
// five minutes is refused with ErrStillRunning unless force), then deploy the new
// name. The old name's JetStream durable consumer is left alone: delete it (the
// reference binary's `worker consumers rename` does). It fails if the new name is
// registered already.
func Rename(ctx context.Context, inst *install.Installation, from, to string, force bool) error {
	if err := registry.Rename(ctx, inst.Pool(), inst.Schema(), from, to, force); err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	return nil
}

// Forget removes a retired consumer from the installation's registry: until then
// every intent it reads waits for it, and is alerted once past its horizon. It
// reports whether the name was registered. A consumer that still runs registers
// itself again when it restarts.
func Forget(ctx context.Context, inst *install.Installation, name string) (bool, error) {
	ok, err := registry.Forget(ctx, inst.Pool(), inst.Schema(), name)
	if err != nil {
		return false, fmt.Errorf("consumer: %w", err)
	}
	return ok, nil
}
