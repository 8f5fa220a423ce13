package client

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// response is what one attempt got back, read in full.
type response struct {
	status     int
	body       []byte
	replayed   bool
	retryAfter time.Duration // parsed Retry-After; 0 when absent or unreadable
}

// attempt sends one request and reads the whole response within Timeout. A response
// whose body cannot be read in full counts as lost: the server replays it on the
// next attempt.
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
	body, err := io.ReadAll(io.LimitReader(resp.Body, c.cfg.MaxResponseBytes))
	if err != nil {
		return response{}, fmt.Errorf("read response: %w", err)
	}
	return response{
		status:     resp.StatusCode,
		body:       body,
		replayed:   strings.EqualFold(resp.Header.Get(idem.HeaderReplayed), "true"),
		retryAfter: parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()),
	}, nil
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
