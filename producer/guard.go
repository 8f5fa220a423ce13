package producer

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// GuardListener returns ln with every connection it accepts checked for request
// smuggling: a request that carries both Content-Length and Transfer-Encoding is
// answered 400 and its connection closed before net/http reads it, and so is any
// request whose framing net/http would read differently from a proxy in front
// (Transfer-Encoding on HTTP/1.0, a malformed Content-Length or chunk size). Serve
// through it:
//
//	srv.Serve(producer.GuardListener(ln, logger))
//
// Why a listener and not a handler: net/http frames such a request by its chunked
// encoding, which may end early, and reads the rest of the declared body as the
// next request on the connection, which a proxy framing by Content-Length never
// saw (RFC 9112 §6.1, §11.2). It deletes the Content-Length before any handler
// runs, so no handler or middleware can tell that request from an honest chunked
// one. The guard reads the bytes themselves: it follows each request's framing
// (Content-Length, or chunked with its trailer) as net/http does, and checks every
// request's header block as it completes, before net/http may act on it.
// Requests before the refused one are served as usual. An honest chunked request
// (no Content-Length) passes.
//
// It must see the HTTP bytes: put it above TLS (srv.Serve(GuardListener(
// tls.NewListener(ln, cfg), logger)) gives up net/http's HTTP/2 over TLS and
// Request.TLS), or terminate TLS in the proxy in front. HTTP/2 is not affected by
// this kind of smuggling. A connection a handler hijacks (a CONNECT tunnel, a
// WebSocket) is still read as HTTP/1.1 afterwards; serve those elsewhere. log
// receives one warning per refused connection (nil: slog.Default()).
func GuardListener(ln net.Listener, log *slog.Logger) net.Listener {
	if log == nil {
		log = slog.Default()
	}
	return &guardListener{Listener: ln, log: log}
}

type guardListener struct {
	net.Listener
	log *slog.Logger
}

func (l *guardListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &guardConn{Conn: c, log: l.log, f: framer{state: stMessage}}, nil
}

// errRefused is what a refused connection's reads return once nothing is left
// to deliver. net/http does not read past the 400 it answers to refusedLine; a
// handler reading a refused body gets this error.
var errRefused = errors.New("producer: request refused: its framing is ambiguous (possible request smuggling)")

// refusedLine is delivered to net/http in place of a refused request: the rest
// of a line holding a NUL and an empty line, which it refuses with 400 Bad
// Request and Connection: close, whatever of the refused request it already has
// (a NUL is invalid in a method, a target, a version, a field name or value). A
// read error would not do: between requests net/http closes silently on one.
const refusedLine = "\x00\r\n\r\n"

// guardConn runs the bytes net/http reads through a framer, and refuses the
// connection from the first byte of a request whose header block is refused.
type guardConn struct {
	net.Conn
	log *slog.Logger

	// net/http reads a connection from one goroutine at a time (its background
	// read included), so the bytes reach the framer in order; mu only keeps a
	// handler that reads a hijacked connection from two from racing on it.
	mu      sync.Mutex
	f       framer
	pending []byte // what is left of refusedLine to deliver
	refused atomic.Bool
}

