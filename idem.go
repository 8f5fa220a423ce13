// Package idem makes a side effect happen once per user intent across a message
// queue that only promises "at least once".
//
// The intent is named by an idempotency [Key] minted on the client, before the first
// send, and carried unchanged through every hop: the HTTP ingress claims it in
// idem_requests, the transactional outbox stamps it on the message, the relay publishes
// it to JetStream with a Nats-Msg-Id derived from it, and the consumer claims it in
// idem_inbox inside the same Postgres transaction as the effect. Each repeat of a hop
// is folded by the next unique constraint.
//
// This root package holds only the vocabulary shared by every other package: the key
// type and its validation, header names, the message type and sentinel errors. See
// the packages producer, outbox, dedupe and consumer for the moving parts, and
// DESIGN.md for the architecture.
package idem

import (
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"
)

// Header names used on HTTP requests and JetStream messages.
const (
	// HeaderKey carries the idempotency key, on HTTP and on JetStream. Past the
	// ingress it holds the scoped key (see ScopedKey).
	HeaderKey = "Idempotency-Key"
	// HeaderScope names the tenant or principal a key belongs to. Keys are unique
	// per scope, never across scopes.
	HeaderScope = "Idempotency-Scope"
	// HeaderReplayed is set to "true" on a response replayed from the first arrival.
	HeaderReplayed = "Idempotent-Replayed"
	// HeaderMsgID is JetStream's de-duplication header.
	HeaderMsgID = "Nats-Msg-Id"
)

// MaxKeyLen is the longest key accepted, in bytes.
const MaxKeyLen = 255

// scopeSep joins a scope and a key. It is outside the printable ASCII range that both
// are restricted to, so a scoped key can never collide with a bare key or with another
// scope's key.
const scopeSep = "\x1f"

// Sentinel errors. Callers match them with errors.Is.
var (
	// ErrMissingKey: a state-changing request or a message carried no key.
	ErrMissingKey = errors.New("idem: missing idempotency key")
	// ErrMalformedKey: the key is empty, longer than MaxKeyLen or not printable ASCII.
	ErrMalformedKey = errors.New("idem: malformed idempotency key")
	// ErrFingerprintMismatch: the key was seen before with a different payload. It is a
	// producer bug and is rejected, never merged silently.
	ErrFingerprintMismatch = errors.New("idem: same key with a different payload")
)

// Key is an idempotency key: the name of one user intent. It is minted on the client
// (NewKey) before the first send and reused by every retry.
type Key string

// NewKey mints a fresh key: a UUIDv7, so keys sort by creation time, which keeps the
// inbox's b-tree appends local.
func NewKey() Key {
	id, err := uuid.NewV7()
	if err != nil {
		// NewV7 only fails when the system's random source fails; a v4 is as unique.
		id = uuid.New()
	}
	return Key(id.String())
}

// String returns the key's text.
func (k Key) String() string { return string(k) }

// ParseKey validates s as a key: 1..MaxKeyLen bytes of printable ASCII (0x20..0x7E).
func ParseKey(s string) (Key, error) {
	if s == "" {
		return "", ErrMissingKey
	}
	if err := checkToken(s); err != nil {
		return "", fmt.Errorf("%w: %v", ErrMalformedKey, err)
	}
	return Key(s), nil
}

// ValidateScope checks an Idempotency-Scope value. The empty scope is valid and means
// "no scope".
func ValidateScope(s string) error {
	if s == "" {
		return nil
	}
	if err := checkToken(s); err != nil {
		return fmt.Errorf("idem: malformed idempotency scope: %v", err)
	}
	return nil
}

func checkToken(s string) error {
	if len(s) > MaxKeyLen {
		return fmt.Errorf("%d bytes, longer than %d", len(s), MaxKeyLen)
	}
	if strings.TrimSpace(s) == "" {
		return errors.New("blank")
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e {
			return fmt.Errorf("byte %d is 0x%02x, not printable ASCII", i, c)
		}
	}
	return nil
}

// ScopedKey joins a scope and a key into the identity carried past the ingress. With
// no scope it is the key itself. The join is unambiguous: two tenants that pick the
// same key get different scoped keys, so neither the broker nor the inbox folds them.
func ScopedKey(scope string, key Key) string {
	if scope == "" {
		return string(key)
	}
	return scope + scopeSep + string(key)
}

// SplitScopedKey reverses ScopedKey.
func SplitScopedKey(scoped string) (scope string, key Key) {
	if i := strings.Index(scoped, scopeSep); i >= 0 {
		return scoped[:i], Key(scoped[i+len(scopeSep):])
	}
	return "", Key(scoped)
}

// MsgID derives the JetStream Nats-Msg-Id for one message of an intent. JetStream
// dedupes Msg-Ids per stream, not per subject, and one intent may emit several
// messages (a charge and its receipt email), so the subject is part of the id. A
// subject never contains a space, so the join is unambiguous.
func MsgID(subject, scopedKey string) string {
	return subject + " " + scopedKey
}

// Message is one message of an intent, as enqueued in the outbox and as delivered to
// a consumer.
type Message struct {
	// Key is the scoped idempotency key (see ScopedKey).
	Key string
	// Subject is the JetStream subject, under "idem.".
	Subject string
	// Headers are extra headers carried with the message (trace context, say).
	// Idempotency-Key and Nats-Msg-Id are set by the relay and need not be here.
	Headers map[string]string
	// Payload is the message body, JSON for the demo subjects.
	Payload []byte
}

// Subjects of the demo service.
const (
	SubjectCharge = "idem.payments.charge"
	SubjectEmail  = "idem.emails.send"
	// StreamName is the JetStream stream holding every idem.> subject.
	StreamName = "IDEM"
	// StreamSubjects is the stream's subject filter.
	StreamSubjects = "idem.>"
)
