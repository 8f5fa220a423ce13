package idem

import (
	"fmt"
	"strings"
)

// ValidateSubject checks that s is a literal NATS subject that a message can be
// published to: tokens separated by dots, none of them empty, no wildcard ("*" or
// ">"), and nothing but printable ASCII without spaces. Subjects are the user's;
// every component applies these rules to them, so that a subject accepted in one
// place is accepted everywhere.
func ValidateSubject(s string) error {
	if s == "" {
		return fmt.Errorf("%w: empty subject", ErrBadSubject)
	}
	for tok := range strings.SplitSeq(s, ".") {
		switch {
		case tok == "":
			return fmt.Errorf("%w: subject %q has an empty token", ErrBadSubject, s)
		case tok == "*" || tok == ">":
			return fmt.Errorf("%w: %q is a wildcard, not a literal subject", ErrBadSubject, s)
		}
		for j := 0; j < len(tok); j++ {
			if c := tok[j]; c <= ' ' || c > '~' || c == '*' || c == '>' {
				return fmt.Errorf("%w: subject %q: byte 0x%02x is not allowed in a token", ErrBadSubject, s, c)
			}
		}
	}
	return nil
}
