// Package smtptest is a real SMTP server over a TCP socket, in-process, for tests:
// it speaks enough of RFC 5321 for an SMTP client such as go-mail (EHLO/HELO, MAIL
// FROM, RCPT TO, DATA, RSET, NOOP, QUIT), keeps every message it accepts, and can say how many raw
// deliveries it received and how many distinct Message-IDs among them.
//
// The distinction is the point. A downstream that dedupes on Message-ID (most
// mail systems fold a repeated Message-ID in a mailbox) shows the recipient one
// message per distinct Message-ID; the raw count is what a downstream that does not
// dedupe would deliver. A test of "one message per key through a worker killed
// mid-send" asserts both: the re-send happened (2 raw) and carried the same
// Message-ID (1 distinct).
//
// Faults: HangUpAfterData makes the server accept and store the next messages and
// then drop the connection without answering, so the client cannot tell that its
// message went through — the ambiguous window of every external effect. OnData
// runs a hook while a message is in flight (stored, not yet answered): a test can
// hold a send there, or act as if the sending process died at that moment.
package smtptest

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"mime/quotedprintable"
	"net"
	"net/mail"
	"net/textproto"
	"strings"
	"sync"
	"testing"
)

// Message is one message the server accepted.
type Message struct {
	// From and To are the envelope (MAIL FROM and RCPT TO).
	From string
	To   []string
	// Data is the message as received, with dot-stuffing undone and line endings
	// as "\n".
	Data []byte
	// Header and Body are Data parsed (empty if it did not parse); Body has a
	// quoted-printable transfer encoding undone.
	Header mail.Header
	Body   []byte
	// MessageID is the Message-ID header, or "".
	MessageID string
}

// Server is a running SMTP server. Its methods are safe for concurrent use.
type Server struct {
	ln net.Listener
	wg sync.WaitGroup

	mu       sync.Mutex
	conns    map[net.Conn]struct{}
	closed   bool
	messages []Message
	hangUps  int
	onData   func(Message)
}

// New starts a server on a free port of 127.0.0.1. Close stops it.
func New() (*Server, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("smtptest: listen: %w", err)
	}
	s := &Server{ln: ln, conns: map[net.Conn]struct{}{}}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Start starts a server for t and closes it when the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	s, err := New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops accepting, drops open connections and waits for their goroutines.
func (s *Server) Close() {
	s.mu.Lock()
	s.closed = true
	for c := range s.conns {
		_ = c.Close()
	}
	s.mu.Unlock()
	_ = s.ln.Close()
	s.wg.Wait()
}

// HangUpAfterData makes the server accept and store each of the next n messages
// and then close the connection instead of answering the DATA: the message was
// delivered, but the client sees a broken connection.
func (s *Server) HangUpAfterData(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hangUps = n
}

// OnData sets a hook run for each accepted message after it is stored and before
// it is answered (nil removes it). It may block; the client waits for the answer.
func (s *Server) OnData(f func(Message)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.onData = f
}

// Messages returns a copy of every message accepted so far, in order.
func (s *Server) Messages() []Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Message(nil), s.messages...)
}

// Deliveries is how many messages were accepted: what a downstream that does not
// dedupe would deliver.
func (s *Server) Deliveries() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.messages)
}

// DistinctMessageIDs is how many distinct Message-IDs the accepted messages
// carry (a message without one counts as distinct): what a downstream that dedupes
// on Message-ID would deliver.
func (s *Server) DistinctMessageIDs() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	seen := map[string]bool{}
	n := 0
	for _, m := range s.messages {
		if m.MessageID == "" {
			n++
			continue
		}
		if !seen[m.MessageID] {
			seen[m.MessageID] = true
			n++
		}
	}
	return n
}

// DeliveriesOf is how many accepted messages carry messageID.
func (s *Server) DeliveriesOf(messageID string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, m := range s.messages {
		if m.MessageID == messageID {
			n++
		}
	}
	return n
}

func (s *Server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return // closed
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			_ = c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			defer func() {
				s.mu.Lock()
				delete(s.conns, c)
				s.mu.Unlock()
				_ = c.Close()
			}()
			s.serve(c)
		}()
	}
}

// session is one connection's envelope state.
type session struct {
	greeted bool
	from    string
	hasFrom bool
	to      []string
}

func (ss *session) reset() { ss.from, ss.hasFrom, ss.to = "", false, nil }

