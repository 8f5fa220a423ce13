package client

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// Client defaults; a zero field in Config means the value here.
const (
	// DefaultBaseURL is the demo service's ingress (cmd/worker's default address).
	DefaultBaseURL = "http://127.0.0.1:8080"
	// DefaultMaxAttempts bounds the sends of one Submit or Resume call.
	DefaultMaxAttempts = 8
	// defaultBackoffBase and defaultBackoffMax shape the jittered wait between
	// attempts.
	defaultBackoffBase = 100 * time.Millisecond
	defaultBackoffMax  = 10 * time.Second
	// DefaultTimeout bounds one attempt, response body included.
	DefaultTimeout = 10 * time.Second
	// DefaultKeyLifetime is how long the client keeps re-sending a pending intent:
	// after 24h it stops and reports the intent expired. It must be shorter than the
	// server's request key lifetime (48h by default) and the consumers' inbox
	// lifetime (72h by default), so that every retry still finds its key remembered
	// at each hop.
	DefaultKeyLifetime = 24 * time.Hour
	// defaultMaxResponseBytes bounds the response body kept in the Store.
	defaultMaxResponseBytes = 1 << 20
)

// Config configures a Client. The zero value of every field but Store means its
// default, so Config{Store: journal} is a working configuration.
type Config struct {
	// Store holds the intents, usually a *Journal. Required. The Client does not
	// close it.
	Store Store
	// BaseURL of the service, without a trailing path. Default DefaultBaseURL.
	BaseURL string
	// HTTPClient sends the requests. Default: a client without a total timeout
	// (Timeout bounds each attempt instead). Redirects are never followed, whatever
	// its CheckRedirect says: New uses a copy of it with CheckRedirect returning
	// http.ErrUseLastResponse, and leaves the caller's value as it was. (Following a
	// redirect would journal the answer to another request as the intent's.)
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
	// Retry-After on a retryable response (409, 425, 429, 503) sets the least wait
	// before the next attempt, up to BackoffMax. Defaults 100ms and 10s.
	BackoffBase, BackoffMax time.Duration
	// Timeout bounds one attempt, response body included. Default 10s.
	Timeout time.Duration
	// KeyLifetime is how long a pending intent is re-sent, counted from its
	// CreatedAt. Default 24h (see DefaultKeyLifetime). An older pending intent is
	// not re-sent: the server may have forgotten its key, and a late retry would then
	// be a second effect. It is reported as expired. It must be shorter than the
	// key lifetimes of the service it talks to. How the age is measured when the
	// clock is changed is in Client.Expired.
	KeyLifetime time.Duration
	// MaxResponseBytes bounds the response body read and stored. Default 1 MiB. A
	// longer body still finishes the intent (the service did answer); its first
	// MaxResponseBytes are kept and Result.Truncated is set.
	MaxResponseBytes int64
	// Logger receives retries at debug and info level. Default: discard.
	Logger *slog.Logger
}

// noRedirects is the CheckRedirect of the Client's http.Client: the redirect
// response is returned as it is.
func noRedirects(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// validate checks c and fills in the defaults.
func (c *Config) validate() error {
	if c.Store == nil {
		return errors.New("client: config: Store is required")
	}
	if c.BaseURL == "" {
		c.BaseURL = DefaultBaseURL
	}
	u, err := url.Parse(c.BaseURL)
	if err != nil {
		return fmt.Errorf("client: config: BaseURL: %w", err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("client: config: BaseURL %q: want http(s)://host[:port]", c.BaseURL)
	}
	c.BaseURL = strings.TrimRight(c.BaseURL, "/")
	// Never follow a redirect: net/http would turn the POST into a GET of the
	// Location (or re-send it there), and its answer would be journaled as the
	// intent's. A copy, so the caller's client is not changed under them.
	hc := http.Client{}
	if c.HTTPClient != nil {
		hc = *c.HTTPClient
	}
	hc.CheckRedirect = noRedirects
	c.HTTPClient = &hc
	if err := idem.ValidateScope(c.Scope); err != nil {
		return fmt.Errorf("client: config: Scope: %w", err)
	}
	for _, f := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"BackoffBase", &c.BackoffBase, defaultBackoffBase},
		{"BackoffMax", &c.BackoffMax, defaultBackoffMax},
		{"Timeout", &c.Timeout, DefaultTimeout},
		{"KeyLifetime", &c.KeyLifetime, DefaultKeyLifetime},
	} {
		if *f.v < 0 {
			return fmt.Errorf("client: config: %s is negative: %v", f.name, *f.v)
		}
		if *f.v == 0 {
			*f.v = f.def
		}
	}
	if c.BackoffMax < c.BackoffBase {
		return fmt.Errorf("client: config: BackoffMax %v is below BackoffBase %v", c.BackoffMax, c.BackoffBase)
	}
	if c.MaxAttempts < 0 {
		return fmt.Errorf("client: config: MaxAttempts is negative: %d", c.MaxAttempts)
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.MaxResponseBytes < 0 {
		return fmt.Errorf("client: config: MaxResponseBytes is negative: %d", c.MaxResponseBytes)
	}
	if c.MaxResponseBytes == 0 {
		c.MaxResponseBytes = defaultMaxResponseBytes
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}
