package producer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// Client defaults; a zero field in ClientConfig means the value here.
const (
	DefaultBaseURL     = "http://127.0.0.1:8080"
	DefaultMaxAttempts = 8
	DefaultBackoffBase = 100 * time.Millisecond
	DefaultBackoffMax  = 10 * time.Second
	DefaultTimeout     = 10 * time.Second
	// DefaultKeyLifetime matches the server's default key lifetime. The client must
	// not use a longer one than the server it talks to.
	DefaultKeyLifetime = 24 * time.Hour
	// DefaultMaxResponseBytes bounds the response body kept in the journal.
	DefaultMaxResponseBytes = 1 << 20
)

// ErrStillPending is returned (wrapped, with the last failure) when Submit or Resume
// gave up on an intent before a final response: the attempts ran out or ctx ended.
// The intent stays pending in the journal and a later Resume re-sends it with the
// same key.
var ErrStillPending = errors.New("producer: intent still pending")

// ClientConfig configures a Client. The zero value of every field but Journal means
// its default, so ClientConfig{Journal: j} is a working configuration.
type ClientConfig struct {
	// Journal holds the intents. Required. The Client does not close it.
	Journal *Journal
	// BaseURL of the service, without a trailing path. Default DefaultBaseURL.
	BaseURL string
	// HTTPClient sends the requests. Default: a client without a total timeout
	// (Timeout bounds each attempt instead).
	HTTPClient *http.Client
	// Scope is sent as Idempotency-Scope on new intents when not empty. Keys are
	// unique per scope, so a tenant or principal goes here. Resume sends each intent
	// with the scope it was journaled with.
	Scope string
	// MaxAttempts bounds the sends per Submit or Resume call. Default 8. The intent
	// stays pending when they run out.
	MaxAttempts int
	// BackoffBase and BackoffMax shape the wait between attempts: attempt n waits a
	// uniformly random time in [0, min(BackoffMax, BackoffBase*2^(n-1))) ("full
	// jitter"), so many clients that failed together do not retry together. A
	// Retry-After on a retryable response (409, 429, 503) sets the least wait
	// before the next attempt, up to BackoffMax. Defaults 100ms and 10s.
	BackoffBase, BackoffMax time.Duration
	// Timeout bounds one attempt, response body included. Default 10s.
	Timeout time.Duration
	// KeyLifetime is how long the server remembers a key. Default 24h. A pending
	// intent older than this is not re-sent: the server may have forgotten its key,
	// and a late retry would then be a second effect. It is reported as expired.
	KeyLifetime time.Duration
	// MaxResponseBytes bounds the response body read and journaled. Default 1 MiB.
	MaxResponseBytes int64
	// Logger receives retries and fault injections at debug and info level.
	// Default: discard.
	Logger *slog.Logger
}

