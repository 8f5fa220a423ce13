// Package natssubject holds the NATS subject grammar every component applies to the
// user's subjects (the outbox at enqueue, the consumers at start, the relay and the
// reconciler on their filters), so that a subject accepted in one place is accepted
// everywhere. The root package exports the literal-subject check
// (idem.ValidateSubject); the filter rules stay here, since only idem's own
// components match filters.
package natssubject

import (
	"errors"
	"fmt"
	"strings"
)

// ErrBad is idem.ErrBadSubject: every error of this package wraps it.
var ErrBad = errors.New("idem: bad subject")

// Validate checks that s is a literal NATS subject that a message can be
// published to: tokens separated by dots, none of them empty, no wildcard ("*" or
// ">"), and nothing but printable ASCII without spaces.
func Validate(s string) error {
	return check(s, false)
}

// ValidateFilter checks that f is a NATS subject filter, as a stream's subjects and a
// consumer's filter subject are: like a literal subject, except that a token may be
// "*" (any one token) and the last token may be ">" (one or more tokens).
func ValidateFilter(f string) error {
	return check(f, true)
}

func check(s string, filter bool) error {
	what := "subject"
	if filter {
		what = "subject filter"
	}
	if s == "" {
		return fmt.Errorf("%w: empty %s", ErrBad, what)
	}
	tokens := strings.Split(s, ".")
	for i, tok := range tokens {
		switch {
		case tok == "":
			return fmt.Errorf("%w: %s %q has an empty token", ErrBad, what, s)
		case tok == "*" || tok == ">":
			if !filter {
				return fmt.Errorf("%w: %q is a wildcard, not a literal subject", ErrBad, s)
			}
			if tok == ">" && i != len(tokens)-1 {
				return fmt.Errorf("%w: %s %q: \">\" must be the last token", ErrBad, what, s)
			}
			continue
		}
		for j := 0; j < len(tok); j++ {
			c := tok[j]
			if c <= ' ' || c > '~' || c == '*' || c == '>' {
				return fmt.Errorf("%w: %s %q: byte 0x%02x is not allowed in a token", ErrBad, what, s, c)
			}
		}
	}
	return nil
}

// Matches reports whether the literal subject matches the filter, by NATS
// rules: "*" matches exactly one token, a final ">" one or more.
func Matches(filter, subject string) bool {
	ft := strings.Split(filter, ".")
	st := strings.Split(subject, ".")
	for i, f := range ft {
		if f == ">" {
			return len(st) > i
		}
		if i >= len(st) || (f != "*" && f != st[i]) {
			return false
		}
	}
	return len(ft) == len(st)
}

// Under reports whether subject matches at least one of filters.
func Under(filters []string, subject string) bool {
	for _, f := range filters {
		if Matches(f, subject) {
			return true
		}
	}
	return false
}
