package idem

import "github.com/idemkit/idem/internal/natssubject"

// ValidateSubject checks that s is a literal NATS subject that a message can be
// published to: tokens separated by dots, none of them empty, no wildcard ("*" or
// ">"), and nothing but printable ASCII without spaces. Subjects are the user's;
// every component applies these rules to them, so that a subject accepted in one
// place is accepted everywhere.
func ValidateSubject(s string) error {
	return natssubject.Validate(s)
}
