package producer

import (
	"bufio"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
)

// deliver runs stream through a framer in pieces of size n, as guardConn.Read
// does, and returns how many bytes reach net/http and whether it refuses.
func deliver(stream string, n int) (delivered int, reason string, f *framer) {
	f = &framer{state: stMessage}
	for i := 0; i < len(stream); i += n {
		piece := stream[i:min(i+n, len(stream))]
		start, why := f.feed([]byte(piece))
		if why != "" {
			return delivered + start, why, f
		}
		delivered += len(piece)
	}
	return delivered, "", f
}

// headerEnd is the offset just past the header block that begins at from.
func headerEnd(stream string, from int) int {
	i := strings.Index(stream[from:], "\r\n\r\n")
	if j := strings.Index(stream[from:], "\n\n"); i < 0 || j >= 0 && j+2 < i+4 {
		return from + j + 2
	}
	return from + i + 4
}

// The framer follows net/http's framing through every kind of body, however the
// bytes are split. It refuses before net/http has the whole header block of the
// request it refuses, or the byte where a body goes wrong; with the stream in one
// piece, exactly at the refused request's first byte, so the requests before it
// reach net/http whole.
func TestFramer(t *testing.T) {
	const get = "GET / HTTP/1.1\r\nHost: a\r\n\r\n"
	smuggle := "POST /pay HTTP/1.1\r\nHost: a\r\nContent-Length: 43\r\nTransfer-Encoding: chunked\r\n\r\n" +
		"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"
	const chunkedHead = "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
	cases := []struct {
		name   string
		stream string
		refuse bool
		at     int // with refuse: where the refused request begins
		body   int // with refuse, when its body is refused: the offset of the bad byte
	}{
		{name: "a GET", stream: get},
		{name: "Content-Length bodies, one holding header-like text",
			stream: "POST / HTTP/1.1\r\nContent-Length: 52\r\n\r\n" + "\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n" + get},
		{name: "repeated equal Content-Length", stream: "POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length:  2 \r\n\r\nab" + get},
		{name: "an honest chunked body with extensions and trailer",
			stream: chunkedHead + "5;x=y\r\nhello\r\nA  \r\n0123456789\r\n0\r\nX-Trailer: t\r\n\r\n" + get},
		{name: "chunked then a smuggling request", stream: chunkedHead + "3\r\nabc\r\n0\r\n\r\n" + smuggle,
			refuse: true, at: len(chunkedHead + "3\r\nabc\r\n0\r\n\r\n")},
		{name: "Content-Length and Transfer-Encoding", stream: smuggle, refuse: true},
		{name: "after a GET", stream: get + smuggle, refuse: true, at: len(get)},
		{name: "after CRLFs", stream: get + "\r\n\r\n" + smuggle, refuse: true, at: len(get) + 4},
		{name: "any case", stream: "POST / HTTP/1.1\r\ncontent-LENGTH: 5\r\nTRANSFER-encoding: CHUNKED\r\n\r\n0\r\n\r\n", refuse: true},
		{name: "Transfer-Encoding first", stream: "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n", refuse: true},
		{name: "folded Transfer-Encoding", stream: "POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n", refuse: true},
		{name: "bare LF line ends", stream: "POST / HTTP/1.1\nContent-Length: 5\nTransfer-Encoding: chunked\n\n0\r\n\r\n", refuse: true},
		{name: "Transfer-Encoding in HTTP/1.0", stream: "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", refuse: true},
		{name: "Transfer-Encoding with a long target in HTTP/1.0",
			stream: "POST /" + strings.Repeat("a", 600) + " HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n" + get, refuse: true},
		{name: "chunked with a long target and a long header",
			stream: "POST /" + strings.Repeat("a", 600) + " HTTP/1.1\r\nCookie: " + strings.Repeat("c", 900) + "\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n" + get},
		{name: "two Transfer-Encoding fields", stream: "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", refuse: true},
		{name: "Transfer-Encoding gzip", stream: "POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", refuse: true},
		{name: "differing Content-Length", stream: "POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc", refuse: true},
		{name: "signed Content-Length", stream: "POST / HTTP/1.1\r\nContent-Length: +2\r\n\r\nab", refuse: true},
		{name: "a chunk size with 0x", stream: chunkedHead + "0x2\r\nab\r\n0\r\n\r\n", refuse: true, body: len(chunkedHead) + 4},
		{name: "a chunk-size line with a bare LF", stream: chunkedHead + "2\nab\r\n0\r\n\r\n", refuse: true, body: len(chunkedHead) + 1},
		{name: "chunk data without its CRLF", stream: chunkedHead + "2\r\nabc\r\n0\r\n\r\n", refuse: true, body: len(chunkedHead) + 5},
	}
	for _, tc := range cases {
		limit := tc.body + 1 // delivered must stay below it
		if tc.refuse && tc.body == 0 {
			limit = headerEnd(tc.stream, tc.at)
		}
		for _, n := range []int{1, 3, 7, 64, len(tc.stream)} {
			delivered, reason, f := deliver(tc.stream, n)
			switch {
			case tc.refuse && reason == "":
				t.Errorf("%s (pieces of %d): not refused", tc.name, n)
			case tc.refuse && delivered >= limit:
				t.Errorf("%s (pieces of %d): %d bytes delivered, want fewer than %d (%s)", tc.name, n, delivered, limit, reason)
			case tc.refuse && tc.body == 0 && n == len(tc.stream) && delivered != tc.at:
				t.Errorf("%s (whole): %d bytes delivered, want %d (%s)", tc.name, delivered, tc.at, reason)
			case !tc.refuse && reason != "":
				t.Errorf("%s (pieces of %d): refused: %s", tc.name, n, reason)
			case !tc.refuse && f.state != stMessage:
				t.Errorf("%s (pieces of %d): ends in state %d, want between requests", tc.name, n, f.state)
			}
		}
	}
}

