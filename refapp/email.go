package refapp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"mime/quotedprintable"
	"net"
	"net/mail"
	"net/smtp"
	"net/textproto"
	"time"

	"github.com/idemkit/idem/consumer"
)

// Email is the payload of idem.emails.send: the body of POST /v1/emails.
type Email struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

// DecodeEmail parses and validates an email payload. The recipient must be one
// address; the subject and body may hold anything (the subject is MIME-encoded
// when sent, so a line break in it cannot inject a header).
func DecodeEmail(payload []byte) (Email, *mail.Address, error) {
	var e Email
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil {
		return e, nil, fmt.Errorf("email: decode: %w", err)
	}
	to, err := e.Recipient()
	if err != nil {
		return e, nil, fmt.Errorf("email: %w", err)
	}
	return e, to, nil
}

// Recipient is the one rule for an email's recipient, applied by the ingress (400)
// and by the consumer (a dead letter): exactly one address.
func (e Email) Recipient() (*mail.Address, error) {
	to, err := mail.ParseAddress(e.To)
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
type EmailConfig struct {
	// Addr is the SMTP server, host:port. Required.
	Addr string
	// From is the sender, in the envelope and the From header (default
	// "idem <idem@localhost>").
	From string
	// HelloName is what the client calls itself in EHLO (default "localhost").
	HelloName string
	// Timeout bounds one send, from dial to the server's answer to the message
	// (default 30s).
	Timeout time.Duration
}

// EmailHandler sends each idem.emails.send message through SMTP, as an external
// effect (consumer.External): it runs between the lease and its completion, and
// stamps the message with MessageID(key), so a re-send after a worker died
// mid-send carries the same Message-ID.
//
// It speaks plain SMTP without authentication, to a local relay or a mail sink
// (docker-compose's mailpit); a production sender would add STARTTLS and AUTH.
type EmailHandler struct {
	cfg  EmailConfig
	from *mail.Address
}

var _ consumer.ExternalHandler = (*EmailHandler)(nil)

// NewEmailHandler validates cfg and returns a handler.
func NewEmailHandler(cfg EmailConfig) (*EmailHandler, error) {
	if cfg.Addr == "" {
		return nil, errors.New("email: SMTP address is required")
	}
	if _, _, err := net.SplitHostPort(cfg.Addr); err != nil {
		return nil, fmt.Errorf("email: SMTP address %q: %w", cfg.Addr, err)
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
	from, err := mail.ParseAddress(cfg.From)
	if err != nil {
		return nil, fmt.Errorf("email: From %q: %w", cfg.From, err)
	}
	return &EmailHandler{cfg: cfg, from: from}, nil
}

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
		if errors.As(err, &reply) && reply.Code >= 500 {
			// A 5xx is the server's final word (no such mailbox, policy): retrying
			// the same message cannot change it.
			return nil, consumer.Permanent(err)
		}
		// A 4xx, a timeout or a broken connection: try again. If the message got
		// through before the connection broke, the re-send has the same
		// Message-ID.
		return nil, err
	}
	return json.Marshal(EmailResult{MessageID: id, To: to.Address})
}

// send delivers one message: dial, EHLO, MAIL, RCPT, DATA, QUIT. The message is
// accepted when the server answers the DATA; QUIT's answer does not matter.
func (h *EmailHandler) send(ctx context.Context, messageID string, to *mail.Address, m Email) error {
	ctx, cancel := context.WithTimeout(ctx, h.cfg.Timeout)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", h.cfg.Addr)
	if err != nil {
		return fmt.Errorf("email: dial %s: %w", h.cfg.Addr, err)
	}
	// net/smtp knows no contexts: the deadline bounds every read and write, and
	// cancellation (the lease was lost, the send timed out) closes the socket.
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()

	host, _, _ := net.SplitHostPort(h.cfg.Addr)
	c, err := smtp.NewClient(conn, host)
	if err != nil {
		_ = conn.Close()
		return fmt.Errorf("email: greeting from %s: %w", h.cfg.Addr, err)
	}
	defer c.Close()
	if err := c.Hello(h.cfg.HelloName); err != nil {
		return fmt.Errorf("email: EHLO: %w", err)
	}
	if err := c.Mail(h.from.Address); err != nil {
		return fmt.Errorf("email: MAIL FROM: %w", err)
	}
	if err := c.Rcpt(to.Address); err != nil {
		return fmt.Errorf("email: RCPT TO %s: %w", to.Address, err)
	}
	w, err := c.Data()
	if err != nil {
		return fmt.Errorf("email: DATA: %w", err)
	}
	if _, err := w.Write(h.compose(messageID, to, m)); err != nil {
		return fmt.Errorf("email: write message: %w", err)
	}
	if err := w.Close(); err != nil {
		// The server's answer to the message. An error here is the ambiguous case:
		// the server may have taken the message and lost the connection after.
		return fmt.Errorf("email: message not confirmed: %w", err)
	}
	_ = c.Quit()
	return nil
}

// compose renders the message: headers (non-ASCII and control characters in the
// subject are MIME-encoded) and a quoted-printable UTF-8 body.
func (h *EmailHandler) compose(messageID string, to *mail.Address, m Email) []byte {
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
