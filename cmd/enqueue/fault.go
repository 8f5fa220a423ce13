package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/client"
)

// faultTransport implements the demonstration switches --drop-response and
// --forget-key below the client, as the network and a forgetful app would: the
// client package knows nothing of them.
//
// The first response is received in full and then lost: RoundTrip returns an error
// instead, so the client retries with the same key and the server replays its first
// answer. With forget set (--forget-key), the key is also wiped from the journal
// before the retry, as a client that kept its key only in memory would lose it in a
// crash; the client finds its intent gone and stops, and submit then sends the same
// request as a new intent under a fresh key. The server cannot tell the two keys are
// one intent, so the effect happens twice: the negative control.
type faultTransport struct {
	next   http.RoundTripper
	forget func(idem.Key) error // nil for --drop-response alone
	logger *slog.Logger

	mu        sync.Mutex
	dropped   bool
	forgotten idem.Key
}

// newFaultTransport returns the transport for the switches in o, or nil when none is
// set.
func newFaultTransport(o options, journal *client.Journal, logger *slog.Logger) *faultTransport {
	if !o.dropResponse && !o.forgetKey {
		return nil
	}
	t := &faultTransport{next: http.DefaultTransport, logger: logger}
	if o.forgetKey {
		t.forget = journal.Forget
	}
	return t
}

// RoundTrip sends r and, for the first response only, reads it to the end and
// discards it. A request that fails before a whole response arrives is no lost
// response: the switch stays armed for the next one.
func (t *faultTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := t.next.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.dropped {
		return resp, nil
	}
	_, err = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if err != nil {
		return nil, fmt.Errorf("read response: %w", err)
	}
	t.dropped = true
	ctx := r.Context()
	t.logger.InfoContext(ctx, "fault injection: dropping the first response", "http_status", resp.StatusCode)
	if t.forget != nil {
		key := idem.Key(r.Header.Get(idem.HeaderKey))
		if err := t.forget(key); err != nil {
			return nil, fmt.Errorf("fault injection: forget key %s: %w", key, err)
		}
		t.forgotten = key
		t.logger.InfoContext(ctx, "fault injection: key forgotten", "forgotten", key)
	}
	return nil, fmt.Errorf("response %d dropped by fault injection", resp.StatusCode)
}

// forgottenKey is the key --forget-key wiped, or "".
func (t *faultTransport) forgottenKey() idem.Key {
	if t == nil {
		return ""
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.forgotten
}

// submitIntent submits req. When --forget-key wiped the intent's key after its
// dropped response, the intent is gone from the journal and Submit ended without
// it; the request then goes out again as a new intent, under a fresh key, which is
// what the user pressing again on an app that lost its key amounts to. forgotten is
// the wiped key, "" otherwise.
func submitIntent(ctx context.Context, c *client.Client, req client.Request, faults *faultTransport) (res client.Result, forgotten idem.Key, err error) {
	res, err = c.Submit(ctx, req)
	forgotten = faults.forgottenKey()
	if forgotten == "" || forgotten != res.Key {
		return res, "", err
	}
	res, err = c.Submit(ctx, req)
	faults.logger.InfoContext(ctx, "fault injection: new key minted for the same request", "forgotten", forgotten, "key", res.Key)
	return res, forgotten, err
}
