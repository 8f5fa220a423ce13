package client

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// response is what one attempt got back, read in full up to MaxResponseBytes.
type response struct {
	status     int
	body       []byte // at most MaxResponseBytes
	truncated  bool   // the body was longer than MaxResponseBytes; body is its start
	replayed   bool
	retryAfter time.Duration // parsed Retry-After; 0 when absent or unreadable
	location   string        // Location of a redirect
}

// attempt sends one request and reads the whole response within Timeout. A response
// whose body cannot be read in full counts as lost: the server replays it on the
// next attempt. A body longer than MaxResponseBytes is not lost but cut: the server
// did answer, and its first MaxResponseBytes are kept, marked truncated. A redirect
// comes back as it is: the http.Client never follows one (see Config.validate).
func (c *Client) attempt(ctx context.Context, in Intent) (response, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, in.Method, c.cfg.BaseURL+in.Path, bytes.NewReader(in.Payload))
	if err != nil {
		return response{}, fmt.Errorf("build request: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	req.Header.Set(idem.HeaderKey, string(in.Key))
	if in.Scope != "" {
		req.Header.Set(idem.HeaderScope, in.Scope)
	}
	resp, err := c.cfg.HTTPClient.Do(req)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	// One byte more than the limit tells a body of exactly MaxResponseBytes from a
	// longer one.
	limit := c.cfg.MaxResponseBytes
	if limit < math.MaxInt64 {
		limit++
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, limit))
	if err != nil {
		return response{}, fmt.Errorf("read response: %w", err)
	}
	truncated := int64(len(body)) > c.cfg.MaxResponseBytes
	if truncated {
		body = body[:c.cfg.MaxResponseBytes]
	}
	return response{
		status:     resp.StatusCode,
		body:       body,
		truncated:  truncated,
		replayed:   strings.EqualFold(resp.Header.Get(idem.HeaderReplayed), "true"),
		retryAfter: parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()),
		location:   resp.Header.Get("Location"),
	}, nil
}

// redirected reports whether status is a redirect (3xx).
func redirected(status int) bool { return status >= 300 && status <= 399 }

// redirectError explains a redirect answer, for Result.Error and the error Submit
// and Resume return.
func redirectError(resp response) string {
	to := "without a Location"
	if resp.location != "" {
		to = "to " + strconv.Quote(resp.location)
	}
	return fmt.Sprintf("HTTP %d redirect %s, not followed: a redirect is not the service's answer to the request "+
		"(following it would send another request, or this one elsewhere); the intent stays pending: "+
		"check the service URL (Config.BaseURL), then Resume sends it again with the same key", resp.status, to)
}

// rawJSON returns body as JSON: itself when it is valid JSON, a JSON string holding
// it otherwise, and nil when empty. Results embed response bodies as raw JSON; a
// proxy's HTML error page must not make the whole line unparseable.
func rawJSON(body []byte) json.RawMessage {
	if len(body) == 0 {
		return nil
	}
	if json.Valid(body) {
		return json.RawMessage(bytes.Clone(body))
	}
	s, _ := json.Marshal(string(body))
	return s
}

// snippet quotes the start of a response body for an error message.
func snippet(b []byte) string {
	const max = 200
	s := strings.TrimSpace(string(b))
	if len(s) > max {
		s = s[:max] + "..."
	}
	return strconv.Quote(s)
}
