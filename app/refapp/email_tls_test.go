package refapp_test

// The email handler against an SMTP server that wants AUTH over TLS: STARTTLS,
// implicit TLS (smtps), wrong passwords, servers that offer no STARTTLS. The
// server is authServer below, a small real SMTP server on a TCP socket with a
// self-signed certificate made here.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/mail"
	"net/textproto"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

const (
	smtpUser = "mailer@example.com"
	smtpPass = "s3cret-p@ss:word" // "@" and ":" must survive the URL
)

// selfSigned makes a certificate for 127.0.0.1 and localhost, and a pool that
// trusts it.
func selfSigned(t *testing.T) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "authserver test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		DNSNames:              []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, pool
}

// authServer is an SMTP server that requires AUTH before MAIL. With startTLS it
// offers STARTTLS and AUTH only after it; with implicitTLS it speaks TLS from the
// first byte; with neither it offers AUTH in plaintext (a server a client must
// not trust with credentials).
type authServer struct {
	startTLS, implicitTLS bool
	mechs                 string // offered AUTH mechanisms, default "PLAIN LOGIN"
	cert                  tls.Certificate
	ln                    net.Listener

	mu       sync.Mutex
	messages []authMessage
	auths    []authAttempt // every AUTH command
	wg       sync.WaitGroup
}

type authMessage struct {
	From, To  string
	MessageID string
	User      string // who authenticated
	TLS       bool   // the session was encrypted
}

type authAttempt struct {
	Mech string
	TLS  bool
	OK   bool
}

func startAuthServer(t *testing.T, s *authServer) *authServer {
	t.Helper()
	if s.mechs == "" {
		s.mechs = "PLAIN LOGIN"
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if s.implicitTLS {
		ln = tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{s.cert}})
	}
	s.ln = ln
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(20 * time.Second))
				s.serve(c)
			}()
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); s.wg.Wait() })
	return s
}

func (s *authServer) port() string {
	_, p, _ := net.SplitHostPort(s.ln.Addr().String())
	return p
}

func (s *authServer) Messages() []authMessage {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]authMessage(nil), s.messages...)
}

func (s *authServer) Auths() []authAttempt {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]authAttempt(nil), s.auths...)
}

