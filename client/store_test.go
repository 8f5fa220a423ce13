package client

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem"
)

// memStore is a Store that is not a Journal, as an application with its own database
// would write one. It keeps everything in memory, which is only honest in a test. Like
// a database it honours ctx: a call made once ctx has ended fails with ctx.Err().
type memStore struct {
	mu      sync.Mutex
	intents map[idem.Key]*Intent
	order   []idem.Key

	// before, if set, is called with the method's name at the start of every call,
	// ahead of the ctx check; a test ends ctx there, or fails the call by returning
	// an error.
	before func(method string) error
}

func newMemStore() *memStore { return &memStore{intents: map[idem.Key]*Intent{}} }

// enter runs the before hook and the ctx check every method starts with.
func (s *memStore) enter(ctx context.Context, method string) error {
	if s.before != nil {
		if err := s.before(method); err != nil {
			return fmt.Errorf("memstore: %s: %w", method, err)
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("memstore: %s: %w", method, err)
	}
	return nil
}

func (s *memStore) Append(ctx context.Context, in Intent) error {
	if err := s.enter(ctx, "Append"); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.intents[in.Key]; ok {
		return ErrDuplicateIntent
	}
	in.Attempts, in.Status = 0, IntentPending
	s.intents[in.Key] = &in
	s.order = append(s.order, in.Key)
	return nil
}

func (s *memStore) RecordAttempt(ctx context.Context, key idem.Key) error {
	if err := s.enter(ctx, "RecordAttempt"); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	in, ok := s.intents[key]
	switch {
	case !ok:
		return ErrUnknownIntent
	case in.Status != IntentPending:
		return ErrIntentFinished
	}
	in.Attempts++
	return nil
}

func (s *memStore) Done(ctx context.Context, key idem.Key, httpStatus int, body []byte, status IntentStatus) error {
	if err := s.enter(ctx, "Done"); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	in, ok := s.intents[key]
	switch {
	case !ok:
		return ErrUnknownIntent
	case in.Status != IntentPending:
		return ErrIntentFinished
	}
	in.Status, in.HTTPStatus, in.Response = status, httpStatus, slices.Clone(body)
	return nil
}

func (s *memStore) Pending(ctx context.Context) ([]Intent, error) {
	if err := s.enter(ctx, "Pending"); err != nil {
		return nil, err
	}
	return s.list(func(in *Intent) bool { return in.Status == IntentPending }), nil
}

func (s *memStore) All(ctx context.Context) ([]Intent, error) {
	if err := s.enter(ctx, "All"); err != nil {
		return nil, err
	}
	return s.list(func(*Intent) bool { return true }), nil
}

func (s *memStore) list(keep func(*Intent) bool) []Intent {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Intent
	for _, k := range s.order {
		if in := s.intents[k]; keep(in) {
			out = append(out, copyIntent(in))
		}
	}
	return out
}

func (s *memStore) has(key idem.Key) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.intents[key]
	return ok
}

// The Client needs nothing of a Store but the interface: with one of its own, every
// send happens after Append (the server never sees a key the store lacks), a failure
// is retried with the same key, and the final response is recorded.
func TestClientWithOwnStore(t *testing.T) {
	store := newMemStore()
	f := newFakeIngress(t)
	var unstored []string
	f.fail = func(n int, w http.ResponseWriter, r *http.Request, _ []byte) bool {
		if key := idem.Key(r.Header.Get(idem.HeaderKey)); !store.has(key) {
			f.mu.Lock()
			unstored = append(unstored, string(key))
			f.mu.Unlock()
		}
		if n == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return true
		}
		return false
	}
	res, err := newClientT(t, testConfig(t, f, store)).Submit(t.Context(), payment)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != IntentDone || res.Attempts != 2 {
		t.Fatalf("result = %+v, want done after 2 attempts", res)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(unstored) != 0 {
		t.Fatalf("keys sent before the store held them: %q", unstored)
	}
	if got := keysOf(allOf(t, store)); len(got) != 1 || got[0] != string(res.Key)+":done:2:202" {
		t.Fatalf("store = %v, want %s done after 2 attempts", got, res.Key)
	}
	if len(distinct(f.seen)) != 1 || len(f.executed) != 1 {
		t.Fatalf("keys %q, executions %d; want one key and one execution", distinct(f.seen), len(f.executed))
	}
}

