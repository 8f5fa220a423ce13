package worker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/registry"

	"github.com/idemkit/idem/dedupe"
)

// Lifetime is one set of windows the lifetime invariant compares, and what they
// belong to ("consumer charges", "ingress", or a consumer another process runs:
// "consumer audit (registered, not run here)").
type Lifetime struct {
	For string
	dedupe.Lifetimes
}

// judgement is what the lifetime invariant found for one stream MaxAge.
type judgement struct {
	maxAge    time.Duration
	lifetimes []Lifetime
	// violations are the broken rules, one per window set, each naming its numbers;
	// fixes say what to change for the ones this worker does not configure.
	violations []string
	fixes      []string
	// shortest is the shortest inbox key lifetime judged (0: no consumer), which
	// the stream's MaxAge must stay under.
	shortest time.Duration
}

func (j judgement) ok() bool { return len(j.violations) == 0 }

// streamBound reports whether the stream's MaxAge is among the causes: only a
// shorter MaxAge (set on the stream itself, when it exists) repairs it.
func (j judgement) streamBound() bool {
	return j.shortest > 0 && (j.maxAge <= 0 || j.maxAge >= j.shortest)
}

func (j judgement) err() error {
	if j.ok() {
		return nil
	}
	return errors.New(strings.Join(append(append([]string(nil), j.violations...), j.fixes...), "; "))
}

// judgeLifetimes checks, for every consumer of the stream in the installation and
// for the ingress, that a key is remembered longer than any window in which its
// intent can still arrive: the stream's MaxAge, the consumer's redelivery horizon,
// the clients' re-send horizon. This worker's consumers are judged by their
// configuration (their registry entries may be older); the others by what they
// registered, since a message the relay publishes reaches them too, and the
// reconciler re-drives it to them.
func (w *Worker) judgeLifetimes(maxAge time.Duration, registered []registry.Consumer) judgement {
	var requests time.Duration
	if w.ingress != nil {
		requests = w.ingress.Config().KeyLifetime
	}
	j := judgement{maxAge: maxAge}
	own := map[string]bool{}
	for _, c := range w.consumers {
		cc := c.Config()
		own[cc.Name] = true
		j.lifetimes = append(j.lifetimes, Lifetime{For: "consumer " + cc.Name, Lifetimes: dedupe.Lifetimes{
			InboxKey:     cc.KeyLifetime,
			RequestKey:   requests,
			StreamMaxAge: maxAge,
			Redelivery:   cc.RedeliveryHorizon(),
			ClientResend: w.cfg.ClientResendHorizon,
		}})
	}
	if len(j.lifetimes) == 0 && w.ingress != nil {
		j.lifetimes = append(j.lifetimes, Lifetime{For: "ingress", Lifetimes: dedupe.Lifetimes{RequestKey: requests, ClientResend: w.cfg.ClientResendHorizon}})
	}
	ownCount := len(j.lifetimes)
	var names []string // of the registered consumers judged, in order
	for _, c := range registered {
		if own[c.Name] || c.Stream != w.inst.Stream().Name {
			continue
		}
		names = append(names, c.Name)
		j.lifetimes = append(j.lifetimes, Lifetime{For: "consumer " + c.Name + " (registered, not run here)", Lifetimes: dedupe.Lifetimes{
			InboxKey:     c.KeyLifetime,
			StreamMaxAge: maxAge,
			Redelivery:   c.Redelivery,
			ClientResend: w.cfg.ClientResendHorizon,
		}})
	}
	var others []string
	for i, l := range j.lifetimes {
		if l.InboxKey > 0 && (j.shortest == 0 || l.InboxKey < j.shortest) {
			j.shortest = l.InboxKey
		}
		if err := l.Check(); err != nil {
			j.violations = append(j.violations, fmt.Sprintf("%s: %v", l.For, err))
			if i >= ownCount {
				others = append(others, names[i-ownCount])
			}
		}
	}
	if len(others) > 0 {
		j.fixes = append(j.fixes, fmt.Sprintf("%s registered by another process of this installation: fix its configuration and restart it (it registers itself again), or, if it was retired, remove it from the registry (consumer.Forget)",
			strings.Join(others, ", ")))
	}
	return j
}

// registered lists the consumers registered in the installation.
func (w *Worker) registered(ctx context.Context) ([]registry.Consumer, error) {
	return registry.Registered(ctx, w.pool, w.inst.Schema())
}

// streamEditError is the refusal for an existing stream whose MaxAge breaks the
// invariant: a configured MaxAge is applied only when the worker creates the
// stream, so restarting with a corrected configuration cannot repair it; the stream
// itself must be edited.
func (w *Worker) streamEditError(name string, j judgement) error {
	msg := fmt.Sprintf("stream %s: %v", name, j.err())
	if j.streamBound() {
		want := w.inst.Stream().WithDefaults().MaxAge
		if want >= j.shortest {
			want = j.shortest / 3
		}
		have := "MaxAge " + j.maxAge.String()
		if j.maxAge <= 0 {
			have = "unlimited MaxAge"
		}
		msg += fmt.Sprintf("; the stream itself must be edited, from its %s to one shorter than %s (a configured MaxAge, %s here, applies only when the worker creates the stream): nats stream edit %s --max-age %s, or UpdateStream through the JetStream API",
			have, j.shortest, w.inst.Stream().WithDefaults().MaxAge, name, cliDuration(want))
	}
	return errors.New(msg)
}

// cliDuration formats d for the nats CLI's --max-age ("24h", "90m", "45s").
func cliDuration(d time.Duration) string {
	switch {
	case d >= time.Hour && d%time.Hour == 0:
		return fmt.Sprintf("%dh", d/time.Hour)
	case d >= time.Minute && d%time.Minute == 0:
		return fmt.Sprintf("%dm", d/time.Minute)
	default:
		return fmt.Sprintf("%ds", max(1, int64(d/time.Second)))
	}
}
