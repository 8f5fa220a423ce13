package main

import (
	"errors"
	"log/slog"
	"net/http"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/client"
)

// faultClient builds the client as run does for the switches in o, against f.
func faultClient(t *testing.T, f *fakeIngress, o options) (*client.Client, *client.Journal, *faultTransport) {
	t.Helper()
	j, err := client.OpenJournal(filepath.Join(t.TempDir(), "j"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = j.Close() })
	logger := slog.New(slog.DiscardHandler)
	faults := newFaultTransport(o, j, logger)
	if faults == nil {
		t.Fatal("no fault transport for the switches")
	}
	c, err := client.New(client.Config{
		Store:       j,
		BaseURL:     f.srv.URL,
		HTTPClient:  &http.Client{Transport: faults},
		BackoffBase: time.Microsecond, // the tests wait on nothing
		BackoffMax:  time.Millisecond,
		Logger:      logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	return c, j, faults
}

var testCharge = client.Request{Path: "/v1/payments", Body: []byte(`{"account":"acct_1","amount_cents":1250}`)}

// --drop-response, at the client API: the first response is lost on the way back,
// the client retries with the same key and the server replays instead of executing
// again.
func TestFaultDropFirstResponse(t *testing.T) {
	f := newFakeIngress(t)
	c, j, faults := faultClient(t, f, options{dropResponse: true})
	res, forgotten, err := submitIntent(t.Context(), c, testCharge, faults)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != client.IntentDone || res.Attempts != 2 || !res.Replayed || forgotten != "" {
		t.Fatalf("result = %+v, forgotten %q; want done after 2 attempts, replayed, nothing forgotten", res, forgotten)
	}
	keys, ex := f.sentKeys(), f.executions()
	if len(keys) != 2 || keys[0] != keys[1] || keys[0] != string(res.Key) || len(ex) != 1 {
		t.Fatalf("requests %q, executions %d; want 2 requests with key %s and one execution", keys, len(ex), res.Key)
	}
	if in, ok := j.Get(res.Key); !ok || in.Status != client.IntentDone || in.Attempts != 2 {
		t.Fatalf("journal = %+v, %v; want done after 2 attempts", in, ok)
	}
}

// --forget-key, at the client API: the negative control. A client that loses its key
// mints a new one, and the server cannot know the two are one intent. Two keys, two
// effects; the journal holds only the second key.
func TestFaultForgetKey(t *testing.T) {
	f := newFakeIngress(t)
	c, j, faults := faultClient(t, f, options{forgetKey: true})
	res, forgotten, err := submitIntent(t.Context(), c, testCharge, faults)
	if err != nil {
		t.Fatal(err)
	}
	keys, ex := f.sentKeys(), f.executions()
	if len(keys) != 2 || keys[0] == keys[1] || len(ex) != 2 {
		t.Fatalf("requests %q, executions %d; want 2 requests with 2 keys and 2 executions", keys, len(ex))
	}
	if res.Status != client.IntentDone || res.Replayed || res.Attempts != 1 ||
		res.Key != idem.Key(keys[1]) || forgotten != idem.Key(keys[0]) {
		t.Fatalf("result = %+v, forgotten %q; want done, not replayed, key %s, forgotten %s", res, forgotten, keys[1], keys[0])
	}
	if _, ok := j.Get(forgotten); ok {
		t.Fatal("forgotten key is still in the journal")
	}
	if all, err := j.All(t.Context()); err != nil || len(all) != 1 || all[0].Key != res.Key {
		t.Fatalf("journal holds %d intents (%v), want only the new key %s", len(all), err, res.Key)
	}
}

// A request that fails before any response arrives is no lost response: the switch
// stays armed and drops the first response that does arrive.
func TestFaultStaysArmedUntilAResponse(t *testing.T) {
	f := newFakeIngress(t)
	c, _, faults := faultClient(t, f, options{dropResponse: true})
	faults.next = &failFirst{next: faults.next}
	res, _, err := submitIntent(t.Context(), c, testCharge, faults)
	if err != nil {
		t.Fatal(err)
	}
	// Attempt 1 fails in the network, attempt 2's response is dropped, attempt 3
	// gets the replay.
	if res.Status != client.IntentDone || res.Attempts != 3 || !res.Replayed {
		t.Fatalf("result = %+v, want done after 3 attempts, replayed", res)
	}
	if keys := f.sentKeys(); len(keys) != 2 || keys[0] != string(res.Key) || keys[1] != string(res.Key) {
		t.Fatalf("server saw %q, want key %s twice", keys, res.Key)
	}
}

// failFirst fails the first request before it leaves the process, as a refused
// connection would.
type failFirst struct {
	next   http.RoundTripper
	failed atomic.Bool
}

func (f *failFirst) RoundTrip(r *http.Request) (*http.Response, error) {
	if !f.failed.Swap(true) {
		return nil, errors.New("connection refused (test)")
	}
	return f.next.RoundTrip(r)
}
