package idemwatermill

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem"
)

var (
	// ErrPermanent matches (with errors.Is) every error that no redelivery can
	// fix: a missing or malformed key, a fingerprint mismatch, or a handler error
	// wrapped with Permanent. Route such errors to a poison queue; see IsPermanent.
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

// keyOf returns the scoped idempotency key a message carries in its metadata:
// Idempotency-Key, joined with Idempotency-Scope when that is set. Errors are
// permanent and wrap idem.ErrMissingKey or idem.ErrMalformedKey.
func keyOf(md message.Metadata) (string, error) {
	raw := md.Get(idem.HeaderKey)
	if raw == "" {
		return "", Permanent(fmt.Errorf("no %s metadata: %w", idem.HeaderKey, idem.ErrMissingKey))
	}
	scope, key := idem.SplitScopedKey(raw)
	if s := md.Get(idem.HeaderScope); s != "" {
		if scope != "" {
			return "", Permanent(fmt.Errorf("%w: %s is already scoped and %s is set too",
				idem.ErrMalformedKey, idem.HeaderKey, idem.HeaderScope))
		}
		scope = s
	}
	if _, err := idem.ParseKey(string(key)); err != nil {
		return "", Permanent(fmt.Errorf("%s: %w", idem.HeaderKey, err))
	}
	if err := idem.ValidateScope(scope); err != nil {
		return "", Permanent(fmt.Errorf("%w: %w", idem.ErrMalformedKey, err))
	}
	return idem.ScopedKey(scope, key), nil
}