func (c *guardConn) Read(p []byte) (int, error) {
	if c.refused.Load() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if len(c.pending) == 0 || len(p) == 0 {
			return 0, errRefused
		}
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	n, err := c.Conn.Read(p)
	if n == 0 {
		return n, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	start, reason := c.f.feed(p[:n])
	if reason == "" {
		return n, err
	}
	c.refused.Store(true)
	c.log.Warn("producer: refused a request whose framing a proxy could read differently (request smuggling); closing the connection",
		"remote", c.Conn.RemoteAddr().String(), "reason", reason)
	if c.f.state != stHeader {
		// In a body: the handler reading it gets the error, and net/http, which
		// cannot finish the body, closes the connection.
		return 0, errRefused
	}
	c.pending = []byte(refusedLine)
	if start > 0 {
		// The requests before the refused one are delivered whole; refusedLine
		// follows in the next read, where net/http begins the refused one.
		return start, nil
	}
	n = copy(p, c.pending)
	c.pending = c.pending[n:]
	return n, nil
}

// CloseWrite half-closes the connection when the underlying one can (TCP):
// net/http uses it to let a client read an error response it sends while the
// client is still sending.
func (c *guardConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// lingerRefused bounds how long, and how much, a refused connection is read and
// discarded before it is closed.
const (
	lingerRefused      = 250 * time.Millisecond
	lingerRefusedBytes = 256 << 10
)

// Close closes the connection. A refused one is half-closed first and what the
// client still sends is discarded for a moment: closing a socket with unread
// data resets it, and the client could lose the 400 before reading it.
func (c *guardConn) Close() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok && c.refused.Load() {
		if cw.CloseWrite() == nil && c.Conn.SetReadDeadline(time.Now().Add(lingerRefused)) == nil {
			_, _ = io.CopyN(io.Discard, c.Conn, lingerRefusedBytes)
		}
	}
	return c.Conn.Close()
}

// The framer's states: where in the HTTP/1.1 request stream the next byte is.
const (
	stMessage   = iota // before a request line (CR and LF are skipped)
	stHeader           // in the request line or a header field line
	stBody             // in a Content-Length body: remain bytes left
	stChunkSize        // in a chunk-size line
	stChunkData        // in chunk data: remain bytes left
	stChunkEnd         // in the CRLF after chunk data: remain bytes of it left
	stTrailer          // in the trailer section after the last chunk
)

// What the framer keeps of a line, and net/http's limit on a chunk-size line.
const (
	maxLineKept  = 256
	tailKept     = 16
	maxChunkLine = 4096
)

// framer follows a request stream as net/http reads it: each request line and
// header block, then the body framed by Content-Length or by chunked encoding.
type framer struct {
	state  int
	remain uint64

	// The current line: its first maxLineKept bytes, its last bytes (a request
	// line's version is at its end), and how long it is.
	line    []byte
	tail    []byte
	lineLen int

	// The header block being read.
	blockStart  int // offset in the current feed where it began; -1: in an earlier one
	requestLine bool
	http11      bool      // the request line ends in HTTP/1.1 (or a later 1.x)
	last        *[]string // the field a continuation line extends, if one we track
	cl, te      []string
	cut         bool // a tracked field line was longer than maxLineKept
}

// feed advances the framer over b. When a header block that must be refused
// completes in b, or a body's framing goes wrong, it returns a reason; for a
// header block also the offset in b where that request began (0 when it began in
// an earlier feed), with the framer left in stHeader.
func (f *framer) feed(b []byte) (start int, reason string) {
	for i := 0; i < len(b); {
		switch f.state {
		case stMessage:
			if b[i] == '\r' || b[i] == '\n' {
				i++
				continue
			}
			f.state, f.blockStart, f.requestLine = stHeader, i, true
			f.http11, f.cl, f.te, f.last, f.cut = false, f.cl[:0], f.te[:0], nil, false
		case stBody, stChunkData:
			n := min(f.remain, uint64(len(b)-i))
			f.remain -= n
			i += int(n)
			if f.remain > 0 {
				continue
			}
			if f.state == stBody {
				f.state = stMessage
			} else {
				f.state, f.remain = stChunkEnd, 2
			}
		case stChunkEnd:
			want := "\r\n"[2-f.remain]
			if b[i] != want {
				return f.refused("chunk data not followed by CRLF")
			}
			i++
			if f.remain--; f.remain == 0 {
				f.state = stChunkSize
			}
		default: // a line: header, chunk size or trailer
			j := bytes.IndexByte(b[i:], '\n')
			end := len(b)
			if j >= 0 {
				end = i + j
			}
			f.keep(b[i:end])
			if f.state == stChunkSize && f.lineLen >= maxChunkLine {
				return f.refused("chunk-size line too long")
			}
			if j < 0 {
				i = len(b)
				continue
			}
			i = end + 1
			if reason := f.endLine(); reason != "" {
				return f.refused(reason)
			}
		}
	}
	f.blockStart = -1 // a block still open continues in the next feed
	return 0, ""
}

// refused is feed's answer for a request refused now.
func (f *framer) refused(reason string) (int, string) {
	if f.state == stHeader && f.blockStart > 0 {
		return f.blockStart, reason
	}
	return 0, reason
}

// keep adds part of the current line.
func (f *framer) keep(part []byte) {
	if room := maxLineKept - len(f.line); room > 0 {
		f.line = append(f.line, part[:min(room, len(part))]...)
	}
	f.tail = append(f.tail, part[max(0, len(part)-tailKept):]...)
	if len(f.tail) > tailKept {
		f.tail = append(f.tail[:0], f.tail[len(f.tail)-tailKept:]...)
	}
	f.lineLen += len(part)
}

// endLine handles the line just completed (without its LF).
func (f *framer) endLine() string {
	line, tail, whole := f.line, f.tail, f.lineLen <= maxLineKept
	f.line, f.tail, f.lineLen = f.line[:0], f.tail[:0], 0
	crlf := len(line) > 0 && line[len(line)-1] == '\r' && whole
	if crlf {
		line = line[:len(line)-1]
	}
	tail = bytes.TrimSuffix(tail, []byte("\r"))
	switch f.state {
	case stChunkSize:
		// As net/http: CRLF and no other CR; trailing spaces and tabs, then
		// extensions after ';', dropped; 1 to 16 hex digits. (A line longer than
		// maxLineKept, which net/http may take, is refused: only long extensions
		// make one.)
		if !crlf || bytes.IndexByte(line, '\r') >= 0 {
			return "chunk-size line not ended by CRLF, or too long"
		}
		line = bytes.TrimRight(line, " \t")
		if k := bytes.IndexByte(line, ';'); k >= 0 {
			line = line[:k]
		}
		size, err := strconv.ParseUint(string(line), 16, 64)
		if err != nil || len(line) > 16 || !isHex(line) {
			return fmt.Sprintf("malformed chunk size %q", line)
		}
		if size == 0 {
			f.state = stTrailer
		} else {
			f.state, f.remain = stChunkData, size
		}
		return ""
	case stTrailer:
		if len(line) == 0 && whole {
			f.state = stMessage
		}
		return ""
	}
	// stHeader. net/http's line reader drops one CR before the LF.
	if f.requestLine {
		f.requestLine = false
		f.http11 = endsInHTTP11(tail)
		return ""
	}
	if len(line) == 0 && whole {
		return f.endHeader()
	}
	if line[0] == ' ' || line[0] == '\t' {
		// A continuation (obs-fold): net/http joins it to the field above.
		if f.last != nil {
			if !whole {
				f.cut = true
			}
			v := *f.last
			v[len(v)-1] += " " + string(bytes.Trim(line, " \t"))
		}
		return ""
	}
	f.last = nil
	name, value, ok := bytes.Cut(line, []byte(":"))
	if !ok {
		return "" // net/http refuses it, and closes the connection
	}
	name = bytes.Trim(name, " \t")
	switch {
	case bytes.EqualFold(name, []byte("Content-Length")):
		f.last = &f.cl
	case bytes.EqualFold(name, []byte("Transfer-Encoding")):
		f.last = &f.te
	default:
		return ""
	}
	if !whole {
		f.cut = true
	}
	*f.last = append(*f.last, string(bytes.Trim(value, " \t")))
	return ""
}

// endHeader decides a request whose header block just ended, and frames its body.
func (f *framer) endHeader() string {
	switch {
	case f.cut:
		return "a Content-Length or Transfer-Encoding field too long to read"
	case len(f.te) > 0 && len(f.cl) > 0:
		return "both Content-Length and Transfer-Encoding"
	case len(f.te) > 0 && !f.http11:
		// net/http ignores it below HTTP/1.1, where a proxy may not.
		return "Transfer-Encoding in a request that is not HTTP/1.1"
	case len(f.te) > 0:
		// net/http takes exactly one field, "chunked", and refuses anything else.
		if len(f.te) != 1 || !equalFoldString(f.te[0], "chunked") {
			return fmt.Sprintf("Transfer-Encoding %q", f.te)
		}
		f.state = stChunkSize
		return ""
	case len(f.cl) > 0:
		// net/http takes repeated fields with one value, and only digits.
		n, err := strconv.ParseUint(f.cl[0], 10, 63)
		if err != nil || !isDigits(f.cl[0]) {
			return fmt.Sprintf("malformed Content-Length %q", f.cl[0])
		}
		for _, v := range f.cl[1:] {
			if v != f.cl[0] {
				return fmt.Sprintf("Content-Length fields that differ: %q", f.cl)
			}
		}
		if n == 0 {
			f.state = stMessage
		} else {
			f.state, f.remain = stBody, n
		}
		return ""
	}
	f.state = stMessage
	return ""
}

// endsInHTTP11 reports whether a request line ends in " HTTP/1.1", or a later
// 1.x, which net/http reads as 1.1: only then does it frame a body by
// Transfer-Encoding. (It takes the version after the line's second space; a
// target with a space in it makes the version invalid, and the request refused.)
func endsInHTTP11(tail []byte) bool {
	const v = " HTTP/1."
	if len(tail) < len(v)+1 || !bytes.HasSuffix(tail[:len(tail)-1], []byte(v)) {
		return false
	}
	minor := tail[len(tail)-1]
	return '1' <= minor && minor <= '9'
}

func isHex(b []byte) bool {
	for _, c := range b {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return len(b) > 0
}

func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}

func equalFoldString(a, b string) bool { return bytes.EqualFold([]byte(a), []byte(b)) }
