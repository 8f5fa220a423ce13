package client

import (
	"context"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// retryable reports whether a response leaves the outcome open. 5xx: the server
// failed, perhaps before committing. 409: the first arrival with this key is still
// running. 408, 425 and 429: the server asks us to come back (the ingress never
// stores them as a key's answer). Any other status is final, but for a redirect,
// which is no answer at all (see Client.send).
func retryable(status int) bool {
	return status >= 500 || status == http.StatusConflict ||
		status == http.StatusRequestTimeout || status == http.StatusTooEarly ||
		status == http.StatusTooManyRequests
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
