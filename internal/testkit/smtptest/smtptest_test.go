package smtptest_test

import (
	"bufio"
	"net"
	"net/smtp"
	"net/textproto"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/smtptest"
)

func send(t *testing.T, s *smtptest.Server, id, body string) error {
	t.Helper()
	msg := "Message-ID: " + id + "\r\nSubject: hi\r\nContent-Transfer-Encoding: quoted-printable\r\n\r\n" + body
	return smtp.SendMail(s.Addr(), nil, "from@example.com", []string{"a@example.com", "b@example.com"}, []byte(msg))
}

// net/smtp's client talks to it; the envelope, headers and (dot-unstuffed,
// quoted-printable decoded) body are recorded; counts separate raw deliveries from
// distinct Message-IDs.
func TestServerRecordsAndCounts(t *testing.T) {
	t.Parallel()
	s := smtptest.Start(t)
	if err := send(t, s, "<one@x>", ".leading dot\r\ncaf=C3=A9\r\n"); err != nil {
		t.Fatal(err)
	}
	if err := send(t, s, "<one@x>", "again"); err != nil {
		t.Fatal(err)
	}
	if err := send(t, s, "<two@x>", "other"); err != nil {
		t.Fatal(err)
	}
	if got := s.Deliveries(); got != 3 {
		t.Errorf("Deliveries = %d, want 3", got)
	}
	if got := s.DistinctMessageIDs(); got != 2 {
		t.Errorf("DistinctMessageIDs = %d, want 2", got)
	}
	if got := s.DeliveriesOf("<one@x>"); got != 2 {
		t.Errorf("DeliveriesOf(<one@x>) = %d, want 2", got)
	}
	m := s.Messages()[0]
	if m.From != "from@example.com" || strings.Join(m.To, ",") != "a@example.com,b@example.com" {
		t.Errorf("envelope = %q -> %q", m.From, m.To)
	}
	if m.Header.Get("Subject") != "hi" || string(m.Body) != ".leading dot\ncafé\n" {
		t.Errorf("message = subject %q body %q", m.Header.Get("Subject"), m.Body)
	}
}

// The protocol by hand: sequence errors, RSET, NOOP, HELO, unknown commands, QUIT.
func TestServerProtocol(t *testing.T) {
	t.Parallel()
	s := smtptest.Start(t)
	c, err := textproto.Dial("tcp", s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	expect := func(cmd string, code int) {
		t.Helper()
		if cmd != "" {
			if err := c.PrintfLine("%s", cmd); err != nil {
				t.Fatal(err)
			}
		}
		if _, _, err := c.ReadResponse(code); err != nil {
			t.Fatalf("%q: %v", cmd, err)
		}
	}
	expect("", 220)
	expect("MAIL FROM:<a@x>", 503) // no greeting yet
	expect("HELO client", 250)
	expect("RCPT TO:<b@x>", 503) // no MAIL yet
	expect("MAIL FROM:<a@x>", 250)
	expect("RCPT TO:<b@x>", 250)
	expect("RSET", 250)
	expect("DATA", 503) // RSET cleared the envelope
	expect("NOOP", 250)
	expect("VRFY b@x", 502)
	expect("MAIL FROM:a@x", 501)
	expect("MAIL FROM:<>", 250) // the null sender is valid (bounces)
	expect("RCPT TO:<b@x>", 250)
	expect("DATA", 354)
	if err := c.PrintfLine("Message-ID: <h@x>\r\n\r\nhand made\r\n."); err != nil {
		t.Fatal(err)
	}
	expect("", 250)
	expect("QUIT", 221)
	if s.DeliveriesOf("<h@x>") != 1 {
		t.Errorf("hand-made message not recorded: %+v", s.Messages())
	}
}

// HangUpAfterData: the message is delivered, the client sees an error — it cannot
// know the mail went out. The next message is answered normally.
func TestServerHangUpAfterData(t *testing.T) {
	t.Parallel()
	s := smtptest.Start(t)
	s.HangUpAfterData(1)
	if err := send(t, s, "<lost-reply@x>", "body"); err == nil {
		t.Fatal("send through a hang-up succeeded, want an error")
	}
	if s.Deliveries() != 1 {
		t.Fatalf("Deliveries = %d, want 1: the message was accepted before the hang-up", s.Deliveries())
	}
	if err := send(t, s, "<lost-reply@x>", "body"); err != nil {
		t.Fatalf("re-send: %v", err)
	}
	if s.Deliveries() != 2 || s.DistinctMessageIDs() != 1 {
		t.Fatalf("after the re-send: %d raw, %d distinct; want 2 and 1", s.Deliveries(), s.DistinctMessageIDs())
	}
}

// OnData holds a message in flight: stored, not yet answered.
func TestServerOnDataHoldsTheReply(t *testing.T) {
	t.Parallel()
	s := smtptest.Start(t)
	arrived, release := make(chan smtptest.Message, 1), make(chan struct{})
	s.OnData(func(m smtptest.Message) {
		arrived <- m
		<-release
	})
	done := make(chan error, 1)
	go func() { done <- send(t, s, "<held@x>", "body") }()
	m := <-arrived
	if m.MessageID != "<held@x>" {
		t.Fatalf("in-flight message id = %q", m.MessageID)
	}
	select {
	case err := <-done:
		t.Fatalf("send returned (%v) while its reply was held", err)
	default:
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// Close drops connections that are still open, so a stuck client does not keep a
// test alive.
func TestServerCloseDropsOpenConnections(t *testing.T) {
	t.Parallel()
	s, err := smtptest.New()
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	if _, err := r.ReadString('\n'); err != nil { // the greeting
		t.Fatal(err)
	}
	s.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := r.ReadString('\n'); err == nil {
		t.Fatal("connection still open after Close")
	}
}
