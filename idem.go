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
// This root package holds only the vocabulary every other package shares: the key
// and its validation, scoped keys, subjects, header names, the message type, the one
// hook shape ([Event], [Observer]) and the sentinel errors. The moving parts live in
// their own packages:
//
//   - client: the client side (durable journal, retries with the same key);
//   - producer: the HTTP Idempotency-Key middleware of a producing service;
//   - install: the installation every component takes (pool, schema, stream);
//   - outbox: Enqueue inside the caller's transaction (the worker's relay publishes it);
//   - dedupe: the Postgres inbox, leases for external effects, the lifetime invariant;
//   - consumer: the JetStream pull engine that runs handlers exactly once per key;
//   - worker: the composition root that runs all of the above in a service;
//   - migrations: the idem_* schema, applied under a lock or printed for another tool;
//   - idemtest: a test kit that proves a user's own handler folds repeats;
//   - wire: the message protocol for adapters that publish or consume without
//     the outbox and the consumer (relay headers, the inbox's message name).
//
// Beside the library, in modules of their own so that their dependencies stay out
// of its graph: github.com/idemkit/idem/watermill (the inbox and the outbox for
// Watermill routers) and github.com/idemkit/idem/embeddednats (a JetStream server
// in the process, for idemtest's cases and zero-setup runs).
//
// docs/ARCHITECTURE.md in the repository describes the design as built.
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
	// HeaderReplayFor names the consumers a copy of a message is for, separated by
	// commas: the consumer a dead-letter replay is for, or those a re-drive of a
	// lost message is missing. Every consumer of the subject receives the copy;
	// the others ack it without an effect, so a copy never reaches a consumer
	// that settled the message already (whose inbox may have forgotten the key by
	// then). It is the relay's own header: a producer may not set it.
	HeaderReplayFor = "Idem-Replay-For"
	// HeaderMessage carries the name a producer gave one message of an intent
	// (Message.Name), set by the relay. Consumers fold deliveries by key and
	// message (wire.MessageOf), so two messages of one intent on one subject are two
	// deliveries.
	HeaderMessage = "Idem-Message"
	// HeaderEnqueuedAt is set by the relay: when the message's outbox row was
	// written, by the database's clock: RFC 3339 in UTC with microseconds
	// ("2026-12-01T12:00:00.000000Z"). A consumer measures end-to-end latency from
	// it. Producers may not set it.
	HeaderEnqueuedAt = "Idem-Enqueued-At"
)

// maxMessageNameLen is the longest Message.Name accepted, in bytes.
const maxMessageNameLen = 128

// ValidateMessageName checks a Message.Name: empty (the subject alone names the
// message), or 1..128 bytes of printable ASCII without spaces.
func ValidateMessageName(name string) error {
	if len(name) > maxMessageNameLen {
		return fmt.Errorf("idem: message name: %d bytes, longer than %d", len(name), maxMessageNameLen)
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c > '~' {
			return fmt.Errorf("idem: message name %q: byte %d is 0x%02x, not printable ASCII without spaces", name, i, c)
		}
	}
	return nil
}

// MaxKeyLen is the longest key (and the longest scope) accepted, in bytes.
const MaxKeyLen = 255

// scopeSep joins a scope and a key. It is outside the printable ASCII range that both
// are restricted to, so a scoped key can never collide with a bare key or with another
// scope's key.
const scopeSep = "\x1f"

// Sentinel errors. Callers match them with errors.Is.
var (
	// ErrMissingKey: a state-changing request or a message carried no key.
	ErrMissingKey = errors.New("idem: missing idempotency key")
	// ErrMalformedKey: the key (or its scope) is empty, longer than MaxKeyLen or not
	// printable ASCII.
	ErrMalformedKey = errors.New("idem: malformed idempotency key")
	// ErrFingerprintMismatch: the key was seen before with a different payload. It is a
	// producer bug and is rejected, never merged silently.
	ErrFingerprintMismatch = errors.New("idem: same key with a different payload")
	// ErrBadSubject: a subject is not a literal NATS subject, or a filter is not a
	// valid subject filter, or a subject lies outside the stream's subjects.
	ErrBadSubject = errors.New("idem: bad subject")
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

// ParseKey validates s as a key: 1..MaxKeyLen bytes of printable ASCII (0x20..0x7E),
// without leading or trailing spaces.
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
		return fmt.Errorf("%w: scope: %v", ErrMalformedKey, err)
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
	if strings.TrimSpace(s) != s {
		// Transports trim header values (nats.go does): "k " and "k" would be two
		// keys at the producer and one downstream.
		return errors.New("leading or trailing spaces")
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

// ParseScopedKey reverses ScopedKey and validates both halves: it is the one parser
// of the identity carried on messages, used by the outbox, the consumers and the
// Watermill adapter alike. An empty s is ErrMissingKey; anything else that ScopedKey
// could not have produced from a valid scope and key is ErrMalformedKey.
func ParseScopedKey(s string) (scope string, key Key, err error) {
	if s == "" {
		return "", "", ErrMissingKey
	}
	scope, bare, found := strings.Cut(s, scopeSep)
	if !found {
		scope, bare = "", s
	} else if scope == "" {
		return "", "", fmt.Errorf("%w: empty scope before the separator", ErrMalformedKey)
	}
	if err := ValidateScope(scope); err != nil {
		return "", "", err
	}
	if key, err = ParseKey(bare); err != nil {
		if errors.Is(err, ErrMissingKey) {
			err = fmt.Errorf("%w: empty key after the scope", ErrMalformedKey)
		}
		return "", "", err
	}
	return scope, key, nil
}

// MsgID derives the JetStream Nats-Msg-Id for one message of an intent. JetStream
// dedupes Msg-Ids per stream, not per subject, and one intent may emit several
// messages (a charge and its receipt email), so the subject is part of the id. A
// subject never contains a space, so the join is unambiguous. A message with a
// name (Message.Name) adds it after the byte 0x1E, which no key, scope or name
// contains; see Message.MsgID.
func MsgID(subject, scopedKey string) string {
	return subject + " " + scopedKey
}

// msgIDNameSep starts a Msg-Id's name part. Keys, scopes and names are printable
// ASCII, so it cannot occur in them. (The outbox starts a re-publish's generation
// with another such byte, 0x1D.)
const msgIDNameSep = "\x1e"

// MsgID is the Nats-Msg-Id the relay gives m: idem.MsgID of its subject and key,
// then its name, if it has one.
func (m Message) MsgID() string {
	id := MsgID(m.Subject, m.Key)
	if m.Name != "" {
		id += msgIDNameSep + m.Name
	}
	return id
}

// Message is one message of an intent, as enqueued in the outbox and as delivered to
// a consumer.
type Message struct {
	// Key is the scoped idempotency key (see ScopedKey).
	Key string
	// Subject is the literal JetStream subject (see ValidateSubject); it must lie
	// under the subjects of the stream the relay publishes to.
	Subject string
	// Name tells apart the messages of one intent on one subject: two messages
	// with the same key, subject and name are one delivery to every consumer that
	// reads them (the second is folded into the first, or dead-lettered when its
	// payload differs). Leave it empty when the intent sends one message per
	// subject; set it ("line-1", "line-2") when it sends several (see
	// ValidateMessageName).
	Name string
	// Headers are extra headers carried with the message (trace context, say).
	// The relay's own headers (wire.IsRelayHeader) are set from the other fields and may
	// not be here.
	Headers map[string]string
	// Payload is the message body.
	Payload []byte
}
