package refapp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"mime/quotedprintable"
	"net"
	netmail "net/mail"
	"net/textproto"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/wneessen/go-mail"

	"github.com/idemkit/idem/consumer"
)

// Email is the payload of idem.emails.send: the body of POST /v1/emails.
type Email struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

// DecodeEmail parses and validates an email payload (Validate).
func DecodeEmail(payload []byte) (Email, *netmail.Address, error) {
	var e Email
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil {
		return e, nil, fmt.Errorf("email: decode: %w", err)
	}
	if err := e.Validate(); err != nil {
		return e, nil, fmt.Errorf("email: %w", err)
	}
	to, err := e.Recipient()
	if err != nil {
		return e, nil, fmt.Errorf("email: %w", err)
	}
	return e, to, nil
}

// Validate is the one rule for an email, applied by the ingress (400) and by the
// consumer (a dead letter): every field is text a Postgres text column can hold
// (valid UTF-8, no NUL), and the recipient is one address (Recipient). The
// subject and body may hold anything else (the subject is MIME-encoded when sent,
// so a line break in it cannot inject a header).
func (e Email) Validate() error {
	for _, f := range []struct{ name, value string }{{"to", e.To}, {"subject", e.Subject}, {"body", e.Body}} {
		if err := checkText(f.name, f.value); err != nil {
			return err
		}
	}
	_, err := e.Recipient()
	return err
}

// Recipient is the one rule for an email's recipient, applied by the ingress (400)
// and by the consumer (a dead letter): exactly one address.
func (e Email) Recipient() (*netmail.Address, error) {
	to, err := netmail.ParseAddress(e.To)
	if err != nil {
		return nil, fmt.Errorf(`"to" must be one email address, got %q: %w`, e.To, err)
	}
	return to, nil
}

// MessageID derives the Message-ID of the email sent for a scoped key. It is the
// same on every attempt, so a mail system that dedupes on Message-ID folds a
// re-send after a crash; and it is a hash, because the scoped key may hold bytes
// no mail header accepts and a recipient need not see the key.
func MessageID(scopedKey string) string {
	sum := sha256.Sum256([]byte(scopedKey))
	return "<" + hex.EncodeToString(sum[:])[:32] + "@idem>"
}

// EmailConfig configures an EmailHandler. The zero value of every optional field
// means its default.
//
// The SMTP server is URL (or, deprecated, Addr). URL's scheme says how the
// connection is secured:
//
//	smtps://[user:password@]host[:port]          implicit TLS (default port 465)
//	smtp://[user:password@]host[:port]           STARTTLS when the server offers it;
//	                                             required when user info is given
//	                                             (default port 587)
//	smtp+insecure://host:port                    plaintext, never STARTTLS, no AUTH:
//	                                             for a local sink such as mailpit
//
// With user info the client authenticates (SMTP AUTH: PLAIN if the server offers
// it, else LOGIN, else go-mail's pick of what it offers; ?auth=plain or ?auth=login
// insists on one) and only over TLS: a
// server that does not offer STARTTLS is refused before any credential is sent.
// User and password are URL-escaped (a password holding "@" is written "%40").
// Neither appears in an error or a log line: those show RedactSMTPURL(URL).
type EmailConfig struct {
	// URL is the SMTP server, as above. One of URL and Addr is required.
	URL string
	// Addr is the SMTP server as host:port, spoken to in plaintext without
	// authentication: the same as URL "smtp+insecure://" + Addr. Deprecated: use
	// URL; Addr stays for configurations written before URL existed.
	Addr string
	// TLSConfig, when set, is the TLS configuration of smtps:// and STARTTLS,
	// e.g. RootCAs to trust a private CA; its ServerName defaults to the URL's
	// host. Default: the system roots, TLS 1.2 or later.
	TLSConfig *tls.Config
	// From is the sender, in the envelope and the From header (default
	// "idem <idem@localhost>").
	From string
	// HelloName is what the client calls itself in EHLO (default "localhost").
	HelloName string
	// Timeout bounds one send, from dial to the server's answer to the message
	// (default 30s).
	Timeout time.Duration
}

// Enabled reports whether an SMTP server is configured (URL or Addr): the email
// consumer runs only then.
func (c EmailConfig) Enabled() bool { return c.URL != "" || c.Addr != "" }

