package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem"
)

// ErrStillPending is returned (wrapped, with the last failure) when Submit or Resume
// gave up on an intent before a final response was recorded: the attempts ran out
// or ctx ended.
// The intent stays pending in the Store and a later Resume re-sends it with the same
// key.
var ErrStillPending = errors.New("client: intent still pending")

// ErrRedirected is wrapped, with ErrStillPending, in the error of a Submit or Resume
// whose request was answered with a redirect (3xx). A redirect is not the service's
// answer, and the Client never follows one: following would send a different
// request (a 303 turns the POST into a GET) or this one to another URL, and journal
// that answer as the intent's. Nor does it retry, since the same URL gives the same
// redirect. The intent stays pending, to be resumed with its key once BaseURL is
// fixed; Result.Error says where the redirect pointed.
var ErrRedirected = errors.New("client: service answered with a redirect")

// clockSkewAllowance is how far ahead of the wall clock a journaled CreatedAt may be
// and still count as age zero rather than as an unknown age (see Client.Expired):
// clock jitter and small corrections, not a clock set back by hours.
const clockSkewAllowance = time.Minute

// Client sends intents to an idem service so that each takes effect once. It mints
// the key, stores it durably before the first send, and retries with that same key
// until a final response arrives. Construct it with New. A Client is safe for
// concurrent use.
type Client struct {
	cfg Config

	mu sync.Mutex
	// born holds the time.Now() reading, monotonic clock included, of each intent
	// this Client submitted and has not seen finish: in this process its age is
	// measured on the monotonic clock, which the wall clock being set cannot move.
	born map[idem.Key]time.Time
}

// New validates cfg, fills in defaults and returns a Client.
func New(cfg Config) (*Client, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Client{cfg: cfg, born: make(map[idem.Key]time.Time)}, nil
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
	// Truncated reports that the final response's body was longer than
	// Config.MaxResponseBytes: the intent is finished all the same (the service
	// answered), but Response, and what the Store keeps, is only the start of the
	// body (as a JSON string when the cut left invalid JSON). Only the Submit or
	// Resume call that received the response reports it: the Store does not record
	// it, so List does not.
	Truncated bool `json:"truncated,omitempty"`
	// Error, when not empty, says why the intent needs attention that Status does
	// not spell out: a redirect answer left it pending (see ErrRedirected), or it
	// expired (past KeyLifetime, or journaled with a CreatedAt in the future; see
	// Client.Expired). It is empty for done and rejected intents and for intents
	// merely still pending after network errors or 5xx (the returned error has
	// those).
	Error string `json:"error,omitempty"`
}

// Submit mints a key for req, stores the intent (durably, see Store), and sends it
// until a final response: 2xx is done, a 4xx other than 408, 409, 425 and 429 is
// rejected. Network errors, timeouts, 5xx, 408, 409 (the first arrival is still
// running), 425 and 429 are retried with the same key, after a jittered exponential
// backoff. A redirect (3xx) is neither followed nor retried: the intent stays
// pending and the error wraps ErrRedirected.
//
// ctx bounds the sends and is passed to every Store call.
//
// The error is nil when the intent reached a final status (done or rejected: check
// Result.Status). It wraps ErrStillPending when the attempts ran out, ctx ended (in
// a Store call too, once the intent is stored) or the answer was a redirect (with
// ErrRedirected); the Result then carries the key, and Resume will finish the intent
// later. Any other error means the intent could
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
	c.remember(in.Key, in.CreatedAt)
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
		if expired, why := c.expiry(in, now); expired {
			r.Status, r.Error = IntentExpired, why
		}
		out = append(out, r)
	}
	return out, nil
}