func (s *authServer) serve(c net.Conn) {
	tc := textproto.NewConn(c)
	_, encrypted := c.(*tls.Conn)
	reply := func(format string, args ...any) bool { return tc.PrintfLine(format, args...) == nil }
	if !reply("220 authserver ESMTP") {
		return
	}
	var user, from, to string
	authed := false
	checkAuth := func(mech, u, p string) bool {
		ok := u == smtpUser && p == smtpPass
		s.mu.Lock()
		s.auths = append(s.auths, authAttempt{Mech: mech, TLS: encrypted, OK: ok})
		s.mu.Unlock()
		if ok {
			authed, user = true, u
			return reply("235 2.7.0 authentication successful")
		}
		return reply("535 5.7.8 authentication credentials invalid")
	}
	readB64 := func(prompt string) (string, bool) {
		if !reply("334 %s", prompt) {
			return "", false
		}
		line, err := tc.ReadLine()
		if err != nil {
			return "", false
		}
		b, err := base64.StdEncoding.DecodeString(line)
		if err != nil {
			reply("501 5.5.2 bad base64")
			return "", false
		}
		return string(b), true
	}
	for {
		line, err := tc.ReadLine()
		if err != nil {
			return
		}
		verb, arg, _ := strings.Cut(line, " ")
		ok := true
		switch strings.ToUpper(verb) {
		case "EHLO":
			lines := []string{"authserver", "8BITMIME"}
			if s.startTLS && !encrypted {
				lines = append(lines, "STARTTLS")
			}
			if encrypted || !s.startTLS {
				lines = append(lines, "AUTH "+s.mechs)
			}
			for i, l := range lines {
				sep := "-"
				if i == len(lines)-1 {
					sep = " "
				}
				ok = ok && reply("250%s%s", sep, l)
			}
		case "STARTTLS":
			if !s.startTLS || encrypted {
				ok = reply("502 5.5.1 no STARTTLS here")
				break
			}
			if !reply("220 2.0.0 go ahead") {
				return
			}
			tlsConn := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{s.cert}})
			if err := tlsConn.Handshake(); err != nil {
				return
			}
			c, encrypted = tlsConn, true
			tc = textproto.NewConn(c)
			authed, user, from, to = false, "", "", ""
		case "AUTH":
			mech, ir, _ := strings.Cut(arg, " ")
			mech = strings.ToUpper(mech)
			switch {
			case !strings.Contains(s.mechs, mech):
				ok = reply("504 5.5.4 unrecognized mechanism")
			case mech == "PLAIN":
				var resp string
				if ir != "" {
					b, err := base64.StdEncoding.DecodeString(ir)
					if err != nil {
						ok = reply("501 5.5.2 bad base64")
						break
					}
					resp = string(b)
				} else if resp, ok = readB64(""); !ok {
					return
				}
				parts := strings.Split(resp, "\x00")
				if len(parts) != 3 {
					ok = reply("501 5.5.2 bad PLAIN response")
					break
				}
				ok = checkAuth(mech, parts[1], parts[2])
			case mech == "LOGIN":
				u, good := readB64(base64.StdEncoding.EncodeToString([]byte("Username:")))
				if !good {
					return
				}
				p, good := readB64(base64.StdEncoding.EncodeToString([]byte("Password:")))
				if !good {
					return
				}
				ok = checkAuth(mech, u, p)
			}
		case "MAIL":
			if !authed {
				ok = reply("530 5.7.0 authentication required")
				break
			}
			from, to = strings.TrimPrefix(arg, "FROM:"), ""
			ok = reply("250 2.1.0 ok")
		case "RCPT":
			if from == "" {
				ok = reply("503 5.5.1 need MAIL first")
				break
			}
			to = strings.TrimPrefix(arg, "TO:")
			ok = reply("250 2.1.5 ok")
		case "DATA":
			if to == "" {
				ok = reply("503 5.5.1 need RCPT first")
				break
			}
			if !reply("354 go ahead") {
				return
			}
			data, err := tc.ReadDotBytes()
			if err != nil {
				return
			}
			m := authMessage{From: from, To: to, User: user, TLS: encrypted}
			if msg, err := mail.ReadMessage(bufio.NewReader(bytes.NewReader(data))); err == nil {
				m.MessageID = msg.Header.Get("Message-ID")
			}
			s.mu.Lock()
			s.messages = append(s.messages, m)
			s.mu.Unlock()
			from, to = "", ""
			ok = reply("250 2.0.0 queued")
		case "RSET", "NOOP":
			ok = reply("250 2.0.0 ok")
		case "QUIT":
			reply("221 2.0.0 bye")
			return
		default:
			ok = reply("502 5.5.2 unknown command")
		}
		if !ok {
			return
		}
	}
}

// smtpURL is an smtp or smtps URL of s with the test credentials (password
// replaced by pass, when given).
func smtpURL(scheme string, s *authServer, pass string, query string) string {
	u := fmt.Sprintf("%s://%s:%s@127.0.0.1:%s", scheme, "mailer%40example.com", escapeUserinfo(pass), s.port())
	if query != "" {
		u += "?" + query
	}
	return u
}

func escapeUserinfo(s string) string {
	return strings.NewReplacer("%", "%25", "@", "%40", ":", "%3A", "/", "%2F").Replace(s)
}