// smtpTarget is a parsed EmailConfig.URL.
type smtpTarget struct {
	scheme     string // smtp, smtps or smtp+insecure
	host       string
	port       int
	user, pass string
	hasAuth    bool
	auth       []mail.SMTPAuthType // preferred mechanisms, in order
	redacted   string              // for messages
}

func (t *smtpTarget) addr() string { return net.JoinHostPort(t.host, strconv.Itoa(t.port)) }

// RedactSMTPURL is u with its password replaced by "xxxxx", for logs and errors.
// A u that does not parse as a URL is replaced whole: it may hold a password.
func RedactSMTPURL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "(an SMTP URL that does not parse; not shown, it may hold a password)"
	}
	return p.Redacted()
}

// parseSMTPURL reads an SMTP URL. Its errors never quote the password.
func parseSMTPURL(raw string) (*smtpTarget, error) {
	u, err := url.Parse(raw)
	if err != nil {
		// *url.Error quotes the whole URL, password included: keep only its reason.
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err
		}
		return nil, fmt.Errorf("SMTP URL %s: %v", RedactSMTPURL(raw), err)
	}
	t := &smtpTarget{scheme: strings.ToLower(u.Scheme), host: u.Hostname(), redacted: u.Redacted()}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("SMTP URL %s: "+format, append([]any{t.redacted}, args...)...)
	}
	defaultPort := 0
	switch t.scheme {
	case "smtps":
		defaultPort = 465
	case "smtp":
		defaultPort = 587
	case "smtp+insecure":
	default:
		return nil, bad("scheme must be smtp, smtps or smtp+insecure, not %q", u.Scheme)
	}
	if t.host == "" {
		return nil, bad("no host")
	}
	if u.Path != "" && u.Path != "/" {
		return nil, bad("unexpected path %q", u.Path)
	}
	switch p := u.Port(); {
	case p != "":
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 || n > 65535 {
			return nil, bad("bad port %q", p)
		}
		t.port = n
	case defaultPort == 0:
		return nil, bad("%s needs a port (it has no standard one)", t.scheme)
	default:
		t.port = defaultPort
	}
	if u.User != nil {
		t.user = u.User.Username()
		t.pass, _ = u.User.Password()
		t.hasAuth = true
		if t.user == "" {
			return nil, bad("user info without a user name")
		}
		if t.scheme == "smtp+insecure" {
			return nil, bad("smtp+insecure never encrypts, so it takes no credentials (they would cross the network in plaintext): use smtp:// (STARTTLS) or smtps://")
		}
	}
	q := u.Query()
	for k := range q {
		if k != "auth" {
			return nil, bad("unknown parameter %q (want auth)", k)
		}
	}
	switch a := strings.ToLower(q.Get("auth")); a {
	case "":
		t.auth = []mail.SMTPAuthType{mail.SMTPAuthPlain, mail.SMTPAuthLogin}
	case "plain":
		t.auth = []mail.SMTPAuthType{mail.SMTPAuthPlain}
	case "login":
		t.auth = []mail.SMTPAuthType{mail.SMTPAuthLogin}
	default:
		return nil, bad("auth must be plain or login, not %q", a)
	}
	if q.Has("auth") && !t.hasAuth {
		return nil, bad("auth= without a user and password")
	}
	return t, nil
}

// EmailHandler sends each idem.emails.send message through SMTP, as an external
// effect (consumer.External): it runs between the lease and its completion, and
// stamps the message with MessageID(key), so a re-send after a worker died
// mid-send carries the same Message-ID.
//
// The SMTP client is github.com/wneessen/go-mail: dial, EHLO, STARTTLS or
// implicit TLS, and AUTH as EmailConfig's URL says; then one MAIL, RCPT and DATA
// per message on a fresh connection.
type EmailHandler struct {
	cfg    EmailConfig
	target *smtpTarget
	from   *netmail.Address
}

var _ consumer.ExternalHandler = (*EmailHandler)(nil)

