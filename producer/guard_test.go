package producer_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/rawconn"

	"github.com/idemkit/idem/producer"
)

// seen is what a test server's handler was asked: method, path and body.
type seen struct {
	mu   sync.Mutex
	list []string
}

func (s *seen) add(r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	s.list = append(s.list, r.Method+" "+r.URL.Path+" "+string(body))
	s.mu.Unlock()
}

func (s *seen) get() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.list...)
}

// serveGuarded runs an HTTP server through producer.GuardListener (or, with
// guard false, without it) and returns its address and what its handler saw.
func serveGuarded(t *testing.T, guard bool) (string, *seen) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var s seen
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.add(r)
		_, _ = w.Write([]byte("ok"))
	})}
	served := ln
	if guard {
		served = producer.GuardListener(ln, slog.New(slog.DiscardHandler))
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(served)
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		<-done
	})
	return ln.Addr().String(), &s
}

// smuggling is a request that carries both Content-Length and Transfer-Encoding:
// framed by Content-Length (as a proxy in front may frame it) it is one request;
// framed by its chunked encoding, as net/http frames it, it ends early, and the
// rest of its body is a second request (POST /smuggled).
func smuggling(path string) string {
	hidden := "POST /smuggled HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}"
	body := "0\r\n\r\n" + hidden
	return "POST " + path + " HTTP/1.1\r\nHost: a\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\nTransfer-Encoding: chunked\r\n\r\n" + body
}

// A request carrying both Content-Length and Transfer-Encoding is answered 400
// and its connection closed: neither it nor the request hidden in its body
// reaches the handler. The request before it on the connection is served. Without
// the guard, net/http runs the hidden request and keeps the connection open.
func TestGuardListenerRefusesSmuggling(t *testing.T) {
	t.Parallel()
	stream := "GET /first HTTP/1.1\r\nHost: a\r\n\r\n" + smuggling("/pay")

	addr, s := serveGuarded(t, true)
	out, closed := rawconn.Exchange(t, addr, stream, 5*time.Second)
	if got := s.get(); len(got) != 1 || got[0] != "GET /first " {
		t.Errorf("the handler saw %q, want only GET /first", got)
	}
	if !strings.HasPrefix(out, "HTTP/1.1 200 OK\r\n") || strings.Count(out, "HTTP/1.1 ") != 2 || !strings.Contains(out, "HTTP/1.1 400 Bad Request\r\n") {
		t.Errorf("responses %q, want 200 then 400", out)
	}
	if !closed {
		t.Errorf("the connection was left open after the 400")
	}

	// The same bytes without the guard: what it is for.
	addr, s = serveGuarded(t, false)
	if _, closed := rawconn.Exchange(t, addr, stream, 5*time.Second); closed || len(s.get()) != 3 || s.get()[2] != "POST /smuggled {}" {
		t.Fatalf("without the guard: handler saw %q, closed=%v; the control no longer shows the hole", s.get(), closed)
	}
}

// Honest requests pass, pipelined on one connection, whatever their framing: a
// Content-Length body holding header-like text, a chunked body with an extension
// and a trailer, a request with neither.
func TestGuardListenerServesHonestRequests(t *testing.T) {
	t.Parallel()
	tricky := "\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n"
	stream := "POST /cl HTTP/1.1\r\nHost: a\r\nContent-Length: " + strconv.Itoa(len(tricky)) + "\r\n\r\n" + tricky +
		"POST /chunked HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Sum: 5\r\n\r\n" +
		"GET /last HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
	addr, s := serveGuarded(t, true)
	out, closed := rawconn.Exchange(t, addr, stream, 5*time.Second)
	want := []string{"POST /cl " + tricky, "POST /chunked abcde", "GET /last "}
	if got := s.get(); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("the handler saw %q, want %q", got, want)
	}
	if strings.Count(out, "HTTP/1.1 200 OK\r\n") != 3 || !closed {
		t.Errorf("responses %q (closed %v), want three 200s and the close asked for", out, closed)
	}
}

// The guard closes nothing it should not: a server's Shutdown still ends an idle
// guarded connection.
func TestGuardListenerShutdown(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {})}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(producer.GuardListener(ln, nil)) }()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: a\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 512)
	if _, err := c.Read(buf); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown with an idle guarded connection: %v", err)
	}
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		t.Fatalf("Serve: %v", err)
	}
}

// pipeListener hands net.Pipe connections to a server: a client's Write returns
// only once the server has read every byte of it, so a test can make the server
// read a request in exactly the pieces it chooses.
type pipeListener struct {
	conns  chan net.Conn
	closed chan struct{}
	once   sync.Once
}

func newPipeListener() *pipeListener {
	return &pipeListener{conns: make(chan net.Conn), closed: make(chan struct{})}
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

func (l *pipeListener) Addr() net.Addr { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)} }

func (l *pipeListener) dial() net.Conn {
	client, server := net.Pipe()
	l.conns <- server
	return client
}

// However net/http has received the refused request, nothing at all, part of its
// request line, part of a field, or all of it but the last LF, it answers 400 and
// closes: no handler sees the refused request or the one hidden in its body.
func TestGuardListenerRefusesWhateverNetHTTPAlreadyHas(t *testing.T) {
	t.Parallel()
	ln := newPipeListener()
	var s seen
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.add(r)
		_, _ = w.Write([]byte("ok"))
	})}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(producer.GuardListener(ln, slog.New(slog.DiscardHandler)))
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		<-done
	})

	const first = "GET /first HTTP/1.1\r\nHost: a\r\n\r\n"
	bad := smuggling("/pay")
	end := strings.Index(bad, "\r\n\r\n") + 4
	for _, tc := range []struct {
		name   string
		pieces []string
	}{
		{"in one piece", []string{bad}},
		{"after a request", []string{first + bad}},
		{"in the method", []string{"PO", bad[2:]}},
		{"in the target", []string{"POST /pa", bad[8:]}},
		{"after the version", []string{"POST /pay HTTP/1.1", bad[18:]}},
		{"in a field name", []string{bad[:strings.Index(bad, "Content-Length")+7], bad[strings.Index(bad, "Content-Length")+7:]}},
		{"in a field value", []string{bad[:strings.Index(bad, "chunked")+3], bad[strings.Index(bad, "chunked")+3:]}},
		{"after a field", []string{bad[:strings.Index(bad, "Transfer-Encoding")], bad[strings.Index(bad, "Transfer-Encoding"):]}},
		{"before the last CR", []string{bad[:end-2], bad[end-2:]}},
		{"before the last LF", []string{bad[:end-1], bad[end-1:]}},
		{"a request, then part", []string{first + bad[:30], bad[30:]}},
	} {
		c := ln.dial()
		responses := make(chan string, 1)
		go func() {
			var out bytes.Buffer
			_, _ = io.Copy(&out, c) // until the server closes
			responses <- out.String()
		}()
		for _, p := range tc.pieces {
			if _, err := io.WriteString(c, p); err != nil {
				break // closed by the server: the rest is never read
			}
		}
		var out string
		select {
		case out = <-responses:
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the connection was not closed", tc.name)
		}
		c.Close()
		if !strings.Contains(out, "HTTP/1.1 400 Bad Request\r\n") || strings.Count(out, "HTTP/1.1 ") != 1+strings.Count(tc.pieces[0], "/first") {
			t.Errorf("%s: responses %q, want a 400 after any for /first", tc.name, out)
		}
	}
	for _, got := range s.get() {
		if got != "GET /first " {
			t.Errorf("a handler saw %q", got)
		}
	}
}