// Expired reports whether a pending intent must not be sent again because the server
// may have forgotten its key: it is KeyLifetime old, or its age cannot be known.
// The server's lifetime starts at its first arrival, which is after CreatedAt, so
// counting from CreatedAt errs on the safe side.
//
// The age is measured on the monotonic clock for an intent this Client submitted (in
// this process), when now is a time.Now() reading: setting the wall clock forward or
// back changes nothing then. An intent from an earlier process has only its
// journaled CreatedAt, a wall-clock reading, and so does a now without a monotonic
// reading; the age is then the wall clock's, and a wall clock set back by more than
// the margin between KeyLifetime and the server's lifetime can make an old intent
// look young, which nothing on the client can detect. What can be detected is a
// CreatedAt in the future, more than a minute ahead of now: the clock was set back
// since, by an unknown amount, so the intent may be any age. Such an intent counts
// as expired, not as age zero (it would then be re-sent for as long as the clock
// takes to catch up, perhaps long after the server forgot the key): a late retry is
// a second effect, while an expired intent only waits for a human to reconcile it.
// Within a minute ahead is clock jitter and counts as age zero.
func (c *Client) Expired(in Intent, now time.Time) bool {
	expired, _ := c.expiry(in, now)
	return expired
}

// expiry is Expired with the reason, for Result.Error.
func (c *Client) expiry(in Intent, now time.Time) (expired bool, why string) {
	if in.Status != IntentPending {
		return false, ""
	}
	created := in.CreatedAt
	c.mu.Lock()
	if t, ok := c.born[in.Key]; ok {
		created = t // with its monotonic reading: Sub uses it when now has one too
	}
	c.mu.Unlock()
	age := now.Sub(created)
	switch {
	case age < -clockSkewAllowance:
		return true, fmt.Sprintf("created_at %s is in the future, %v ahead of the clock: the clock was set back, so the intent's age is unknown "+
			"and it may be past the server's key lifetime; it is not re-sent, reconcile it by hand",
			in.CreatedAt.UTC().Format(time.RFC3339), (-age).Round(time.Second))
	case age >= c.cfg.KeyLifetime:
		return true, fmt.Sprintf("created %v ago, past the key lifetime of %v: the server may have forgotten its key, "+
			"so it is not re-sent; reconcile it by hand", age.Round(time.Second), c.cfg.KeyLifetime)
	}
	return false, ""
}

// remember keeps the monotonic creation time of an intent this Client submitted.
func (c *Client) remember(key idem.Key, created time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.born[key] = created
}

// finished drops what remember kept, once the intent has a final response. A pending
// intent keeps its entry, expired or not, for as long as the Client lives.
func (c *Client) finished(key idem.Key) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.born, key)
}

// send is the retry loop for one stored intent.
func (c *Client) send(ctx context.Context, in Intent) (Result, error) {
	log := c.cfg.Logger.With("key", in.Key)
	var lastErr error
	var retryAfter time.Duration // the server's Retry-After on the last response
	for n := 1; n <= c.cfg.MaxAttempts; n++ {
		if expired, why := c.expiry(in, time.Now()); expired {
			log.InfoContext(ctx, "intent expired; not sending", "created_at", in.CreatedAt, "reason", why)
			r := resultOf(in)
			r.Status, r.Error = IntentExpired, why
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
		if redirected(resp.status) {
			// Not the service's answer, and the same URL will redirect again: stop, and
			// leave the intent pending for a Resume once BaseURL is fixed. Recording it
			// rejected would invite the user to submit again under a new key, which is
			// a second effect if whatever redirected had executed the request.
			why := redirectError(resp)
			log.InfoContext(ctx, "redirect not followed; intent left pending", "attempt", in.Attempts, "http_status", resp.status, "location", resp.location)
			r := resultOf(in)
			r.Error = why
			return r, fmt.Errorf("%w: %s: %w: %s", ErrStillPending, in.Key, ErrRedirected, why)
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
		c.finished(in.Key)
		in.Status, in.HTTPStatus, in.Response = status, resp.status, resp.body
		r := resultOf(in)
		r.Replayed, r.Truncated = resp.replayed, resp.truncated
		if resp.truncated {
			log.InfoContext(ctx, "response longer than MaxResponseBytes; kept its start", "max_response_bytes", c.cfg.MaxResponseBytes)
		}
		log.DebugContext(ctx, "intent finished", "status", status, "http_status", resp.status, "replayed", resp.replayed, "truncated", resp.truncated)
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
