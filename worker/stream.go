package worker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/outbox"
)

// checkStream judges the real stream's configuration against what the worker needs,
// at start. It returns an error for a stream that would lose or misplace messages
// beyond what the reconciler repairs, and warnings for settings that cost re-drives
// (or that lose messages outright when no reconciler runs, and then are errors).
func checkStream(info *jetstream.StreamInfo, want outbox.StreamConfig, filters map[string]string, reconciling bool) (warnings []string, err error) {
	sc := info.Config
	var problems []string
	if sc.Retention == jetstream.WorkQueuePolicy {
		problems = append(problems, "its retention is WorkQueue, which deletes a message once any consumer acks it and allows one consumer per subject; use Limits (or Interest)")
	}
	for _, f := range want.Subjects {
		if !coveredBy(sc.Subjects, f) {
			problems = append(problems, fmt.Sprintf("it stores %q, which does not cover the worker's subjects %q: the relay could not publish them", sc.Subjects, f))
		}
	}
	for name, f := range filters {
		if !coveredBy(sc.Subjects, f) {
			problems = append(problems, fmt.Sprintf("it stores %q, which does not cover consumer %s's filter %q", sc.Subjects, name, f))
		}
	}
	var lossy []string
	if sc.Discard == jetstream.DiscardOld && (sc.MaxMsgs > 0 || sc.MaxBytes > 0 || sc.MaxMsgsPerSubject > 0) {
		lossy = append(lossy, "it discards its oldest messages when full (Discard Old with MaxMsgs, MaxBytes or MaxMsgsPerSubject): unconsumed messages are dropped under load; use Discard New, so the relay waits instead")
	}
	if sc.Storage == jetstream.MemoryStorage {
		lossy = append(lossy, "it is kept in memory: a broker restart empties it")
	}
	if reconciling {
		for _, l := range lossy {
			warnings = append(warnings, fmt.Sprintf("stream %s: %s (the reconciler re-drives what is lost, at a cost)", sc.Name, l))
		}
	} else {
		problems = append(problems, lossy...)
	}
	if want.Replicas > 0 && sc.Replicas < want.Replicas {
		warnings = append(warnings, fmt.Sprintf("stream %s has %d replicas, fewer than the %d configured (an existing stream is left as its operator made it)", sc.Name, sc.Replicas, want.Replicas))
	}
	if len(problems) > 0 {
		return warnings, fmt.Errorf("stream %s cannot be used: %s", sc.Name, strings.Join(problems, "; "))
	}
	return warnings, nil
}

// coveredBy reports whether every subject matching filter f is stored under one of
// the stream's subject filters.
func coveredBy(streamSubjects []string, f string) bool {
	for _, s := range streamSubjects {
		if filterCovers(s, f) {
			return true
		}
	}
	return false
}

// filterCovers reports whether every subject matching inner matches outer, by NATS
// rules ("*" one token, a final ">" one or more).
func filterCovers(outer, inner string) bool {
	ot, it := strings.Split(outer, "."), strings.Split(inner, ".")
	for i, o := range ot {
		if o == ">" {
			return len(it) > i
		}
		if i >= len(it) {
			return false
		}
		switch {
		case it[i] == ">":
			return false // inner reaches subjects outer's fixed length cannot
		case o == "*":
		case o != it[i]:
			return false
		}
	}
	return len(ot) == len(it)
}

// streamKeeper recreates the worker's stream when it goes missing (an operator
// deleted it, or a broker lost its store), so that the relay has somewhere to
// publish and the consumers can recreate their durable consumers; the reconciler
// re-drives what was lost with it. While it cannot, Health says so.
type streamKeeper struct {
	w        *Worker
	interval time.Duration
	health   atomic.Pointer[error]
}

func (k *streamKeeper) run(ctx context.Context) error {
	t := time.NewTicker(k.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		k.check(ctx)
	}
}

func (k *streamKeeper) check(ctx context.Context) {
	w := k.w
	_, err := w.js.Stream(ctx, w.cfg.Stream.Name)
	switch {
	case err == nil:
		k.health.Store(nil)
		return
	case !errors.Is(err, jetstream.ErrStreamNotFound):
		if ctx.Err() == nil {
			w.log.WarnContext(ctx, "worker: cannot check the stream", "stream", w.cfg.Stream.Name, "err", err)
		}
		return // the broker's own trouble, which readiness reports as such
	}
	if _, err := outbox.EnsureStream(ctx, w.js, w.cfg.Stream); err != nil {
		problem := fmt.Errorf("stream %s: missing, and recreating it failed", w.cfg.Stream.Name)
		k.health.Store(&problem)
		w.log.ErrorContext(ctx, "worker: stream missing; recreating it failed", "stream", w.cfg.Stream.Name, "err", err)
		return
	}
	k.health.Store(nil)
	w.log.WarnContext(ctx, "worker: stream was missing; recreated it (the reconciler re-drives what it held)", "stream", w.cfg.Stream.Name)
}

// Health is why the stream is unusable, or nil.
func (k *streamKeeper) Health() error {
	if p := k.health.Load(); p != nil {
		return *p
	}
	return nil
}
