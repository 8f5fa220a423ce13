// Package wire is idem's message protocol on JetStream, for adapters that publish
// or consume idem's messages without its outbox or consumer (the Watermill module
// is one): which headers the relay owns, which the broker reserves, how a
// delivery names its message in the inbox, and whom a replayed copy is for.
//
// The header names themselves, the key and the Msg-Id are the shared vocabulary
// and live in the root package (idem.HeaderKey, idem.ScopedKey, idem.MsgID).
package wire

import (
	"fmt"
	"strings"

	"github.com/idemkit/idem"
)

// IsRelayHeader reports whether header name is the relay's own, set from the
// outbox row: the key, the Msg-Id, the enqueue time, the message's name and the
// consumers a copy is for. A producer may not set them, and a copy of a delivered
// message's headers (a dead-letter replay, a handler forwarding metadata) must
// leave them out, or the copy would be refused, folded into the original by the
// broker, or skipped by the consumers it is meant for. Names are compared as NATS
// compares them, exactly.
func IsRelayHeader(name string) bool {
	switch name {
	case idem.HeaderKey, idem.HeaderMsgID, idem.HeaderEnqueuedAt, idem.HeaderMessage, idem.HeaderReplayFor:
		return true
	}
	return false
}

// ReservedByBroker reports whether header name is in the broker's own namespace:
// NATS reads headers that begin with "Nats-" (any case) as instructions to the
// stream (Nats-Rollup, Nats-TTL, Nats-Expected-Last-Sequence, ...). A producer may
// not set them, and a copy of a delivered message's headers leaves them out, or a
// publish could be refused until its row is dead-lettered, or purge other
// messages of its subject.
func ReservedByBroker(name string) bool {
	return len(name) >= 5 && strings.EqualFold(name[:5], "Nats-")
}

// ValidateHeader checks that name and value can travel as a NATS message header:
// the name a non-empty token of printable ASCII without spaces or colons, the value
// free of line breaks (which would end the header block).
func ValidateHeader(name, value string) error {
	if name == "" {
		return fmt.Errorf("wire: header with an empty name")
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c > '~' || c == ':' {
			return fmt.Errorf("wire: header name %q: byte %d is %q, not allowed", name, i, c)
		}
	}
	if strings.ContainsAny(value, "\r\n") {
		return fmt.Errorf("wire: header %q: the value contains a line break", name)
	}
	return nil
}

// MessageOf names one message of an intent, as consumers fold it in the inbox: the
// subject, or the subject and the producer's name for it (idem.Message.Name)
// joined by a space, which neither contains. Two messages of one intent that one
// consumer reads are two deliveries as long as they differ here.
func MessageOf(subject, name string) string {
	if name == "" {
		return subject
	}
	return subject + " " + name
}

// IsReplayFor reports whether a message whose idem.HeaderReplayFor is value is
// for consumer: it names no consumer (it is for every one), or it names this one
// among its comma-separated names.
func IsReplayFor(value, consumer string) bool {
	if value == "" {
		return true
	}
	for _, name := range strings.Split(value, ",") {
		if name == consumer {
			return true
		}
	}
	return false
}
