package idem

import (
	"fmt"
	"strings"
)

// Subjects are the user's: a stream and its subjects are named by whoever embeds idem.
// These are the rules every package applies to them (the outbox at enqueue, the
// consumers at start, the Watermill adapter per message), so that a subject accepted
// in one place is accepted everywhere.

// ValidateSubject checks that s is a literal NATS subject that a message can be
// published to: tokens separated by dots, none of them empty, no wildcard ("*" or
// ">"), and nothing but printable ASCII without spaces.
func ValidateSubject(s string) error {
	return checkSubject(s, false)
}

// ValidateFilter checks that f is a NATS subject filter, as a stream's subjects and a
// consumer's filter subject are: like a literal subject, except that a token may be
// "*" (any one token) and the last token may be ">" (one or more tokens).
func ValidateFilter(f string) error {
	return checkSubject(f, true)
}

func checkSubject(s string, filter bool) error {
	what := "subject"
	if filter {
		what = "subject filter"
	}
	if s == "" {
		return fmt.Errorf("%w: empty %s", ErrBadSubject, what)
	}
	tokens := strings.Split(s, ".")
	for i, tok := range tokens {
		switch {
		case tok == "":
			return fmt.Errorf("%w: %s %q has an empty token", ErrBadSubject, what, s)
		case tok == "*" || tok == ">":
			if !filter {
				return fmt.Errorf("%w: %q is a wildcard, not a literal subject", ErrBadSubject, s)
			}
			if tok == ">" && i != len(tokens)-1 {
				return fmt.Errorf("%w: %s %q: \">\" must be the last token", ErrBadSubject, what, s)
			}
			continue
		}
		for j := 0; j < len(tok); j++ {
			c := tok[j]
			if c <= ' ' || c > '~' || c == '*' || c == '>' {
				return fmt.Errorf("%w: %s %q: byte 0x%02x is not allowed in a token", ErrBadSubject, what, s, c)
			}
		}
	}
	return nil
}

// SubjectMatches reports whether the literal subject matches the filter, by NATS
// rules: "*" matches exactly one token, a final ">" one or more.
func SubjectMatches(filter, subject string) bool {
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

// SubjectUnder reports whether subject matches at least one of filters.
func SubjectUnder(filters []string, subject string) bool {
	for _, f := range filters {
		if SubjectMatches(f, subject) {
			return true
		}
	}
	return false
}

// ValidateHeader checks that name and value can travel as a NATS message header:
// the name a non-empty token of printable ASCII without spaces or colons, the value
// free of line breaks (which would end the header block).
func ValidateHeader(name, value string) error {
	if name == "" {
		return fmt.Errorf("idem: header with an empty name")
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c > '~' || c == ':' {
			return fmt.Errorf("idem: header name %q: byte %d is %q, not allowed", name, i, c)
		}
	}
	if strings.ContainsAny(value, "\r\n") {
		return fmt.Errorf("idem: header %q: the value contains a line break", name)
	}
	return nil
}