// A Store that cannot list its intents fails Resume and List with its error, and
// nothing is sent.
func TestClientStoreListFails(t *testing.T) {
	store := newMemStore()
	f := newFakeIngress(t)
	c := newClientT(t, testConfig(t, f, store))
	// One pending intent, which a working Pending would hand to Resume.
	if err := store.Append(t.Context(), Intent{Key: idem.NewKey(), Method: "POST", Path: "/v1/payments", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	broken := errors.New("database is locked")
	store.before = func(method string) error {
		if method == "Pending" || method == "All" {
			return broken
		}
		return nil
	}

	results, err := c.Resume(t.Context(), func(int, int, Result) { t.Error("progress called") })
	if !errors.Is(err, broken) || !strings.Contains(err.Error(), "client: list pending intents") || results != nil {
		t.Fatalf("Resume = %+v, %v; want no results and the store's error, with context", results, err)
	}
	list, err := c.List(t.Context())
	if !errors.Is(err, broken) || !strings.Contains(err.Error(), "client: list intents") || list != nil {
		t.Fatalf("List = %+v, %v; want no results and the store's error, with context", list, err)
	}
	if seen, _ := f.snapshot(); len(seen) != 0 {
		t.Fatalf("server saw %q, want nothing sent", seen)
	}
}

// A Store that honours ctx fails once it ends. The Client passes its ctx to every
// Store call and, when that is why RecordAttempt or Done failed, reports the intent
// as still pending, as it is in the Store: a later Resume finishes it with its key,
// and the effect happens once.
func TestClientStoreContextEnded(t *testing.T) {
	for _, tc := range []struct {
		method string
		sent   int // requests before ctx ended
	}{
		{"RecordAttempt", 0}, // before the first send
		{"Done", 1},          // after the answer arrived, before it was recorded
	} {
		t.Run(tc.method, func(t *testing.T) {
			store := newMemStore()
			f := newFakeIngress(t)
			c := newClientT(t, testConfig(t, f, store))
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			store.before = func(method string) error {
				if method == tc.method {
					cancel() // the user hits ^C just as the Client reaches the store
				}
				return nil
			}

			res, err := c.Submit(ctx, payment)
			if !errors.Is(err, ErrStillPending) || !errors.Is(err, context.Canceled) {
				t.Fatalf("Submit: err = %v, want ErrStillPending and context.Canceled", err)
			}
			if res.Status != IntentPending || res.Key == "" || res.Attempts != tc.sent {
				t.Fatalf("result = %+v, want pending with its key after %d attempts", res, tc.sent)
			}
			if seen, _ := f.snapshot(); len(seen) != tc.sent {
				t.Fatalf("server saw %d requests, want %d", len(seen), tc.sent)
			}
			if p := pendingOf(t, store); len(p) != 1 || p[0].Key != res.Key {
				t.Fatalf("store pending = %v, want %s", keysOf(p), res.Key)
			}

			store.before = nil
			results, err := c.Resume(t.Context(), nil)
			if err != nil {
				t.Fatalf("Resume: %v", err)
			}
			if len(results) != 1 || results[0].Key != res.Key || results[0].Status != IntentDone || results[0].Replayed != (tc.sent > 0) {
				t.Fatalf("Resume = %+v, want %s done (replayed: %v)", results, res.Key, tc.sent > 0)
			}
			if seen, executed := f.snapshot(); len(distinct(seen)) != 1 || len(executed) != 1 {
				t.Fatalf("keys %q, executions %d; want one key and one execution", distinct(seen), len(executed))
			}
		})
	}
}
