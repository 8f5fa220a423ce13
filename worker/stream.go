package worker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/registry"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// checkStream judges the real stream's configuration against what the worker needs,
// at start. It returns an error for a stream that would lose or misplace messages
// beyond what the reconciler repairs, and warnings for settings that cost re-drives
// (or that lose messages outright when no reconciler runs, and then are errors).
func checkStream(info *jetstream.StreamInfo, want install.Stream, filters map[string]string, reconciling bool) (warnings []string, err error) {
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

// prepareStream makes the worker's stream ready to use, judging the lifetime
// invariant first: against the configured MaxAge before the stream is created (a
// stream created with a MaxAge the invariant forbids keeps it after the
// configuration is corrected), then against the stream the broker holds, whose
// operator may have set another. Every consumer registered in the installation is
// judged, not only this worker's. A configured MaxAge that differs from the
// stream's is refused when it breaks the invariant (the keeper recreates a lost
// stream with it), and warned about otherwise.
func (w *Worker) prepareStream(ctx context.Context) (*jetstream.StreamInfo, error) {
	name, configured := w.inst.Stream().Name, w.inst.Stream().WithDefaults().MaxAge
	registered, err := w.registered(ctx)
	if err != nil {
		return nil, fmt.Errorf("worker: %w", err)
	}
	info, err := w.streamInfo(ctx)
	if err != nil {
		return nil, err
	}
	if info == nil {
		if j := w.judgeLifetimes(configured, registered); !j.ok() {
			err := fmt.Errorf("worker: refusing to start: stream %s does not exist, and was not created, since its configured MaxAge %s breaks the lifetime invariant: %w", name, configured, j.err())
			if j.streamBound() {
				err = fmt.Errorf("%w; install.Config.Stream.MaxAge must be shorter than %s", err, j.shortest)
			}
			return nil, err
		}
		s, err := w.inst.EnsureStream(ctx)
		if err != nil {
			return nil, fmt.Errorf("worker: %w", err)
		}
		if info, err = s.Info(ctx); err != nil {
			return nil, fmt.Errorf("worker: stream %s: %w", name, err)
		}
	}
	j := w.judgeLifetimes(info.Config.MaxAge, registered)
	if !j.ok() {
		return nil, fmt.Errorf("worker: refusing to start: %w", w.streamEditError(name, j))
	}
	if set := w.inst.Stream().MaxAge; set != 0 && set != info.Config.MaxAge {
		if cj := w.judgeLifetimes(set, registered); !cj.ok() {
			return nil, fmt.Errorf("worker: refusing to start: the configured MaxAge %s differs from stream %s's MaxAge %s and breaks the lifetime invariant (the worker recreates the stream with it if the stream is lost); configure the stream's %s, or any MaxAge the invariant allows: %w",
				set, name, info.Config.MaxAge, info.Config.MaxAge, cj.err())
		}
		w.log.WarnContext(ctx, fmt.Sprintf("worker: stream %s: configured MaxAge %s differs from the stream's MaxAge %s, which stays (an existing stream is left as its operator made it; the configured MaxAge applies when the worker creates it). To apply it: nats stream edit %s --max-age %s",
			name, set, info.Config.MaxAge, name, cliDuration(set)),
			"stream", name, "configured_max_age", set, "stream_max_age", info.Config.MaxAge)
	}
	w.lifetimes, w.keeper.registered = j.lifetimes, registered
	for _, l := range j.lifetimes {
		w.log.InfoContext(ctx, "key lifetimes checked", "for", l.For, "inbox", l.InboxKey, "requests", l.RequestKey,
			"stream_max_age", l.StreamMaxAge, "redelivery_horizon", l.Redelivery, "client_resend", l.ClientResend)
	}
	return info, nil
}

// streamInfo reads the stream's state and configuration from the broker, or nil
// when the stream does not exist.
func (w *Worker) streamInfo(ctx context.Context) (*jetstream.StreamInfo, error) {
	s, err := w.js.Stream(ctx, w.inst.Stream().Name)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("worker: look up stream %s: %w", w.inst.Stream().Name, err)
	}
	return s.CachedInfo(), nil
}

