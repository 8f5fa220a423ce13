package wire_test

import (
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/wire"
)

func TestValidateHeader(t *testing.T) {
	t.Parallel()
	if err := wire.ValidateHeader("traceparent", "00-abc-def-01"); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][2]string{{"", "v"}, {"a b", "v"}, {"a:b", "v"}, {"é", "v"}, {"h", "line\r\nInjected: x"}, {"h", "a\nb"}} {
		if err := wire.ValidateHeader(bad[0], bad[1]); err == nil {
			t.Errorf("ValidateHeader(%q, %q) accepted", bad[0], bad[1])
		}
	}
}

// A delivery's message is its subject, or its subject and name.
func TestMessageOf(t *testing.T) {
	t.Parallel()
	if got := wire.MessageOf("orders.line", ""); got != "orders.line" {
		t.Errorf("MessageOf unnamed = %q", got)
	}
	if got := wire.MessageOf("orders.line", "line-1"); got != "orders.line line-1" {
		t.Errorf("MessageOf named = %q", got)
	}
}

func TestReplayForAndRelayHeaders(t *testing.T) {
	t.Parallel()
	for value, want := range map[string]bool{"": true, "charges": true, "emails,charges": true, "emails": false, "charges-x": false} {
		if got := wire.IsReplayFor(value, "charges"); got != want {
			t.Errorf("IsReplayFor(%q, charges) = %v, want %v", value, got, want)
		}
	}
	for _, h := range []string{idem.HeaderKey, idem.HeaderMsgID, idem.HeaderEnqueuedAt, idem.HeaderMessage, idem.HeaderReplayFor} {
		if !wire.IsRelayHeader(h) {
			t.Errorf("IsRelayHeader(%s) = false", h)
		}
	}
	for _, h := range []string{idem.HeaderScope, "traceparent", "nats-msg-id"} {
		if wire.IsRelayHeader(h) {
			t.Errorf("IsRelayHeader(%s) = true", h)
		}
	}
	for h, want := range map[string]bool{"Nats-Rollup": true, "nats-ttl": true, "Nats": false, "traceparent": false} {
		if got := wire.ReservedByBroker(h); got != want {
			t.Errorf("ReservedByBroker(%s) = %v, want %v", h, got, want)
		}
	}
}
