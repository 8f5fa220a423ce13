package idemwatermill

import (
	"errors"
	"fmt"

	"github.com/idemkit/idem"
)

var (
	// ErrPermanent matches (with errors.Is) every error that no redelivery can
	// fix: a missing or malformed key, a fingerprint mismatch, a message the
	// outbox refuses (see OutboxPublisher), or a handler error wrapped with
	// Permanent. Route such errors to a poison queue; see IsPermanent.
	ErrPermanent = errors.New("idemwatermill: permanent error")

	// ErrFingerprintMismatch: the message's key was first claimed with a different
	// payload. It is a producer bug and is rejected, never merged. It wraps
	// idem.ErrFingerprintMismatch, and errors carrying it are permanent.
	ErrFingerprintMismatch = fmt.Errorf("idemwatermill: rejected: %w", idem.ErrFingerprintMismatch)
)

// permanentError marks an error as permanent without changing its text.
type permanentError struct{ err error }

func (e permanentError) Error() string        { return e.err.Error() }
func (e permanentError) Unwrap() error        { return e.err }
func (e permanentError) Is(target error) bool { return target == ErrPermanent }

// Permanent marks err as permanent: redelivering the message cannot help, so it
// belongs in a poison queue. Handlers use it for payloads they can never process.
// Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err: err}
}

// IsPermanent reports whether err is permanent (errors.Is(err, ErrPermanent)). Its
// signature fits middleware.PoisonQueueWithFilter.
func IsPermanent(err error) bool { return errors.Is(err, ErrPermanent) }