func newTLSHandler(t *testing.T, url string, roots *x509.CertPool) *refapp.EmailHandler {
	t.Helper()
	cfg := refapp.EmailConfig{URL: url, Timeout: 5 * time.Second}
	if roots != nil {
		cfg.TLSConfig = &tls.Config{RootCAs: roots}
	}
	h, err := refapp.NewEmailHandler(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func perform(h *refapp.EmailHandler, key string) error {
	_, err := h.Perform(context.Background(), &consumer.Effect{Delivery: &consumer.Delivery{
		Message: idem.Message{Key: key, Subject: refapp.SubjectEmail, Payload: emailPayload("rcpt@example.com", "s", "b")}}})
	return err
}

// The scenario: through the consumer, with AUTH over STARTTLS. One
// delivery, by the authenticated user over TLS, with the key-derived Message-ID;
// the credentials never crossed in plaintext; a duplicate sends nothing.
func TestEmailAuthOverSTARTTLSDeliversOnce(t *testing.T) {
	t.Parallel()
	cert, roots := selfSigned(t)
	srv := startAuthServer(t, &authServer{startTLS: true, cert: cert})
	env, out := newAppEnv(t), &testenv.Outcomes{}
	key := idem.ScopedKey("tenant-tls", "k-auth")
	h := newTLSHandler(t, smtpURL("smtp", srv, smtpPass, ""), roots)
	runEmails(t, context.Background(), env, consumer.Config{
		Name: refapp.EmailConsumer, Subject: refapp.SubjectEmail, External: h,
		Backoff: func(int) time.Duration { return 50 * time.Millisecond },
	}, out.Observe)
	env.Publish(t, refapp.SubjectEmail, key, "m1", emailPayload("a@example.com", "Receipt", "Thanks!"))
	env.Publish(t, refapp.SubjectEmail, key, "m2", emailPayload("a@example.com", "Receipt", "Thanks!"))
	drained := env.DrainedOn(t, refapp.StreamName, refapp.EmailConsumer)
	testenv.Eventually(t, 45*time.Second, "the email sent and both copies settled", func() bool {
		return out.Get(idem.OutcomeProcessed) == 1 && drained()
	})
	msgs := srv.Messages()
	if len(msgs) != 1 {
		t.Fatalf("server got %d messages, want 1", len(msgs))
	}
	m := msgs[0]
	if m.MessageID != refapp.MessageID(key) {
		t.Errorf("Message-ID = %q, want the key's %q", m.MessageID, refapp.MessageID(key))
	}
	if !m.TLS || m.User != smtpUser || m.To != "<a@example.com>" {
		t.Errorf("message %+v: want it over TLS, from user %s, to <a@example.com>", m, smtpUser)
	}
	for _, a := range srv.Auths() {
		if !a.TLS {
			t.Errorf("an AUTH %s crossed in plaintext", a.Mech)
		}
	}
}

// A wrong password is the operator's to fix: the send fails with a clear error
// that names neither password, is retried (never dead-lettered), and the key is
// never marked done.
func TestEmailWrongPasswordIsRetriedNeverDone(t *testing.T) {
	t.Parallel()
	cert, roots := selfSigned(t)
	srv := startAuthServer(t, &authServer{startTLS: true, cert: cert})
	const wrong = "wrong-p@ssword"

	err := perform(newTLSHandler(t, smtpURL("smtp", srv, wrong, ""), roots), "k-direct")
	if err == nil || consumer.IsPermanent(err) {
		t.Fatalf("Perform with a wrong password: %v (permanent %v); want a retryable error", err, consumer.IsPermanent(err))
	}
	if msg := err.Error(); !strings.Contains(msg, "authentication") || !strings.Contains(msg, "535") ||
		strings.Contains(msg, wrong) || strings.Contains(msg, smtpPass) {
		t.Errorf("error %q: want it to say authentication failed (535), and no password", msg)
	}

	env, out := newAppEnv(t), &testenv.Outcomes{}
	runEmails(t, context.Background(), env, consumer.Config{
		Name: refapp.EmailConsumer, Subject: refapp.SubjectEmail,
		External: newTLSHandler(t, smtpURL("smtp", srv, wrong, ""), roots),
		Backoff:  func(int) time.Duration { return 20 * time.Millisecond },
	}, out.Observe)
	env.Publish(t, refapp.SubjectEmail, "k-wrong", "m1", emailPayload("a@example.com", "s", "b"))
	testenv.Eventually(t, 45*time.Second, "several failed attempts", func() bool {
		return out.Get(idem.OutcomeFailed) >= 3
	})
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'emails' AND key = 'k-wrong' AND status = 'done'`); n != 0 {
		t.Errorf("the key was marked done (%d rows) without a delivery", n)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE consumer = 'emails'`); n != 0 {
		t.Errorf("%d dead letters; a wrong password must be retried, not dead-lettered", n)
	}
	if n := len(srv.Messages()); n != 0 {
		t.Errorf("server got %d messages", n)
	}
	if n := out.Get(idem.OutcomeProcessed); n != 0 {
		t.Errorf("processed = %d, want 0", n)
	}
}

// A server that offers no STARTTLS (but offers AUTH in plaintext) gets no
// credentials: the client refuses before any AUTH, with an error that says why,
// and the send is retried rather than dead-lettered.
func TestEmailCredentialsNeverInPlaintext(t *testing.T) {
	t.Parallel()
	srv := startAuthServer(t, &authServer{})
	err := perform(newTLSHandler(t, smtpURL("smtp", srv, smtpPass, ""), nil), "k-plain")
	if err == nil || consumer.IsPermanent(err) {
		t.Fatalf("Perform against a server without STARTTLS: %v; want a retryable refusal", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "STARTTLS") || strings.Contains(msg, smtpPass) || strings.Contains(msg, escapeUserinfo(smtpPass)) {
		t.Errorf("error %q: want it to name STARTTLS, and no password", msg)
	}
	if a := srv.Auths(); len(a) != 0 {
		t.Errorf("the server saw %d AUTH commands: %+v", len(a), a)
	}
	if n := len(srv.Messages()); n != 0 {
		t.Errorf("server got %d messages", n)
	}
}

// The other ways in: implicit TLS (smtps), LOGIN only, opportunistic STARTTLS
// without credentials, and an untrusted certificate (refused, retryable).
func TestEmailTLSModes(t *testing.T) {
	t.Parallel()
	cert, roots := selfSigned(t)
	cases := []struct {
		name    string
		server  *authServer
		url     func(*authServer) string
		roots   *x509.CertPool
		wantErr string // empty: delivered
		user    string // who the server saw
	}{
		{"smtps implicit TLS", &authServer{implicitTLS: true, cert: cert},
			func(s *authServer) string { return smtpURL("smtps", s, smtpPass, "") }, roots, "", smtpUser},
		{"STARTTLS with LOGIN only", &authServer{startTLS: true, cert: cert, mechs: "LOGIN"},
			func(s *authServer) string { return smtpURL("smtp", s, smtpPass, "") }, roots, "", smtpUser},
		{"STARTTLS with auth=login", &authServer{startTLS: true, cert: cert},
			func(s *authServer) string { return smtpURL("smtp", s, smtpPass, "auth=login") }, roots, "", smtpUser},
		{"auth=login, server offers only PLAIN", &authServer{startTLS: true, cert: cert, mechs: "PLAIN"},
			func(s *authServer) string { return smtpURL("smtp", s, smtpPass, "auth=login") }, roots, "LOGIN", ""},
		{"untrusted certificate", &authServer{startTLS: true, cert: cert},
			func(s *authServer) string { return smtpURL("smtp", s, smtpPass, "") }, nil, "certificate", ""},
		{"smtps untrusted certificate", &authServer{implicitTLS: true, cert: cert},
			func(s *authServer) string { return smtpURL("smtps", s, smtpPass, "") }, nil, "certificate", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := startAuthServer(t, tc.server)
			key := "k-" + strings.ReplaceAll(tc.name, " ", "-")
			err := perform(newTLSHandler(t, tc.url(srv), tc.roots), key)
			if tc.wantErr != "" {
				if err == nil || consumer.IsPermanent(err) || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Perform: %v; want a retryable error about %q", err, tc.wantErr)
				}
				if strings.Contains(err.Error(), escapeUserinfo(smtpPass)) || strings.Contains(err.Error(), smtpPass) {
					t.Errorf("error %q holds the password", err)
				}
				if len(srv.Auths()) != 0 || len(srv.Messages()) != 0 {
					t.Errorf("server saw AUTH %+v, messages %+v", srv.Auths(), srv.Messages())
				}
				return
			}
			if err != nil {
				t.Fatalf("Perform: %v", err)
			}
			msgs := srv.Messages()
			if len(msgs) != 1 || !msgs[0].TLS || msgs[0].User != tc.user || msgs[0].MessageID != refapp.MessageID(key) {
				t.Fatalf("server got %+v; want one message over TLS from %q with Message-ID %s", msgs, tc.user, refapp.MessageID(key))
			}
			wantMech := "PLAIN"
			if strings.Contains(strings.ToLower(tc.name), "login") {
				wantMech = "LOGIN"
			}
			if a := srv.Auths(); len(a) != 1 || a[0].Mech != wantMech || !a[0].OK || !a[0].TLS {
				t.Errorf("AUTH attempts %+v; want one %s over TLS that succeeded", a, wantMech)
			}
		})
	}
}

