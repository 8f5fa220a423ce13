package client

import (
	"errors"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// submitPending submits payment to a service that is down, with one attempt, so the
// intent is left pending in store.
func submitPending(t *testing.T, c *Client) Result {
	t.Helper()
	res, err := c.Submit(t.Context(), payment)
	if !errors.Is(err, ErrStillPending) {
		t.Fatalf("Submit: err = %v, want ErrStillPending", err)
	}
	return res
}

// setCreatedAt rewrites a stored intent's CreatedAt as a wall-clock reading only (no
// monotonic reading), as a Store that persisted it would hand it back.
func (s *memStore) setCreatedAt(key idem.Key, at time.Time) Intent {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.intents[key].CreatedAt = at.Round(0)
	return copyIntent(s.intents[key])
}

// Within one process the key lifetime runs on the monotonic clock: the wall clock
// stepping forward (the journaled CreatedAt now reads 25h ago) does not expire an
// intent created a moment ago, and stepping back (CreatedAt reads 2 days ahead) does
// not keep alive one whose monotonic age is past the lifetime.
func TestClientExpiryMonotonicInProcess(t *testing.T) {
	f := newFakeIngress(t)
	var down atomic.Bool
	down.Store(true)
	f.fail = func(_ int, w http.ResponseWriter, _ *http.Request, _ []byte) bool {
		if down.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return true
		}
		return false
	}
	store := newMemStore()
	cfg := testConfig(t, f, store)
	cfg.MaxAttempts = 1
	c := newClientT(t, cfg)

	// Wall clock stepped forward 25h since the intent was journaled.
	res := submitPending(t, c)
	in := store.setCreatedAt(res.Key, time.Now().Add(-25*time.Hour))
	if c.Expired(in, time.Now()) {
		t.Fatal("an intent created a moment ago counts as expired because the wall clock jumped forward")
	}
	down.Store(false)
	results, err := c.Resume(t.Context(), nil)
	if err != nil || len(results) != 1 || results[0].Key != res.Key || results[0].Status != IntentDone {
		t.Fatalf("Resume = %+v, %v; want %s sent and done", results, err, res.Key)
	}
	c.mu.Lock()
	kept := len(c.born)
	c.mu.Unlock()
	if kept != 0 {
		t.Fatalf("the Client still keeps the creation time of %d finished intent(s)", kept)
	}

	// Wall clock stepped back two days; 25h pass on the monotonic clock.
	down.Store(true)
	res = submitPending(t, c)
	in = store.setCreatedAt(res.Key, time.Now().Add(48*time.Hour))
	if later := time.Now().Add(25 * time.Hour); !c.Expired(in, later) {
		t.Fatal("an intent 25h old on the monotonic clock is not expired because the wall clock was set back")
	}
}

// Across a restart only the wall clock is left. A CreatedAt in the past counts from
// there; a CreatedAt in the future means the clock was set back by an unknown amount,
// so the intent's age is unknown and it might be past the server's key lifetime: it
// counts as expired and is not sent (a few seconds ahead is clock jitter and counts
// as age zero).
func TestClientExpiryAcrossRestart(t *testing.T) {
	f := newFakeIngress(t)
	j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
	now := time.Now()
	intent := func(created time.Time) Intent {
		return Intent{Key: idem.NewKey(), Method: "POST", Path: "/v1/payments", Payload: []byte(`{}`), CreatedAt: created}
	}
	cases := []struct {
		name    string
		in      Intent
		expired bool
		why     string
	}{
		{"an hour ago", intent(now.Add(-time.Hour)), false, ""},
		{"past the lifetime", intent(now.Add(-25 * time.Hour)), true, "key lifetime"},
		{"seconds ahead", intent(now.Add(10 * time.Second)), false, ""},
		{"an hour ahead", intent(now.Add(time.Hour)), true, "in the future"},
		{"a year ahead", intent(now.Add(365 * 24 * time.Hour)), true, "in the future"},
	}
	for _, tc := range cases {
		if err := j.Append(t.Context(), tc.in); err != nil {
			t.Fatal(err)
		}
	}
	c := newClientT(t, testConfig(t, f, j)) // a new process: no memory of the intents
	results, err := c.Resume(t.Context(), nil)
	if err != nil {
		t.Fatalf("Resume: %v", err)
	}
	if len(results) != len(cases) {
		t.Fatalf("%d results, want %d", len(results), len(cases))
	}
	var sent []string
	for i, tc := range cases {
		r := results[i]
		if r.Key != tc.in.Key {
			t.Fatalf("result %d is %s, want %s", i, r.Key, tc.in.Key)
		}
		if want := IntentDone; tc.expired {
			if r.Status != IntentExpired || !strings.Contains(r.Error, tc.why) {
				t.Errorf("%s: result = %+v, want expired with an error mentioning %q", tc.name, r, tc.why)
			}
		} else {
			if r.Status != want || r.Error != "" {
				t.Errorf("%s: result = %+v, want done", tc.name, r)
			}
			sent = append(sent, string(tc.in.Key))
		}
	}
	if seen, _ := f.snapshot(); strings.Join(seen, " ") != strings.Join(sent, " ") {
		t.Fatalf("server saw %q, want only %q", seen, sent)
	}
	// List agrees, with the reason.
	list, err := c.List(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for i, tc := range cases {
		if tc.expired && (list[i].Status != IntentExpired || !strings.Contains(list[i].Error, tc.why)) {
			t.Errorf("%s: List = %+v, want expired mentioning %q", tc.name, list[i], tc.why)
		}
	}
}