// FuzzFramerFollowsNetHTTP feeds one stream to net/http's request reader and to
// the framer: wherever net/http reads a request, whole with its body, the framer
// must see a request begin at the same byte, or have refused before it. A framer
// out of step with net/http would check the wrong bytes as header blocks.
func FuzzFramerFollowsNetHTTP(f *testing.F) {
	for _, s := range []string{
		"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET /2 HTTP/1.1\r\nHost: a\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabcGET / HTTP/1.1\r\nHost: a\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;e\r\nabc\r\n0\r\nT: 1\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
		"POST / HTTP/1.0\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
		"POST / HTTP/1.1\nHost: a\nContent-Length: 1\nTransfer-Encoding: chunked\n\n0\r\n\r\nGET / HTTP/1.1\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\r\n chunked\r\n\r\n1\r\na\r\n0\r\n\r\nGET / HTTP/1.1\r\n\r\n",
		"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nabGET / HTTP/1.1\r\n\r\n",
		"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1 \r\na\r\n0\r\n\n",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, stream string) {
		// The framer: where it sees each request begin, and where it refuses.
		fr := &framer{state: stMessage}
		starts := map[int]bool{}
		refusedAt := len(stream) + 1
		for i := 0; i < len(stream); i++ { // a byte at a time: every split at once
			before := fr.state
			start, reason := fr.feed([]byte{stream[i]})
			if reason != "" {
				refusedAt = i + start
				if fr.state == stHeader {
					refusedAt = min(refusedAt, lastStart(starts, i))
				}
				break
			}
			if before == stMessage && fr.state == stHeader {
				starts[i] = true
			}
		}
		// net/http.
		br := bufio.NewReader(strings.NewReader(stream))
		for offset := 0; offset < len(stream); {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			if _, err := io.Copy(io.Discard, req.Body); err != nil {
				return
			}
			if offset < refusedAt && !starts[offset] {
				t.Fatalf("net/http read a request at byte %d that the framer did not see begin there (it saw %v, refused at %d)\n%q",
					offset, sortedKeys(starts), refusedAt, stream)
			}
			offset = len(stream) - br.Buffered()
		}
	})
}

func lastStart(starts map[int]bool, before int) int {
	last := 0
	for s := range starts {
		if s <= before && s > last {
			last = s
		}
	}
	return last
}

func sortedKeys(m map[int]bool) []int {
	var out []int
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
