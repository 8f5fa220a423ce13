package dedupe

import (
	"fmt"
	"strings"
	"time"
)

// Lifetimes are the windows the lifetime invariant compares. A key must be
// remembered for longer than any window in which its intent can arrive again;
// otherwise a late arrival finds no key and runs the effect a second time.
type Lifetimes struct {
	// InboxKey is how long a consumer remembers a key (idem_inbox.expires_at).
	// Zero means no consumer is being checked: only the request rule applies.
	InboxKey time.Duration
	// RequestKey is how long the HTTP ingress remembers a key (idem_requests).
	// Zero means no ingress: the request rule is skipped.
	RequestKey time.Duration
	// StreamMaxAge is how long JetStream keeps a message that can be redelivered
	// (0 means unlimited, which no finite key lifetime can cover).
	StreamMaxAge time.Duration
	// Redelivery is the longest span over which one message is redelivered: every
	// ack wait and every backoff up to MaxDeliver.
	Redelivery time.Duration
	// ClientResend is how long a client keeps re-sending a pending intent with the
	// same key before reporting it expired.
	ClientResend time.Duration
}

// Check enforces the invariant and names the numbers when it does not hold:
//
//	inbox key lifetime    > stream MaxAge, > redelivery horizon, > client re-send horizon
//	request key lifetime  > client re-send horizon
func (l Lifetimes) Check() error {
	var bad []string
	need := func(what string, have time.Duration, other string, window time.Duration) {
		if have <= window {
			bad = append(bad, fmt.Sprintf("%s %s must be longer than %s %s", what, have, other, window))
		}
	}
	if l.InboxKey > 0 {
		if l.StreamMaxAge == 0 {
			bad = append(bad, fmt.Sprintf("stream MaxAge is unlimited: a message could be redelivered after the inbox (%s) forgot its key; set a MaxAge", l.InboxKey))
		} else {
			need("inbox key lifetime", l.InboxKey, "the stream's MaxAge", l.StreamMaxAge)
		}
		need("inbox key lifetime", l.InboxKey, "the consumer's redelivery horizon", l.Redelivery)
		need("inbox key lifetime", l.InboxKey, "the client's re-send horizon", l.ClientResend)
	}
	if l.RequestKey > 0 {
		need("request key lifetime", l.RequestKey, "the client's re-send horizon", l.ClientResend)
	}
	if len(bad) > 0 {
		return fmt.Errorf("dedupe: key lifetime invariant violated (a late retry would run the effect twice): %s", strings.Join(bad, "; "))
	}
	return nil
}
