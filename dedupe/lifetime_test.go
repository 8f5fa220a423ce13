package dedupe_test

import (
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/dedupe"
)

func TestLifetimeInvariant(t *testing.T) {
	t.Parallel()
	ok := dedupe.Lifetimes{InboxKey: 72 * time.Hour, RequestKey: 48 * time.Hour, StreamMaxAge: 24 * time.Hour, Redelivery: 15 * time.Minute, ClientResend: 24 * time.Hour}
	if err := ok.Check(); err != nil {
		t.Fatalf("defaults rejected: %v", err)
	}
	cases := []struct {
		name   string
		mutate func(*dedupe.Lifetimes)
		want   string
	}{
		{"inbox shorter than stream", func(l *dedupe.Lifetimes) { l.InboxKey = 12 * time.Hour }, "inbox key lifetime 12h0m0s must be longer than the stream's MaxAge 24h0m0s"},
		{"unlimited stream", func(l *dedupe.Lifetimes) { l.StreamMaxAge = 0 }, "stream MaxAge is unlimited"},
		{"redelivery longer", func(l *dedupe.Lifetimes) { l.Redelivery = 100 * time.Hour }, "redelivery horizon 100h0m0s"},
		{"client longer than inbox", func(l *dedupe.Lifetimes) { l.ClientResend = 96 * time.Hour }, "the client's re-send horizon 96h0m0s"},
		{"client longer than requests", func(l *dedupe.Lifetimes) { l.ClientResend = 50 * time.Hour }, "request key lifetime 48h0m0s must be longer than the client's re-send horizon 50h0m0s"},
	}
	for _, tc := range cases {
		l := ok
		tc.mutate(&l)
		err := l.Check()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to mention %q", tc.name, err, tc.want)
		}
	}
}
