// Package faults holds deterministic fault points: places in the worker where a
// fault-injection run can make the process die for real. They are compiled into the
// normal binary and inert unless IDEM_FAULTS names them.
//
// IDEM_FAULTS is a comma-separated list of point=action[@n], for example
//
//	IDEM_FAULTS=consumer.after-commit=kill@3,relay.after-publish=kill
//
// kill sends SIGKILL to the process itself (no deferred function, no flush: a real
// crash); exit exits with status 3; on merely arms a switch (see Armed). @n fires on the n-th time the point is reached
// (default: the first).
package faults

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// EnvVar is the environment variable that arms fault points.
const EnvVar = "IDEM_FAULTS"

// Fault points of the worker.
const (
	ConsumerAfterCommit = "consumer.after-commit" // committed, not acked
	RelayAfterPublish   = "relay.after-publish"   // published, not marked
	EmailAfterSend      = "email.after-send"      // the SMTP server took the mail, lease not completed
	EffectBeforeCommit  = "effect.before-commit"  // effect done, inbox transaction not committed
	IngressAfterCommit  = "ingress.after-commit"  // request committed, response not written

	// SkipInboxClaim is not a crash but the chaos suite's negative control: armed
	// (consumer.skip-inbox-claim=on), the charge consumer runs without its inbox
	// claim, so the checker must see doubled effects.
	SkipInboxClaim = "consumer.skip-inbox-claim"
)

type fault struct {
	action string
	at     int
	hits   int
}

// Set is a parsed IDEM_FAULTS. The nil Set is inert.
type Set struct {
	mu     sync.Mutex
	points map[string]*fault
}

// FromEnv parses IDEM_FAULTS; an empty variable gives a nil (inert) Set.
func FromEnv() (*Set, error) { return Parse(os.Getenv(EnvVar)) }

// Parse parses a fault spec.
func Parse(spec string) (*Set, error) {
	spec = strings.TrimSpace(spec)
	if spec == "" {
		return nil, nil
	}
	s := &Set{points: map[string]*fault{}}
	for _, item := range strings.Split(spec, ",") {
		point, action, ok := strings.Cut(strings.TrimSpace(item), "=")
		if !ok || point == "" {
			return nil, fmt.Errorf("faults: %q: want point=action[@n]", item)
		}
		f := &fault{at: 1}
		if a, n, ok := strings.Cut(action, "@"); ok {
			v, err := strconv.Atoi(n)
			if err != nil || v < 1 {
				return nil, fmt.Errorf("faults: %q: @n must be a positive integer", item)
			}
			action, f.at = a, v
		}
		if action != "kill" && action != "exit" && action != "on" {
			return nil, fmt.Errorf("faults: %q: action must be kill, exit or on", item)
		}
		f.action = action
		s.points[point] = f
	}
	return s, nil
}

// Armed reports whether point is armed.
func (s *Set) Armed(point string) bool {
	if s == nil {
		return false
	}
	_, ok := s.points[point]
	return ok
}

// Hit marks that the process reached point; if the point fires, the process dies
// here and Hit does not return.
func (s *Set) Hit(point string) {
	if s == nil {
		return
	}
	s.mu.Lock()
	f, ok := s.points[point]
	fire := false
	if ok {
		f.hits++
		fire = f.hits == f.at
	}
	s.mu.Unlock()
	if !fire || f.action == "on" {
		return
	}
	fmt.Fprintf(os.Stderr, "faults: %s fired (%s)\n", point, f.action)
	if f.action == "exit" {
		os.Exit(3)
	}
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // SIGKILL is not deliverable late; wait for it
}
