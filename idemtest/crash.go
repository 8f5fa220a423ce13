package idemtest

// The simulated crashes of the second and third scenarios.

import (
	"context"
	"errors"
	"sync"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/faults"
)

// shot makes the work on one key stop once, as if the process died there.
type shot struct {
	key   string
	mu    sync.Mutex
	fired bool
}

var errCrash = errors.New("idemtest: simulated crash")

// fire reports whether keys hold the shot's key and the shot had not fired yet,
// and marks it fired.
func (s *shot) fire(keys ...string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fired {
		return false
	}
	for _, k := range keys {
		if k == s.key {
			s.fired = true
			return true
		}
	}
	return false
}

func (s *shot) hasFired() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fired
}

// point adapts the shot to a fault point.
func (s *shot) point(ctx context.Context, keys []string) error {
	if s.fire(keys...) {
		return errCrash
	}
	return nil
}

// armFaults aims the crash scenarios at their own fresh keys, so no other
// delivery is disturbed whatever batches the consumer forms.
func (ck *check) armFaults() {
	ck.before, ck.after = &shot{key: ck.p.keyBefore}, &shot{key: ck.p.keyAfter}
	ck.fs = faults.New()
	if ck.p.external {
		// LostResponse is not a fault point of the engine: the handler itself
		// fails after its effect (see lostResponse).
		ck.fs.Func(faults.ExternalAfterPerform, ck.after.point)
	} else {
		ck.fs.Func(faults.EffectBeforeCommit, ck.before.point)
		ck.fs.Func(faults.ConsumerAfterCommit, ck.after.point)
	}
	if ck.env.skipClaim {
		ck.fs.Switch(faults.SkipInboxClaim)
	}
}

// lostResponse wraps an External handler: on the first attempt at its shot's key
// the effect is performed, then the handler reports an error, as when the
// downstream executed a request whose response was lost (a timeout).
type lostResponse struct {
	h    consumer.ExternalHandler
	shot *shot
}

func (l lostResponse) Perform(ctx context.Context, e *consumer.Effect) ([]byte, error) {
	res, err := l.h.Perform(ctx, e)
	if err == nil && l.shot.fire(e.Key) {
		return nil, errors.New("idemtest: simulated lost response after the effect was performed")
	}
	return res, err
}