// NewEmailHandler validates cfg and returns a handler.
func NewEmailHandler(cfg EmailConfig) (*EmailHandler, error) {
	raw := cfg.URL
	switch {
	case cfg.URL != "" && cfg.Addr != "":
		return nil, errors.New("email: give the SMTP server as URL or as Addr (deprecated), not both")
	case cfg.URL == "" && cfg.Addr == "":
		return nil, errors.New("email: SMTP URL (or address) is required")
	case cfg.Addr != "":
		if _, _, err := net.SplitHostPort(cfg.Addr); err != nil {
			return nil, fmt.Errorf("email: SMTP address %q: %w", cfg.Addr, err)
		}
		raw = "smtp+insecure://" + cfg.Addr
	}
	target, err := parseSMTPURL(raw)
	if err != nil {
		return nil, fmt.Errorf("email: %w", err)
	}
	if cfg.From == "" {
		cfg.From = "idem <idem@localhost>"
	}
	if cfg.HelloName == "" {
		cfg.HelloName = "localhost"
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 30 * time.Second
	}
	from, err := netmail.ParseAddress(cfg.From)
	if err != nil {
		return nil, fmt.Errorf("email: From %q: %w", cfg.From, err)
	}
	return &EmailHandler{cfg: cfg, target: target, from: from}, nil
}

// Server is the SMTP server the handler sends to, with any password redacted:
// for logs.
func (h *EmailHandler) Server() string { return h.target.redacted }

// EmailResult is the stored first result of an email.
type EmailResult struct {
	MessageID string `json:"message_id"`
	To        string `json:"to"`
}

// Perform implements consumer.ExternalHandler.
func (h *EmailHandler) Perform(ctx context.Context, e *consumer.Effect) ([]byte, error) {
	m, to, err := DecodeEmail(e.Payload)
	if err != nil {
		// No retry fixes a payload that does not decode: dead-letter it.
		return nil, consumer.Permanent(err)
	}
	id := MessageID(e.Key)
	if err := h.send(ctx, id, to, m); err != nil {
		var reply *textproto.Error
		var refused *messageRefused
		if errors.As(err, &refused) && errors.As(err, &reply) && reply.Code >= 500 {
			// A 5xx to this message's MAIL, RCPT or DATA is the server's final word
			// (no such mailbox, policy): retrying the same message cannot change it.
			return nil, consumer.Permanent(err)
		}
		// A 4xx, a timeout, a broken connection, and every failure to connect,
		// secure the connection or authenticate (a wrong password is fixed by the
		// operator, not by dead-lettering the mail): try again. If the message got
		// through before the connection broke, the re-send has the same
		// Message-ID.
		return nil, err
	}
	return json.Marshal(EmailResult{MessageID: id, To: to.Address})
}

// messageRefused marks the server's answer to the message itself (MAIL, RCPT,
// DATA), as opposed to the session (connect, TLS, AUTH).
type messageRefused struct{ err error }

func (e *messageRefused) Error() string { return e.err.Error() }
func (e *messageRefused) Unwrap() error { return e.err }

// client is a go-mail client for one send, whose ctx bounds it. Its dial closes
// the socket when ctx ends (the lease was lost, the send timed out, or the send is
// over and send's cancel runs): go-mail, past the dial, would not notice a
// cancellation, and it leaves the connection open when STARTTLS or AUTH fail.
func (h *EmailHandler) client(ctx context.Context) (*mail.Client, error) {
	t := h.target
	tlsConfig := &tls.Config{MinVersion: tls.VersionTLS12}
	if h.cfg.TLSConfig != nil {
		tlsConfig = h.cfg.TLSConfig.Clone()
	}
	if tlsConfig.ServerName == "" {
		tlsConfig.ServerName = t.host
	}
	dial := func(dctx context.Context, network, addr string) (net.Conn, error) {
		var conn net.Conn
		var err error
		if t.scheme == "smtps" {
			d := tls.Dialer{Config: tlsConfig}
			conn, err = d.DialContext(dctx, network, addr)
		} else {
			var d net.Dialer
			conn, err = d.DialContext(dctx, network, addr)
		}
		if err != nil {
			return nil, err
		}
		context.AfterFunc(ctx, func() { _ = conn.Close() })
		return conn, nil
	}
	timeout := h.cfg.Timeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = time.Until(dl)
	}
	opts := []mail.Option{
		mail.WithPort(t.port),
		mail.WithHELO(h.cfg.HelloName),
		mail.WithTimeout(timeout),
		mail.WithDialContextFunc(dial),
		mail.WithTLSConfig(tlsConfig),
	}
	switch {
	case t.scheme == "smtps":
		opts = append(opts, mail.WithSSL())
	case t.scheme == "smtp+insecure":
		opts = append(opts, mail.WithTLSPolicy(mail.NoTLS))
	case t.hasAuth:
		// Credentials go over TLS or not at all.
		opts = append(opts, mail.WithTLSPolicy(mail.TLSMandatory))
	default:
		opts = append(opts, mail.WithTLSPolicy(mail.TLSOpportunistic))
	}
	if t.hasAuth {
		opts = append(opts, mail.WithUsername(t.user), mail.WithPassword(t.pass))
		if len(t.auth) == 1 {
			opts = append(opts, mail.WithSMTPAuth(t.auth[0])) // ?auth=: that one or fail
		} else {
			opts = append(opts, mail.WithOpportunisticSMTPAuth(t.auth...))
		}
	}
	return mail.NewClient(t.host, opts...)
}

