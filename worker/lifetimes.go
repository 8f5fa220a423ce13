package worker

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/idem/dedupe"
)

// Lifetime is one set of windows the lifetime invariant compares, and what they
// belong to ("consumer charges", "ingress").
type Lifetime struct {
	For string
	dedupe.Lifetimes
}

// checkLifetimes enforces, for every consumer (and for the ingress), that a key is
// remembered longer than any window in which its intent can still arrive: the
// stream's real MaxAge, the consumer's redelivery horizon, the clients' re-send
// horizon. An operator may have changed the stream since it was created, which is
// why its MaxAge is read, not assumed.
func (w *Worker) checkLifetimes(streamMaxAge time.Duration) ([]Lifetime, error) {
	var requests time.Duration
	if w.ingress != nil {
		requests = w.ingress.Config().KeyLifetime
	}
	var out []Lifetime
	for _, c := range w.consumers {
		cc := c.Config()
		out = append(out, Lifetime{For: "consumer " + cc.Name, Lifetimes: dedupe.Lifetimes{
			InboxKey:     cc.KeyLifetime,
			RequestKey:   requests,
			StreamMaxAge: streamMaxAge,
			Redelivery:   cc.RedeliveryHorizon(),
			ClientResend: w.cfg.ClientResendHorizon,
		}})
	}
	if len(out) == 0 && w.ingress != nil {
		out = append(out, Lifetime{For: "ingress", Lifetimes: dedupe.Lifetimes{RequestKey: requests, ClientResend: w.cfg.ClientResendHorizon}})
	}
	var errs []error
	for _, l := range out {
		if err := l.Check(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", l.For, err))
		}
	}
	return out, errors.Join(errs...)
}