// serve runs one SMTP conversation. Replies follow RFC 5321's codes: 250 ok, 354
// go ahead, 221 bye, 501 bad arguments, 502 unknown command, 503 bad sequence.
func (s *Server) serve(c net.Conn) {
	tc := textproto.NewConn(c)
	reply := func(format string, args ...any) bool { return tc.PrintfLine(format, args...) == nil }
	if !reply("220 smtptest ESMTP ready") {
		return
	}
	var ss session
	for {
		line, err := tc.ReadLine()
		if err != nil {
			return
		}
		verb, arg, _ := strings.Cut(line, " ")
		verb = strings.ToUpper(verb)
		var ok bool
		switch verb {
		case "EHLO":
			ss.greeted = true
			ss.reset()
			ok = reply("250-smtptest greets %s", arg) && reply("250-8BITMIME") && reply("250 HELP")
		case "HELO":
			ss.greeted = true
			ss.reset()
			ok = reply("250 smtptest")
		case "MAIL":
			addr, err := pathArg(arg, "FROM:")
			switch {
			case !ss.greeted:
				ok = reply("503 5.5.1 say EHLO or HELO first")
			case err != nil:
				ok = reply("501 5.5.4 %v", err)
			default:
				ss.reset()
				ss.from, ss.hasFrom = addr, true
				ok = reply("250 2.1.0 ok")
			}
		case "RCPT":
			addr, err := pathArg(arg, "TO:")
			switch {
			case !ss.hasFrom:
				ok = reply("503 5.5.1 need MAIL FROM first")
			case err != nil || addr == "":
				ok = reply("501 5.5.4 bad recipient %q", arg)
			default:
				ss.to = append(ss.to, addr)
				ok = reply("250 2.1.5 ok")
			}
		case "DATA":
			if len(ss.to) == 0 {
				ok = reply("503 5.5.1 need RCPT TO first")
				break
			}
			if !reply("354 end data with <CR><LF>.<CR><LF>") {
				return
			}
			data, err := tc.ReadDotBytes()
			if err != nil {
				return // the client went away mid-message: nothing was accepted
			}
			m := parse(ss.from, ss.to, data)
			hangUp, hook := s.store(m)
			if hook != nil {
				hook(m)
			}
			if hangUp {
				return // stored, never answered
			}
			ss.reset()
			ok = reply("250 2.0.0 ok: queued")
		case "RSET":
			ss.reset()
			ok = reply("250 2.0.0 ok")
		case "NOOP":
			ok = reply("250 2.0.0 ok")
		case "QUIT":
			reply("221 2.0.0 bye")
			return
		default:
			ok = reply("502 5.5.2 command not recognized")
		}
		if !ok {
			return
		}
	}
}

// store keeps m and says whether to hang up on it, and which hook to run.
func (s *Server) store(m Message) (hangUp bool, hook func(Message)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.messages = append(s.messages, m)
	if s.hangUps > 0 {
		s.hangUps--
		hangUp = true
	}
	return hangUp, s.onData
}

// pathArg parses "FROM:<addr> [params]" or "TO:<addr> [params]".
func pathArg(arg, prefix string) (string, error) {
	if len(arg) < len(prefix) || !strings.EqualFold(arg[:len(prefix)], prefix) {
		return "", fmt.Errorf("want %s<address>", prefix)
	}
	rest := strings.TrimSpace(arg[len(prefix):])
	if !strings.HasPrefix(rest, "<") {
		return "", errors.New("address must be in angle brackets")
	}
	addr, _, ok := strings.Cut(rest[1:], ">")
	if !ok {
		return "", errors.New("unterminated address")
	}
	return addr, nil
}

func parse(from string, to []string, data []byte) Message {
	m := Message{From: from, To: append([]string(nil), to...), Data: data}
	msg, err := mail.ReadMessage(bufio.NewReader(bytes.NewReader(data)))
	if err != nil {
		return m
	}
	m.Header = msg.Header
	m.MessageID = msg.Header.Get("Message-Id")
	r := msg.Body
	if strings.EqualFold(msg.Header.Get("Content-Transfer-Encoding"), "quoted-printable") {
		r = quotedprintable.NewReader(r)
	}
	var body bytes.Buffer
	_, _ = body.ReadFrom(r)
	m.Body = body.Bytes()
	return m
}
