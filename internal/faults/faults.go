// Package faults holds deterministic fault points: places in idem where a test can
// make the work stop as if the process died there, or where a fault-injection run
// makes the process die for real.
//
// Fault points are not public API. A Set travels in the context a component runs
// with (With, From); a component reaches a point with From(ctx).Hit(ctx, point,
// keys), which is a no-op when no Set is present. Only code inside this module can
// build a context carrying a Set, so a user of the library cannot switch a point
// on, and the shipped worker binary parses IDEM_FAULTS only when it is built with
// the idemfaults build tag (see cmd/worker).
//
// A Set comes from a test (New, then Func and Switch) or from an IDEM_FAULTS
// specification (Parse): a comma-separated list of point=action[@n], for example
//
//	consumer.after-commit=kill@3,relay.after-publish=kill
//
// kill sends SIGKILL to the process itself (no deferred function, no flush: a real
// crash); exit exits with status 3; on arms a switch (see On). @n fires on the n-th
// time the point is reached (default: the first). Unknown point names are errors.
package faults

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// EnvVar is the environment variable that arms fault points in a worker built with
// the idemfaults tag.
const EnvVar = "IDEM_FAULTS"

// Point names a place in the code.
type Point string

// The fault points.
const (
	// IngressAfterCommit: a request's record, business rows and outbox rows have
	// committed; its response is not written yet.
	IngressAfterCommit Point = "ingress.after-commit"
	// RelayAfterPublish: a batch has its PubAcks; the rows are not marked published.
	RelayAfterPublish Point = "relay.after-publish"
	// EffectBeforeCommit: a batch's handlers ran; the inbox transaction has not
	// committed. Returning an error rolls the batch back.
	EffectBeforeCommit Point = "effect.before-commit"
	// ConsumerAfterCommit: a batch committed; it is not acked.
	ConsumerAfterCommit Point = "consumer.after-commit"
	// ExternalAfterPerform: an external effect succeeded downstream; its lease is
	// not completed and the message not acked.
	ExternalAfterPerform Point = "external.after-perform"

	// ReconcileBeforeRedrive: a reconciler's batch has judged its rows; the
	// re-drive of those it found lost is not written yet. A test's Func there
	// can settle one meanwhile, as a consumer may.
	ReconcileBeforeRedrive Point = "reconcile.before-redrive"

	// SkipInboxClaim is a switch, not a crash: the negative control of the tests.
	// Armed, in-transaction consumers run every delivery's handler without claiming
	// its key, so a checker must see doubled effects.
	SkipInboxClaim Point = "consumer.skip-inbox-claim"

	// The switches below are the negative controls of the delivery's identity:
	// each brings back one way an intent's effect would run twice or never.

	// KeyOnlyIdentity is a switch: armed, consumers name every delivery by its key
	// alone, so one intent's second message to one consumer is folded into its
	// first (or dead-lettered as a changed payload).
	KeyOnlyIdentity Point = "consumer.key-only-identity"
	// AnyInstallation is a switch: armed, a consumer binds a durable that belongs
	// to another installation, and the reconciler reads another installation's
	// acks as its own.
	AnyInstallation Point = "consumer.any-installation"
	// IgnoreEpoch is a switch: armed, a consumer binds a durable of its
	// installation's token whatever epoch the durable records, so a copy of the
	// database (a restored backup, a snapshot) binds the durables its original
	// bound since, and runs their effects a second time.
	IgnoreEpoch Point = "consumer.ignore-epoch"
	// RedriveToAll is a switch: armed, the reconciler re-drives a lost intent to
	// every consumer of its subject (no Idem-Replay-For), up to the missing
	// consumers' own key lifetimes, and counts an expired inbox row as settled.
	RedriveToAll Point = "reconcile.redrive-to-all"
	// RenameBackfills is a switch: armed, a consumer new to the installation
	// with the stream and filter of a registered one that settled messages
	// backfills by default instead of being refused as a likely rename
	// (consumer.ErrLikelyRenamed): a rename done in configuration runs the
	// history again under a name whose inbox is empty.
	RenameBackfills Point = "consumer.rename-backfills"
	// OldDeadLettersProve is a switch: armed, the reconciler counts any dead
	// letter of a key as its settlement, the one a replay replays included.
	OldDeadLettersProve Point = "reconcile.old-dead-letters-prove"
	// RegisteredLifetime is a switch: armed, the reconciler judges every row by
	// the key lifetimes registered today, as if a consumer's settlements written
	// under a shorter lifetime it has since raised were still remembered.
	RegisteredLifetime Point = "reconcile.registered-lifetime"

	// RecordOnWorkContext is a switch: armed, an external effect's record (the
	// lease's completion) runs on the work context, which a hard stop cancels: an
	// effect that succeeded after the stop began is not recorded, and a successor
	// performs it again once the lease expires.
	RecordOnWorkContext Point = "consumer.record-on-work-context"

	// The switches below are the negative controls of the log relay: each brings
	// back one way it would lose a row it was given.

	// ConfirmOnRead is a switch: armed, the log relay confirms each transaction's
	// position to the slot as soon as it has read and sent it, before its PubAcks
	// came: a crash (or a broker that drops the publishes) then loses its rows.
	ConfirmOnRead Point = "relay.confirm-on-read"
	// SkipSlotHandOver is a switch: armed, a log relay that makes its slot anew
	// does not hand the rows no window holds to the polling relay: what the old
	// slot never published stays unpublished.
	SkipSlotHandOver Point = "relay.skip-slot-hand-over"
	// TemporarySlot is a switch: armed, the log relay makes a temporary slot,
	// which Postgres drops when the relay's session ends or the server restarts,
	// and starts each session from the server's current position.
	TemporarySlot Point = "relay.temporary-slot"

	// MarkedMessages is a switch: armed, a handler about to run a message that
	// carries the header MarkHeader fails the way the header says — "panic" panics
	// inside the handler call (a handler's bug), "kill" SIGKILLs the process there
	// (a message that crashes its worker every time: a restart loop).
	MarkedMessages Point = "consumer.marked-messages"

	// IgnoreClosedConnection is a switch: armed, the worker logs a NATS
	// connection that closed for good and keeps running on it, unready and
	// publishing nothing, instead of ending.
	IgnoreClosedConnection Point = "worker.ignore-closed-connection"
)

