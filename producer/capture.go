package producer

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
)

// response is a response as captured from the handler or read from a record.
type response struct {
	status int
	header http.Header
	body   []byte
}

// capture is an http.ResponseWriter that records instead of sending. Like a real
// ResponseWriter it freezes the header at the first WriteHeader or Write, so the
// stored response is exactly what the client would have seen.
type capture struct {
	header   http.Header // the handler's working header
	sent     http.Header // the snapshot taken when the status was written
	status   int
	body     bytes.Buffer
	limit    int64 // MaxResponseBytes
	overflow bool  // the handler tried to write more than limit
}

// errResponseTooLarge is what a handler's Write returns past MaxResponseBytes.
var errResponseTooLarge = errors.New("middleware: response exceeds MaxResponseBytes")

func newCapture(limit int64) *capture { return &capture{header: http.Header{}, limit: limit} }

func (c *capture) Header() http.Header { return c.header }

func (c *capture) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code)) // as net/http does
	}
	if c.status != 0 || code < 200 {
		// Already written, or informational (1xx): a replay cannot send 1xx.
		return
	}
	c.status = code
	c.sent = c.header.Clone()
}

func (c *capture) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if c.overflow || int64(c.body.Len())+int64(len(p)) > c.limit {
		c.overflow = true
		return 0, errResponseTooLarge
	}
	return c.body.Write(p)
}

// result returns what the handler answered, cleaned for storage and replay.
func (c *capture) result() response {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	h := c.sent
	// These describe one connection or one transfer, not the response, and net/http
	// recomputes them; replaying the first ones would be wrong.
	for _, name := range []string{
		"Connection", "Keep-Alive", "Proxy-Connection", "Transfer-Encoding", "Upgrade",
		"Trailer", "Te", "Content-Length", "Date",
	} {
		h.Del(name)
	}
	body := c.body.Bytes()
	if _, ok := h["Content-Type"]; !ok && len(body) > 0 {
		// net/http would sniff it on the wire; do it now so replays match.
		h.Set("Content-Type", http.DetectContentType(body))
	}
	if body == nil {
		body = []byte{}
	}
	return response{status: c.status, header: h, body: body}
}

// storedHeader is what of a response's header is kept for replays. Set-Cookie is a
// credential for whoever got the first response, and a replay goes to anyone who
// presents the same scope, key and body: the first response carries it, replays
// never do.
func storedHeader(h http.Header) http.Header {
	if _, ok := h["Set-Cookie"]; !ok {
		return h
	}
	h = h.Clone()
	h.Del("Set-Cookie")
	return h
}