func (c *ClientConfig) validate() error {
	if c.Journal == nil {
		return errors.New("producer: client config: Journal is required")
	}
	if c.BaseURL == "" {
		c.BaseURL = DefaultBaseURL
	}
	u, err := url.Parse(c.BaseURL)
	if err != nil {
		return fmt.Errorf("producer: client config: BaseURL: %w", err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("producer: client config: BaseURL %q: want http(s)://host[:port]", c.BaseURL)
	}
	c.BaseURL = strings.TrimRight(c.BaseURL, "/")
	if c.HTTPClient == nil {
		c.HTTPClient = &http.Client{}
	}
	if err := idem.ValidateScope(c.Scope); err != nil {
		return fmt.Errorf("producer: client config: Scope: %w", err)
	}
	for _, f := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"BackoffBase", &c.BackoffBase, DefaultBackoffBase},
		{"BackoffMax", &c.BackoffMax, DefaultBackoffMax},
		{"Timeout", &c.Timeout, DefaultTimeout},
		{"KeyLifetime", &c.KeyLifetime, DefaultKeyLifetime},
	} {
		if *f.v < 0 {
			return fmt.Errorf("producer: client config: %s is negative: %v", f.name, *f.v)
		}
		if *f.v == 0 {
			*f.v = f.def
		}
	}
	if c.BackoffMax < c.BackoffBase {
		return fmt.Errorf("producer: client config: BackoffMax %v is below BackoffBase %v", c.BackoffMax, c.BackoffBase)
	}
	if c.MaxAttempts < 0 {
		return fmt.Errorf("producer: client config: MaxAttempts is negative: %d", c.MaxAttempts)
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.MaxResponseBytes < 0 {
		return fmt.Errorf("producer: client config: MaxResponseBytes is negative: %d", c.MaxResponseBytes)
	}
	if c.MaxResponseBytes == 0 {
		c.MaxResponseBytes = DefaultMaxResponseBytes
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Client sends intents to an idem service so that each takes effect once. It mints
// the key, journals it (fsync) before the first send, and retries with that same key
// until a final response arrives. Construct it with NewClient. A Client is safe for
// concurrent use.
type Client struct {
	cfg ClientConfig
}

// NewClient validates cfg, fills in defaults and returns a Client.
func NewClient(cfg ClientConfig) (*Client, error) {
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

	// DropFirstResponse is a fault switch for demonstrations: the first response is
	// received in full and then discarded as if the network had lost it, so the
	// client retries with the same key and the server replays its first answer.
	DropFirstResponse bool
	// ForgetKey is the negative control: after the first (dropped) response the
	// journaled key is wiped and a fresh key is minted and journaled for the retry,
	// as a client that kept its key only in memory would after a crash. The server
	// cannot tell the two keys are one intent, so the effect happens twice. It
	// implies DropFirstResponse.
	ForgetKey bool
}

// Result is the outcome of one intent.
type Result struct {
	// Key names the intent. With ForgetKey it is the second, freshly minted key.
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
	// ForgottenKey is the key ForgetKey wiped, so a demonstration can show both.
	ForgottenKey idem.Key `json:"forgotten_key,omitempty"`
}

// Submit mints a key for req, journals the intent (fsync), and sends it until a final
// response: 2xx is done, a 4xx other than 408, 409 and 429 is rejected. Network
// errors, timeouts, 5xx, 408, 409 (the first arrival is still running) and 429 are
// retried with the same key, after a jittered exponential backoff.
//
// The error is nil when the intent reached a final status (done or rejected: check
// Result.Status). It wraps ErrStillPending when the attempts ran out or ctx ended;
// the Result then carries the key, and Resume will finish the intent later. Any other
// error means the intent could not be journaled and was never sent.
func (c *Client) Submit(ctx context.Context, req Request) (Result, error) {
	if req.Method == "" {
		req.Method = http.MethodPost
	}
	if !strings.HasPrefix(req.Path, "/") {
		return Result{}, fmt.Errorf("producer: submit: path %q must start with /", req.Path)
	}
	in := Intent{
		Key:       idem.NewKey(),
		Scope:     c.cfg.Scope,
		Method:    req.Method,
		Path:      req.Path,
		Payload:   req.Body,
		CreatedAt: time.Now(),
	}
	// The key is durable before anything leaves the process: from here on, a crash,
	// a dropped response or a timeout all end in the same key being sent again.
	if err := c.cfg.Journal.Append(in); err != nil {
		return Result{}, fmt.Errorf("producer: submit: %w", err)
	}
	c.cfg.Logger.DebugContext(ctx, "intent journaled", "key", in.Key, "path", in.Path)
	in, _ = c.cfg.Journal.Get(in.Key)
	return c.send(ctx, in, req.DropFirstResponse || req.ForgetKey, req.ForgetKey)
}

// Resume re-sends every pending intent in the journal, oldest first, each with its own
// key and scope, and returns one Result per intent. It is what a client runs after a
// restart. Intents older than KeyLifetime are not sent; their Result has status
// IntentExpired and their key, so they can be reported and reconciled by hand.
//
// progress, if not nil, is called after each intent with the number finished so far,
// the total and that intent's result. The error joins the failures of intents left
// pending (each wraps ErrStillPending); the results are complete regardless.
func (c *Client) Resume(ctx context.Context, progress func(done, total int, r Result)) ([]Result, error) {
	pending := c.cfg.Journal.Pending()
	results := make([]Result, 0, len(pending))
	var errs []error
	for i, in := range pending {
		var r Result
		if ctx.Err() != nil {
			// Stop sending, but still report every intent: each stays pending.
			r = clientResult(in)
			errs = append(errs, fmt.Errorf("%w: %s: %w", ErrStillPending, in.Key, ctx.Err()))
		} else {
			var err error
			r, err = c.send(ctx, in, false, false)
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

// List returns every intent in the journal as a Result, oldest first, with pending
// intents past KeyLifetime reported as IntentExpired. It sends nothing.
func (c *Client) List() []Result {
	now := time.Now()
	all := c.cfg.Journal.All()
	out := make([]Result, 0, len(all))
	for _, in := range all {
		r := clientResult(in)
		if c.Expired(in, now) {
			r.Status = IntentExpired
		}
		out = append(out, r)
	}
	return out
}

// Expired reports whether a pending intent is past the key lifetime and must not be
// sent again.
func (c *Client) Expired(in Intent, now time.Time) bool {
	// The server's lifetime starts at its first arrival, which is after CreatedAt, so
	// counting from CreatedAt errs on the safe side.
	return in.Status == IntentPending && now.Sub(in.CreatedAt) >= c.cfg.KeyLifetime
}

// send is the retry loop for one journaled intent.
func (c *Client) send(ctx context.Context, in Intent, dropFirst, forgetKey bool) (Result, error) {
	log := c.cfg.Logger.With("key", in.Key)
	var forgotten idem.Key
	var lastErr error
	retryNow := false            // the last response was dropped on purpose; no reason to wait
	var retryAfter time.Duration // the server's Retry-After on the last response
	for n := 1; n <= c.cfg.MaxAttempts; n++ {
		if c.Expired(in, time.Now()) {
			log.InfoContext(ctx, "intent expired; not sending", "created_at", in.CreatedAt)
			r := clientResult(in)
			r.Status, r.ForgottenKey = IntentExpired, forgotten
			return r, nil
		}
		if n > 1 && !retryNow {
			if err := c.sleep(ctx, n-1, retryAfter); err != nil {
				lastErr = err
				break
			}
		}
		retryNow, retryAfter = false, 0
		// Count the attempt before sending, so a crash mid-send still shows it.
		if err := c.cfg.Journal.RecordAttempt(in.Key); err != nil {
			return clientWithForgotten(clientResult(in), forgotten), fmt.Errorf("producer: send %s: %w", in.Key, err)
		}
		in.Attempts++

		resp, err := c.attempt(ctx, in)
		if err == nil && dropFirst {
			dropFirst = false
			log.InfoContext(ctx, "fault injection: dropping the first response", "http_status", resp.status)
			lastErr = fmt.Errorf("response %d dropped by fault injection", resp.status)
			if forgetKey {
				forgetKey = false
				next, ferr := c.clientRemint(ctx, in)
				if ferr != nil {
					return clientResult(in), ferr
				}
				forgotten, in = in.Key, next
				log = c.cfg.Logger.With("key", in.Key)
			}
			retryNow = true
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				lastErr = ctx.Err()
				break
			}
			lastErr = err
			log.DebugContext(ctx, "attempt failed; will retry", "attempt", in.Attempts, "err", err)
			continue
		}
		if clientRetryable(resp.status) {
			lastErr = fmt.Errorf("HTTP %d: %s", resp.status, clientSnippet(resp.body))
			retryAfter = resp.retryAfter
			log.DebugContext(ctx, "retryable response", "attempt", in.Attempts, "http_status", resp.status, "retry_after", retryAfter)
			continue
		}
		status := IntentDone
		if resp.status < 200 || resp.status > 299 {
			status = IntentRejected
		}
		if err := c.cfg.Journal.Done(in.Key, resp.status, resp.body, status); err != nil {
			return clientWithForgotten(clientResult(in), forgotten), fmt.Errorf("producer: send %s: %w", in.Key, err)
		}
		in.Status, in.HTTPStatus, in.Response = status, resp.status, resp.body
		r := clientResult(in)
		r.Replayed, r.ForgottenKey = resp.replayed, forgotten
		log.DebugContext(ctx, "intent finished", "status", status, "http_status", resp.status, "replayed", resp.replayed)
		return r, nil
	}
	return clientWithForgotten(clientResult(in), forgotten),
		fmt.Errorf("%w: %s after %d attempts: %w", ErrStillPending, in.Key, in.Attempts, lastErr)
}

// clientRemint implements ForgetKey: wipe the key, mint and journal a new one for the
// same payload.
func (c *Client) clientRemint(ctx context.Context, old Intent) (Intent, error) {
	if err := c.cfg.Journal.Forget(old.Key); err != nil {
		return Intent{}, fmt.Errorf("producer: forget key: %w", err)
	}
	next := Intent{
		Key:       idem.NewKey(),
		Scope:     old.Scope,
		Method:    old.Method,
		Path:      old.Path,
		Payload:   old.Payload,
		CreatedAt: time.Now(),
	}
	if err := c.cfg.Journal.Append(next); err != nil {
		return Intent{}, fmt.Errorf("producer: forget key: %w", err)
	}
	c.cfg.Logger.InfoContext(ctx, "fault injection: key forgotten, new key minted", "forgotten", old.Key, "key", next.Key)
	next.Status = IntentPending
	return next, nil
}

type clientResponse struct {
	status     int
	body       []byte
	replayed   bool
	retryAfter time.Duration // parsed Retry-After; 0 when absent or unreadable
}

// attempt sends one request and reads the whole response within Timeout. A response
// whose body cannot be read in full counts as lost: the server replays it on the
// next attempt.
func (c *Client) attempt(ctx context.Context, in Intent) (clientResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, in.Method, c.cfg.BaseURL+in.Path, bytes.NewReader(in.Payload))
	if err != nil {
		return clientResponse{}, fmt.Errorf("build request: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	req.Header.Set(idem.HeaderKey, string(in.Key))
	if in.Scope != "" {
		req.Header.Set(idem.HeaderScope, in.Scope)
	}
	resp, err := c.cfg.HTTPClient.Do(req)
	if err != nil {
		return clientResponse{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, c.cfg.MaxResponseBytes))
	if err != nil {
		return clientResponse{}, fmt.Errorf("read response: %w", err)
	}
	return clientResponse{
		status:     resp.StatusCode,
		body:       body,
		replayed:   strings.EqualFold(resp.Header.Get(idem.HeaderReplayed), "true"),
		retryAfter: parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()),
	}, nil
}

// parseRetryAfter reads a Retry-After value (RFC 9110 §10.2.3): delay-seconds or an
// HTTP-date. Anything else, and a date in the past, is 0: no hint.
func parseRetryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs <= 0 {
			return 0
		}
		return time.Duration(min(secs, int64(24*time.Hour/time.Second))) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return t.Sub(now)
	}
	return 0
}

// clientRetryable reports whether a response leaves the outcome open. 5xx: the server
// failed, perhaps before committing. 409: the first arrival with this key is still
// running. 408 and 429: the server asks us to come back. Any other status is final.
func clientRetryable(status int) bool {
	return status >= 500 || status == http.StatusConflict ||
		status == http.StatusRequestTimeout || status == http.StatusTooManyRequests
}

// sleep waits before retry number n (1-based), with full jitter. A server's
// Retry-After (atLeast) raises the wait to at least that long, capped at BackoffMax
// so one response cannot park the client for hours; a little jitter on top keeps
// the clients it answered together from coming back together.
func (c *Client) sleep(ctx context.Context, n int, atLeast time.Duration) error {
	ceiling := c.cfg.BackoffBase
	for i := 1; i < n && ceiling < c.cfg.BackoffMax; i++ {
		ceiling *= 2
	}
	ceiling = min(ceiling, c.cfg.BackoffMax)
	d := time.Duration(rand.Int64N(int64(ceiling) + 1))
	if atLeast = min(atLeast, c.cfg.BackoffMax); d < atLeast {
		d = atLeast + time.Duration(rand.Int64N(int64(c.cfg.BackoffBase)+1))
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// clientResult builds the Result for an intent's current state.
func clientResult(in Intent) Result {
	return Result{
		Key:        in.Key,
		Attempts:   in.Attempts,
		Status:     in.Status,
		HTTPStatus: in.HTTPStatus,
		Response:   clientJSON(in.Response),
	}
}

func clientWithForgotten(r Result, forgotten idem.Key) Result {
	r.ForgottenKey = forgotten
	return r
}

// clientJSON returns body as JSON: itself when it is valid JSON, a JSON string
// holding it otherwise, and nil when empty. Results embed response bodies as raw
// JSON; a proxy's HTML error page must not make the whole line unparseable.
func clientJSON(body []byte) json.RawMessage {
	if len(body) == 0 {
		return nil
	}
	if json.Valid(body) {
		return json.RawMessage(bytes.Clone(body))
	}
	s, _ := json.Marshal(string(body))
	return s
}

func clientSnippet(b []byte) string {
	const max = 200
	s := strings.TrimSpace(string(b))
	if len(s) > max {
		s = s[:max] + "..."
	}
	return strconv.Quote(s)
}