// streamKeeper watches the worker's stream. It recreates it when it goes missing
// (an operator deleted it, or a broker lost its store), so that the relay has
// somewhere to publish and the consumers can recreate their durable consumers; the
// reconciler re-drives what was lost with it. And it re-judges the lifetime
// invariant against the stream's configuration and the registry as they are now:
// an operator may edit the stream's MaxAge, and another process may register a
// consumer, while this worker runs. While the stream is missing or the invariant
// broken, StreamHealth and Health say so, naming the numbers.
type streamKeeper struct {
	w        *Worker
	interval time.Duration
	health   atomic.Pointer[error] // the lifetime invariant
	stream   atomic.Pointer[error] // a missing stream not recreated

	// Only the keeper's goroutine touches these.
	registered []registry.Consumer // as last read: kept while Postgres does not answer
	reported   string              // the violation last logged, so each is logged once
	unread     bool                // the registry could not be read on the last tick
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
	name := w.inst.Stream().Name
	if w.js.Conn().Status() != nats.CONNECTED {
		return // the broker watch has said so; nothing can be checked until it is back
	}
	info, err := w.streamInfo(ctx)
	if err != nil {
		if ctx.Err() == nil {
			w.log.WarnContext(ctx, "worker: cannot check the stream", "stream", name, "err", err)
		}
		return // the broker's own trouble, which readiness reports as such
	}
	k.readRegistry(ctx)
	if info == nil {
		configured := w.inst.Stream().WithDefaults().MaxAge
		if j := w.judgeLifetimes(configured, k.registered); !j.ok() {
			// Recreating it would break the invariant, and the stream would keep
			// the MaxAge: better no stream, and readiness failing, until fixed.
			k.report(ctx, fmt.Errorf("stream %s: missing, and not recreated: its configured MaxAge %s breaks the lifetime invariant: %v", name, configured, j.err()))
			return
		}
		s, err := w.inst.EnsureStream(ctx)
		if err != nil {
			problem := fmt.Errorf("stream %s: missing, and recreating it failed", name)
			k.stream.Store(&problem)
			w.log.ErrorContext(ctx, "worker: stream missing; recreating it failed", "stream", name, "err", err)
			return
		}
		w.log.WarnContext(ctx, "worker: stream was missing; recreated it (the reconciler re-drives what it held)", "stream", name)
		info = s.CachedInfo()
	}
	k.stream.Store(nil)
	j := w.judgeLifetimes(info.Config.MaxAge, k.registered)
	w.mu.Lock()
	w.lifetimes = j.lifetimes
	w.mu.Unlock()
	if !j.ok() {
		k.report(ctx, w.streamEditError(name, j))
		return
	}
	k.report(ctx, nil)
}

// readRegistry refreshes the registry's copy; while Postgres does not answer the
// last one stands (readiness reports Postgres itself).
func (k *streamKeeper) readRegistry(ctx context.Context) {
	reg, err := k.w.registered(ctx)
	if err != nil {
		if !k.unread && ctx.Err() == nil {
			k.w.log.WarnContext(ctx, "worker: cannot read the consumer registry; judging the lifetime invariant by the last one read", "err", err)
		}
		k.unread = true
		return
	}
	k.registered, k.unread = reg, false
}

// report sets Health to problem (nil: healthy) and logs a change once: an
// operator sees each new violation, and its repair, without one line per tick.
func (k *streamKeeper) report(ctx context.Context, problem error) {
	if problem == nil {
		k.health.Store(nil)
		if k.reported != "" {
			k.w.log.InfoContext(ctx, "worker: the lifetime invariant holds again", "stream", k.w.inst.Stream().Name)
		}
		k.reported = ""
		return
	}
	k.health.Store(&problem)
	if msg := problem.Error(); msg != k.reported {
		k.w.log.ErrorContext(ctx, "worker: the lifetime invariant is broken; not ready until it is repaired (a late redelivery would run its effect twice)",
			"stream", k.w.inst.Stream().Name, "err", msg)
		k.reported = msg
	}
}

// Health is why the lifetime invariant is broken, or nil.
func (k *streamKeeper) Health() error { return loadErr(&k.health) }

// StreamHealth is why the stream is missing and not recreated, or nil.
func (k *streamKeeper) StreamHealth() error { return loadErr(&k.stream) }

func loadErr(p *atomic.Pointer[error]) error {
	if e := p.Load(); e != nil {
		return *e
	}
	return nil
}