// MarkHeader marks a message for MarkedMessages.
const MarkHeader = "Idem-Fault"

// Points lists every point, for validation and for help texts.
var Points = []Point{IngressAfterCommit, RelayAfterPublish, EffectBeforeCommit, ConsumerAfterCommit, ExternalAfterPerform, ReconcileBeforeRedrive, SkipInboxClaim,
	KeyOnlyIdentity, AnyInstallation, IgnoreEpoch, RenameBackfills, RedriveToAll, OldDeadLettersProve, RegisteredLifetime, ConfirmOnRead, SkipSlotHandOver, TemporarySlot, MarkedMessages, IgnoreClosedConnection, RecordOnWorkContext}

// Func is a test hook run at a point with the keys of the work under way. A non-nil
// error abandons that work where it stands, as if the process had died there.
type Func func(ctx context.Context, keys []string) error

type point struct {
	action string // kill, exit, on, or "" for a Func
	at     int
	hits   int
	fn     Func
}

// Set is a set of armed points. The nil Set is inert; all methods are safe for
// concurrent use.
type Set struct {
	mu     sync.Mutex
	points map[Point]*point
}

// New returns an empty Set, to arm with Func and Switch.
func New() *Set { return &Set{points: map[Point]*point{}} }

// Func arms p with fn, called at every hit. It returns s, for chaining.
func (s *Set) Func(p Point, fn Func) *Set {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.points[p] = &point{fn: fn}
	return s
}

// Switch arms the switch p (see On). It returns s, for chaining.
func (s *Set) Switch(p Point) *Set {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.points[p] = &point{action: "on"}
	return s
}

// FromEnv parses IDEM_FAULTS; an empty variable gives a nil (inert) Set.
func FromEnv() (*Set, error) { return Parse(os.Getenv(EnvVar)) }

