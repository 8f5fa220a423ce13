package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// ErrStillPending is returned (wrapped, with the last failure) when Submit or Resume
// gave up on an intent before a final response was recorded: the attempts ran out
// or ctx ended.
// The intent stays pending in the Store and a later Resume re-sends it with the same
// key.
var ErrStillPending = errors.New("client: intent still pending")

// Client sends intents to an idem service so that each takes effect once. It mints
// the key, stores it durably before the first send, and retries with that same key
// until a final response arrives. Construct it with New. A Client is safe for
// concurrent use.
type Client struct {
	cfg Config
}

// New validates cfg, fills in defaults and returns a Client.
func New(cfg Config) (*Client, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Client{cfg: cfg}, nil
}

// Request is one intent to submit.
type Request struct {
	// Method defaults to POST.
	Method string
	// Path is appended to BaseURL, for example "/v1/payments".
	Path string
	// Body is sent as application/json, byte for byte the same on every attempt.
	Body []byte
}

// Result is the outcome of one intent.
type Result struct {
	// Key names the intent.
	Key idem.Key `json:"key"`
	// Attempts counts sends with Key, across every Submit and Resume.
	Attempts int `json:"attempts"`
	// Status is IntentDone, IntentPending, IntentRejected or IntentExpired.
	Status IntentStatus `json:"status"`
	// HTTPStatus and Response are the final response; zero and nil while pending.
	HTTPStatus int             `json:"http_status"`
	Response   json.RawMessage `json:"response"`
	// Replayed reports that the server answered from its record of the first
	// arrival (header Idempotent-Replayed: true) rather than executing again.
	Replayed bool `json:"replayed,omitempty"`
}

// Submit mints a key for req, stores the intent (durably, see Store), and sends it
// until a final response: 2xx is done, a 4xx other than 408, 409 and 429 is
// rejected. Network errors, timeouts, 5xx, 408, 409 (the first arrival is still
// running) and 429 are retried with the same key, after a jittered exponential
// backoff.
//
// ctx bounds the sends and is passed to every Store call.
//
// The error is nil when the intent reached a final status (done or rejected: check
// Result.Status). It wraps ErrStillPending when the attempts ran out or ctx ended
// (in a Store call too, once the intent is stored); the Result then carries the key,
// and Resume will finish the intent later. Any other error means the intent could
// not be stored and was never sent, or the Store failed while it was being sent (the
// Result then carries its key).
func (c *Client) Submit(ctx context.Context, req Request) (Result, error) {
	if req.Method == "" {
		req.Method = http.MethodPost
	}
	if !strings.HasPrefix(req.Path, "/") {
		return Result{}, fmt.Errorf("client: submit: path %q must start with /", req.Path)
	}
	in := Intent{
		Key:       idem.NewKey(),
		Scope:     c.cfg.Scope,
		Method:    req.Method,
		Path:      req.Path,
		Payload:   bytes.Clone(req.Body), // what every attempt sends, whatever the caller does to req.Body
		CreatedAt: time.Now(),
	}
	// The key is durable before anything leaves the process: from here on, a crash,
	// a dropped response or a timeout all end in the same key being sent again.
	if err := c.cfg.Store.Append(ctx, in); err != nil {
		return Result{}, fmt.Errorf("client: submit: %w", err)
	}
	c.cfg.Logger.DebugContext(ctx, "intent journaled", "key", in.Key, "path", in.Path)
	in.Status = IntentPending
	return c.send(ctx, in)
}

// Resume re-sends every pending intent in the Store, oldest first, each with its own
// key and scope, and returns one Result per intent. It is what a client runs after a
// restart. Intents older than KeyLifetime are not sent; their Result has status
// IntentExpired and their key, so they can be reported and reconciled by hand.
//
// progress, if not nil, is called after each intent with the number finished so far,
// the total and that intent's result. The error joins the failures of intents left
// pending (each wraps ErrStillPending) and of Store calls; the results are complete
// regardless. Only if the Store cannot list the pending intents does Resume send
// nothing and return no results, with that error.
func (c *Client) Resume(ctx context.Context, progress func(done, total int, r Result)) ([]Result, error) {
	pending, err := c.cfg.Store.Pending(ctx)
	if err != nil {
		return nil, fmt.Errorf("client: list pending intents: %w", err)
	}
	results := make([]Result, 0, len(pending))
	var errs []error
	for i, in := range pending {
		var r Result
		if ctx.Err() != nil {
			// Stop sending, but still report every intent: each stays pending.
			r = resultOf(in)
			errs = append(errs, fmt.Errorf("%w: %s: %w", ErrStillPending, in.Key, ctx.Err()))
		} else {
			r, err = c.send(ctx, in)
			if err != nil {
				errs = append(errs, err)
			}
		}
		results = append(results, r)
		if progress != nil {
			progress(i+1, len(pending), r)
		}
	}
	return results, errors.Join(errs...)
}