// send delivers one message: dial, EHLO, STARTTLS and AUTH as configured, then
// MAIL, RCPT, DATA, QUIT. The message is accepted when the server answers the
// DATA; QUIT's answer does not matter.
func (h *EmailHandler) send(ctx context.Context, messageID string, to *netmail.Address, m Email) error {
	ctx, cancel := context.WithTimeout(ctx, h.cfg.Timeout)
	defer cancel()
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= 0 {
		return fmt.Errorf("email: no time left to send: %w", context.DeadlineExceeded)
	}
	mc, err := h.client(ctx)
	if err != nil {
		return fmt.Errorf("email: SMTP client for %s: %w", h.target.redacted, err)
	}
	c, err := mc.DialToSMTPClientWithContext(ctx)
	if err != nil {
		return h.sessionError(ctx, err)
	}
	defer c.Close()
	// go-mail's smtp.Client sends the path as given: it wants the angle brackets.
	if err := c.Mail("<" + h.from.Address + ">"); err != nil {
		return fmt.Errorf("email: MAIL FROM: %w", &messageRefused{err})
	}
	if err := c.Rcpt("<" + to.Address + ">"); err != nil {
		return fmt.Errorf("email: RCPT TO %s: %w", to.Address, &messageRefused{err})
	}
	w, err := c.Data()
	if err != nil {
		return fmt.Errorf("email: DATA: %w", &messageRefused{err})
	}
	if _, err := w.Write(h.compose(messageID, to, m)); err != nil {
		return fmt.Errorf("email: write message: %w", err)
	}
	if err := w.Close(); err != nil {
		// The server's answer to the message. An error here is the ambiguous case:
		// the server may have taken the message and lost the connection after.
		var reply *textproto.Error
		if errors.As(err, &reply) {
			err = &messageRefused{err}
		}
		return fmt.Errorf("email: message not confirmed: %w", err)
	}
	_ = c.Quit()
	return nil
}

// sessionError explains a failure to connect, secure the connection or
// authenticate. go-mail's errors name neither user nor password; the server is
// named redacted.
func (h *EmailHandler) sessionError(ctx context.Context, err error) error {
	t := h.target
	var reply *textproto.Error
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("email: SMTP session with %s: %w (%w)", t.redacted, err, context.Cause(ctx))
	case t.hasAuth && strings.Contains(err.Error(), "does not support STARTTLS"):
		return fmt.Errorf("email: refusing to send credentials to %s: the server does not offer STARTTLS, and credentials never cross the network in plaintext (use smtps:// if it speaks implicit TLS): %w", t.redacted, err)
	case t.hasAuth && errors.As(err, &reply) && reply.Code == 535:
		return fmt.Errorf("email: SMTP authentication as %q failed at %s: check the user and password: %w", t.user, t.addr(), err)
	}
	return fmt.Errorf("email: SMTP session with %s: %w", t.redacted, err)
}

// compose renders the message: headers (non-ASCII and control characters in the
// subject are MIME-encoded) and a quoted-printable UTF-8 body.
func (h *EmailHandler) compose(messageID string, to *netmail.Address, m Email) []byte {
	var b bytes.Buffer
	header := func(k, v string) { fmt.Fprintf(&b, "%s: %s\r\n", k, v) }
	header("Message-ID", messageID)
	header("Date", time.Now().Format(time.RFC1123Z))
	header("From", h.from.String())
	header("To", to.String())
	header("Subject", mime.QEncoding.Encode("utf-8", m.Subject))
	header("MIME-Version", "1.0")
	header("Content-Type", "text/plain; charset=utf-8")
	header("Content-Transfer-Encoding", "quoted-printable")
	b.WriteString("\r\n")
	qp := quotedprintable.NewWriter(&b)
	_, _ = qp.Write([]byte(m.Body)) // line breaks, \n or \r\n, become CRLF
	_ = qp.Close()
	return b.Bytes()
}