// Without credentials smtp:// takes STARTTLS when the server offers it.
func TestEmailOpportunisticSTARTTLSWithoutCredentials(t *testing.T) {
	t.Parallel()
	cert, roots := selfSigned(t)
	srv := startAuthServer(t, &authServer{startTLS: true, cert: cert})
	// This server wants AUTH before MAIL: the 530 to MAIL FROM proves the client
	// reached it over TLS (the session was encrypted) without credentials.
	err := perform(newTLSHandler(t, "smtp://127.0.0.1:"+srv.port(), roots), "k-opp")
	var reply *textproto.Error
	if !errors.As(err, &reply) || reply.Code != 530 || !consumer.IsPermanent(err) {
		t.Fatalf("Perform: %v; want the server's 530 to MAIL, as a permanent error", err)
	}
}

func TestEmailConfigURLValidation(t *testing.T) {
	t.Parallel()
	const pw = "hunter2-secret"
	for _, tc := range []struct {
		cfg  refapp.EmailConfig
		want string
	}{
		{refapp.EmailConfig{}, "required"},
		{refapp.EmailConfig{URL: "smtp://h:25", Addr: "h:25"}, "not both"},
		{refapp.EmailConfig{URL: "http://u:" + pw + "@h:25"}, "scheme must be smtp, smtps or smtp+insecure"},
		{refapp.EmailConfig{URL: "smtp+insecure://u:" + pw + "@h:1025"}, "takes no credentials"},
		{refapp.EmailConfig{URL: "smtp+insecure://h"}, "needs a port"},
		{refapp.EmailConfig{URL: "smtp://u:" + pw + "@h:99999"}, "bad port"},
		{refapp.EmailConfig{URL: "smtp://u:" + pw + "@h:587?auth=cram"}, "auth must be plain or login"},
		{refapp.EmailConfig{URL: "smtp://u:" + pw + "@h:587?tls=off"}, "unknown parameter"},
		{refapp.EmailConfig{URL: "smtp://h:587?auth=plain"}, "without a user"},
		{refapp.EmailConfig{URL: "smtp://:" + pw + "@h:587"}, "without a user name"},
		{refapp.EmailConfig{URL: "smtp://u:" + pw + "@h:587/path"}, "unexpected path"},
		{refapp.EmailConfig{URL: "smtp://u:" + pw + "@h\x7f:587"}, "does not parse"},
		{refapp.EmailConfig{URL: "smtp://"}, "no host"},
		{refapp.EmailConfig{Addr: "no-port"}, "missing port"},
	} {
		_, err := refapp.NewEmailHandler(tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), pw) {
			t.Errorf("NewEmailHandler(%+v) = %v; want an error about %q, without the password", tc.cfg, err, tc.want)
		}
	}
	for _, tc := range []struct{ url, server string }{
		{"smtp://u:" + pw + "@mail.example.com", "smtp://u:xxxxx@mail.example.com"},
		{"smtps://mail.example.com", "smtps://mail.example.com"},
		{"smtp+insecure://127.0.0.1:1025", "smtp+insecure://127.0.0.1:1025"},
	} {
		h, err := refapp.NewEmailHandler(refapp.EmailConfig{URL: tc.url})
		if err != nil {
			t.Errorf("NewEmailHandler(%q): %v", tc.url, err)
			continue
		}
		if h.Server() != tc.server {
			t.Errorf("Server() = %q, want %q", h.Server(), tc.server)
		}
	}
	if got := refapp.RedactSMTPURL("smtp://u:" + pw + "@h:587"); strings.Contains(got, pw) {
		t.Errorf("RedactSMTPURL kept the password: %q", got)
	}
	if h, err := refapp.NewEmailHandler(refapp.EmailConfig{Addr: "127.0.0.1:1025"}); err != nil || h.Server() != "smtp+insecure://127.0.0.1:1025" {
		t.Errorf("Addr 127.0.0.1:1025: %v, server %q; want it to mean smtp+insecure://127.0.0.1:1025", err, h.Server())
	}
}