// Parse parses a fault specification; the empty one gives a nil Set.
func Parse(spec string) (*Set, error) {
	spec = strings.TrimSpace(spec)
	if spec == "" {
		return nil, nil
	}
	s := New()
	for _, item := range strings.Split(spec, ",") {
		name, action, ok := strings.Cut(strings.TrimSpace(item), "=")
		if !ok || name == "" {
			return nil, fmt.Errorf("faults: %q: want point=action[@n]", item)
		}
		p := Point(name)
		if !slices.Contains(Points, p) {
			return nil, fmt.Errorf("faults: %q: unknown point %q (known: %s)", item, name, known())
		}
		f := &point{at: 1}
		if a, n, ok := strings.Cut(action, "@"); ok {
			v, err := strconv.Atoi(n)
			if err != nil || v < 1 {
				return nil, fmt.Errorf("faults: %q: @n must be a positive integer", item)
			}
			action, f.at = a, v
		}
		switch {
		case action != "kill" && action != "exit" && action != "on":
			return nil, fmt.Errorf("faults: %q: action must be kill, exit or on", item)
		case (action == "on") != switches[p]:
			return nil, fmt.Errorf("faults: %q: %s takes %s", item, p, map[bool]string{true: "on", false: "kill or exit"}[switches[p]])
		}
		f.action = action
		s.points[p] = f
	}
	return s, nil
}

// switches are the points armed with "on" rather than a crash.
var switches = map[Point]bool{SkipInboxClaim: true, MarkedMessages: true,
	KeyOnlyIdentity: true, AnyInstallation: true, IgnoreEpoch: true, RenameBackfills: true, RedriveToAll: true, OldDeadLettersProve: true, RegisteredLifetime: true,
	ConfirmOnRead: true, SkipSlotHandOver: true, TemporarySlot: true, IgnoreClosedConnection: true, RecordOnWorkContext: true}

// Marked acts on a message's MarkHeader value when MarkedMessages is on: it panics
// for "panic" and kills the process for "kill". Call it where the handler runs.
func (s *Set) Marked(mark string) {
	if mark == "" || !s.On(MarkedMessages) {
		return
	}
	switch mark {
	case "panic":
		panic("faults: a marked message's handler panics")
	case "kill":
		fmt.Fprintf(os.Stderr, "faults: %s: a marked message kills its worker\n", MarkedMessages)
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
}

func known() string {
	names := make([]string, len(Points))
	for i, p := range Points {
		names[i] = string(p)
	}
	return strings.Join(names, ", ")
}

// Armed reports whether p is armed in s.
func (s *Set) Armed(p Point) bool {
	if s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.points[p]
	return ok
}

// On reports whether the switch p is on.
func (s *Set) On(p Point) bool {
	if s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	f, ok := s.points[p]
	return ok && f.action == "on"
}

// Hit marks that the work on keys reached p. A Func runs and its error is returned;
// a kill or exit point that fires ends the process here and Hit does not return.
func (s *Set) Hit(ctx context.Context, p Point, keys []string) error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	f, ok := s.points[p]
	fire := false
	if ok {
		f.hits++
		fire = f.hits == f.at
	}
	s.mu.Unlock()
	switch {
	case !ok:
		return nil
	case f.fn != nil:
		return f.fn(ctx, keys)
	case !fire || f.action == "on":
		return nil
	}
	fmt.Fprintf(os.Stderr, "faults: %s fired (%s)\n", p, f.action)
	if f.action == "exit" {
		os.Exit(3)
	}
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // SIGKILL is not deliverable late; wait for it
}

type ctxKey struct{}

// With returns ctx carrying s. Components started with that context reach its
// points.
func With(ctx context.Context, s *Set) context.Context {
	if s == nil {
		return ctx
	}
	return context.WithValue(ctx, ctxKey{}, s)
}

// From returns the Set ctx carries, or nil.
func From(ctx context.Context) *Set {
	s, _ := ctx.Value(ctxKey{}).(*Set)
	return s
}