// List returns every intent in the Store as a Result, oldest first, with pending
// intents past KeyLifetime reported as IntentExpired. It sends nothing. The error is
// the Store's, when it cannot list its intents; there are no results then.
func (c *Client) List(ctx context.Context) ([]Result, error) {
	now := time.Now()
	all, err := c.cfg.Store.All(ctx)
	if err != nil {
		return nil, fmt.Errorf("client: list intents: %w", err)
	}
	out := make([]Result, 0, len(all))
	for _, in := range all {
		r := resultOf(in)
		if c.Expired(in, now) {
			r.Status = IntentExpired
		}
		out = append(out, r)
	}
	return out, nil
}

// Expired reports whether a pending intent is past the key lifetime and must not be
// sent again.
func (c *Client) Expired(in Intent, now time.Time) bool {
	// The server's lifetime starts at its first arrival, which is after CreatedAt, so
	// counting from CreatedAt errs on the safe side.
	return in.Status == IntentPending && now.Sub(in.CreatedAt) >= c.cfg.KeyLifetime
}

// send is the retry loop for one stored intent.
func (c *Client) send(ctx context.Context, in Intent) (Result, error) {
	log := c.cfg.Logger.With("key", in.Key)
	var lastErr error
	var retryAfter time.Duration // the server's Retry-After on the last response
	for n := 1; n <= c.cfg.MaxAttempts; n++ {
		if c.Expired(in, time.Now()) {
			log.InfoContext(ctx, "intent expired; not sending", "created_at", in.CreatedAt)
			r := resultOf(in)
			r.Status = IntentExpired
			return r, nil
		}
		if n > 1 {
			if err := c.sleep(ctx, n-1, retryAfter); err != nil {
				lastErr = err
				break
			}
		}
		retryAfter = 0
		// Count the attempt before sending, so a crash mid-send still shows it.
		if err := c.cfg.Store.RecordAttempt(ctx, in.Key); err != nil {
			if ctxEnded(ctx, err) {
				// Not sent, and still pending in the Store: as if ctx ended in the
				// backoff.
				lastErr = err
				break
			}
			return resultOf(in), fmt.Errorf("client: send %s: %w", in.Key, err)
		}
		in.Attempts++

		resp, err := c.attempt(ctx, in)
		if err != nil {
			if ctx.Err() != nil {
				lastErr = ctx.Err()
				break
			}
			lastErr = err
			log.DebugContext(ctx, "attempt failed; will retry", "attempt", in.Attempts, "err", err)
			continue
		}
		if retryable(resp.status) {
			lastErr = fmt.Errorf("HTTP %d: %s", resp.status, snippet(resp.body))
			retryAfter = resp.retryAfter
			log.DebugContext(ctx, "retryable response", "attempt", in.Attempts, "http_status", resp.status, "retry_after", retryAfter)
			continue
		}
		status := IntentDone
		if resp.status < 200 || resp.status > 299 {
			status = IntentRejected
		}
		if err := c.cfg.Store.Done(ctx, in.Key, resp.status, resp.body, status); err != nil {
			if ctxEnded(ctx, err) {
				// The answer arrived but is not recorded: the intent is still
				// pending, and its next send gets the server's replay of it.
				return resultOf(in), fmt.Errorf("%w: %s: HTTP %d not recorded: %w", ErrStillPending, in.Key, resp.status, err)
			}
			return resultOf(in), fmt.Errorf("client: send %s: %w", in.Key, err)
		}
		in.Status, in.HTTPStatus, in.Response = status, resp.status, resp.body
		r := resultOf(in)
		r.Replayed = resp.replayed
		log.DebugContext(ctx, "intent finished", "status", status, "http_status", resp.status, "replayed", resp.replayed)
		return r, nil
	}
	return resultOf(in), fmt.Errorf("%w: %s after %d attempts: %w", ErrStillPending, in.Key, in.Attempts, lastErr)
}

// ctxEnded reports whether err is a Store failing because ctx ended.
func ctxEnded(ctx context.Context, err error) bool {
	return ctx.Err() != nil && errors.Is(err, ctx.Err())
}

// resultOf builds the Result for an intent's current state.
func resultOf(in Intent) Result {
	return Result{
		Key:        in.Key,
		Attempts:   in.Attempts,
		Status:     in.Status,
		HTTPStatus: in.HTTPStatus,
		Response:   rawJSON(in.Response),
	}
}
