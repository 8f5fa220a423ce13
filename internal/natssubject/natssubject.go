// Package natssubject holds the NATS subject filter rules every component applies
// to the user's stream subjects and consumer filters (the consumers at start, the
// relay and the reconciler on their filters), and the matching of a subject against
// them. The literal-subject rules are the root package's (idem.ValidateSubject), which
// a filter's literal tokens follow, so that a subject accepted in one place is
// accepted everywhere; the filter rules stay here, since only idem's own components
// match filters.
package natssubject

import (
	"fmt"
	"strings"

	"github.com/idemkit/idem"
)

// ValidateFilter checks that f is a NATS subject filter, as a stream's subjects and a
// consumer's filter subject are: like a literal subject, except that a token may be
// "*" (any one token) and the last token may be ">" (one or more tokens). Its
// errors wrap idem.ErrBadSubject.
func ValidateFilter(f string) error {
	if f == "" {
		return fmt.Errorf("%w: empty subject filter", idem.ErrBadSubject)
	}
	tokens := strings.Split(f, ".")
	for i, tok := range tokens {
		switch {
		case tok == ">" && i != len(tokens)-1:
			return fmt.Errorf("%w: subject filter %q: \">\" must be the last token", idem.ErrBadSubject, f)
		case tok == "*" || tok == ">":
		case tok == "":
			return fmt.Errorf("%w: subject filter %q has an empty token", idem.ErrBadSubject, f)
		default:
			if err := idem.ValidateSubject(tok); err != nil {
				return fmt.Errorf("%w: subject filter %q: token %q is not a literal token", idem.ErrBadSubject, f, tok)
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
