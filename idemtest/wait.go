package idemtest

// Waiting on conditions, never on sleeps: outcome events and a drained consumer.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
)

// pollEvery is how often a wait re-reads its condition.
const pollEvery = 20 * time.Millisecond

// settled waits until at least n deliveries settled since base (processed,
// duplicate or dead-lettered) and the durable consumer is drained: nothing
// pending, nothing delivered and unacknowledged (a delivery handed back with a
// delay counts as unacknowledged). It returns "" when both hold, or why the wait
// failed; a failed wait halts the check.
func (ck *check) settled(ctx context.Context, base counts, n int, what string) (string, error) {
	deadline := time.Now().Add(ck.p.timeout)
	for {
		if ck.out.since(base).settled() >= n {
			drained, err := ck.drained(ctx)
			if err != nil {
				return "", err
			}
			if drained {
				return "", nil
			}
		}
		if r := ck.run; r != nil {
			select {
			case <-r.exited:
				ck.halt = true
				return fmt.Sprintf("the consumer stopped while waiting for %s: %v", what, r.err), nil
			default:
			}
		}
		if time.Now().After(deadline) {
			ck.halt = true
			return fmt.Sprintf("timed out after %s waiting for %s (%s)", ck.p.timeout, what, ck.durableState(ctx)), nil
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(pollEvery):
		}
	}
}

// drained reports whether the durable consumer has nothing left to do.
func (ck *check) drained(ctx context.Context) (bool, error) {
	c, err := ck.env.JS.Consumer(ctx, ck.p.stream.Name, ck.p.cfg.Name)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		return false, nil // not created yet
	}
	if err != nil {
		return false, fmt.Errorf("durable consumer %s: %w", ck.p.cfg.Name, err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		return false, fmt.Errorf("durable consumer %s: %w", ck.p.cfg.Name, err)
	}
	return info.NumPending == 0 && info.NumAckPending == 0, nil
}

func (ck *check) durableState(ctx context.Context) string {
	c, err := ck.env.JS.Consumer(ctx, ck.p.stream.Name, ck.p.cfg.Name)
	if err != nil {
		return "durable consumer: " + err.Error()
	}
	info, err := c.Info(ctx)
	if err != nil {
		return "durable consumer: " + err.Error()
	}
	return fmt.Sprintf("durable consumer: %d pending, %d unacknowledged", info.NumPending, info.NumAckPending)
}

// counts is a snapshot of outcome counts.
type counts map[idem.Outcome]int

func (c counts) settled() int {
	return c[idem.OutcomeProcessed] + c[idem.OutcomeDuplicate] + c[idem.OutcomeDeadLettered]
}

func (c counts) String() string {
	if len(c) == 0 {
		return "none"
	}
	names := make([]idem.Outcome, 0, len(c))
	for k := range c {
		names = append(names, k)
	}
	slices.Sort(names)
	parts := make([]string, len(names))
	for i, k := range names {
		parts[i] = fmt.Sprintf("%s=%d", k, c[k])
	}
	return strings.Join(parts, " ")
}

// outcomes counts the consumer's events: the wait conditions of the scenarios.
type outcomes struct {
	name string
	mu   sync.Mutex
	n    counts
}

func (o *outcomes) observe(e idem.Event) {
	if e.Component != idem.ComponentConsumer || e.Name != o.name {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n == nil {
		o.n = counts{}
	}
	o.n[e.Outcome] += e.Count
}

func (o *outcomes) snapshot() counts {
	o.mu.Lock()
	defer o.mu.Unlock()
	c := make(counts, len(o.n))
	for k, v := range o.n {
		c[k] = v
	}
	return c
}

// since returns the counts added after base.
func (o *outcomes) since(base counts) counts {
	c := o.snapshot()
	for k, v := range base {
		if c[k] -= v; c[k] == 0 {
			delete(c, k)
		}
	}
	return c
}
