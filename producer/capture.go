package producer

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"net/textproto"
	"slices"
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
var errResponseTooLarge = errors.New("producer: response exceeds MaxResponseBytes")

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
	h := canonical(c.sent)
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

// canonical returns h with every field name in its canonical form, the values of
// names that differ only in case merged. A handler may write the map directly
// (h["set-cookie"]), and net/http sends such a name as it is; every rule below
// about a field must see it, whatever its spelling.
func canonical(h http.Header) http.Header {
	var odd []string // names not in canonical form
	for name := range h {
		if textproto.CanonicalMIMEHeaderKey(name) != name {
			odd = append(odd, name)
		}
	}
	if len(odd) == 0 {
		return h
	}
	slices.Sort(odd) // merged in one order, so a replay is the same every time
	for _, name := range odd {
		cn := textproto.CanonicalMIMEHeaderKey(name)
		h[cn] = append(h[cn], h[name]...)
		delete(h, name)
	}
	return h
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
