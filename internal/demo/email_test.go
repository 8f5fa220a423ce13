package demo_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/demo"
	"github.com/idemkit/idem/internal/smtptest"
	"github.com/idemkit/idem/internal/testenv"
)

// extCounts counts External outcomes reported through OnOutcome.
type extCounts struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *extCounts) add(_ string, outcome string, n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[outcome] += n
}

func (c *extCounts) get(outcome string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[outcome]
}

// runExternal runs an External consumer until the returned stop is called (or the
// test ends).
func runExternal(t *testing.T, env *testenv.Env, cfg consumer.ExternalConfig) (stop func()) {
	t.Helper()
	x, err := consumer.NewExternal(env.DB.Pool, env.JS, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return testenv.Go(t, "External.Run", x.Run)
}

// emailWorld is an email consumer's world: Postgres, JetStream, a real SMTP server.
type emailWorld struct {
	env  *testenv.Env
	sink *smtptest.Server
	out  *extCounts
}

func newEmailWorld(t *testing.T) *emailWorld {
	t.Helper()
	t.Parallel()
	return &emailWorld{env: testenv.New(t), sink: smtptest.Start(t), out: &extCounts{}}
}

// config is the email consumer as the worker runs it, with test timings: a lease
// that outlives the ack wait, so a crashed worker's redelivery first finds the
// lease live and backs off, then takes it over.
func (w *emailWorld) config(t *testing.T) consumer.ExternalConfig {
	t.Helper()
	h, err := demo.NewEmailHandler(demo.EmailConfig{Addr: w.sink.Addr(), Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return consumer.ExternalConfig{
		Name:      "emails",
		Subject:   idem.SubjectEmail,
		Handler:   h,
		LeaseFor:  800 * time.Millisecond,
		AckWait:   300 * time.Millisecond,
		Backoff:   func(int) time.Duration { return 50 * time.Millisecond },
		OnOutcome: w.out.add,
	}
}

func emailPayload(to, subject, body string) []byte {
	b, _ := json.Marshal(demo.Email{To: to, Subject: subject, Body: body})
	return b
}

// The scenario: the worker hands the message to the SMTP server and dies
// before it can record that it did. Its lease expires; the next worker takes the
// key over and sends again — with the same Message-ID. The SMTP server received
// two raw deliveries and one distinct Message-ID: one message per key for a mail
// system that dedupes on Message-ID, and never zero.
func TestEmailOneMessagePerKeyThroughWorkerKilledMidSend(t *testing.T) {
	w := newEmailWorld(t)
	key := idem.ScopedKey("tenant-a", "k-mail")
	w.env.Publish(t, idem.SubjectEmail, key, idem.MsgID(idem.SubjectEmail, key), emailPayload("a@example.com", "Receipt", "Thanks!"))

	var died atomic.Bool
	cfg := w.config(t)
	cfg.AfterPerform = func(_ context.Context, _ *consumer.Delivery, err error) error {
		if err == nil && died.CompareAndSwap(false, true) {
			return errors.New("fault: worker killed after the SMTP server took the message")
		}
		return nil
	}
	stop := runExternal(t, w.env, cfg)
	testenv.Eventually(t, 45*time.Second, "the first worker to send and die", died.Load)
	stop()
	if n := w.sink.Deliveries(); n != 1 {
		t.Fatalf("after the crash: %d deliveries, want 1", n)
	}

	cfg.AfterPerform = nil
	runExternal(t, w.env, cfg) // the next worker
	testenv.Eventually(t, 45*time.Second, "the takeover to complete the key", func() bool {
		return w.out.get(consumer.OutcomeProcessed) == 1
	})
	if raw, distinct := w.sink.Deliveries(), w.sink.DistinctMessageIDs(); raw != 2 || distinct != 1 {
		t.Fatalf("SMTP server got %d raw deliveries with %d distinct Message-IDs; want 2 and 1", raw, distinct)
	}
	id := demo.MessageID(key)
	if n := w.sink.DeliveriesOf(id); n != 2 {
		t.Fatalf("deliveries with Message-ID %s = %d, want 2 (both attempts stamped with the key's id)", id, n)
	}
	var res demo.EmailResult
	var result []byte
	if err := w.env.DB.Pool.QueryRow(context.Background(),
		`SELECT result FROM idem_inbox WHERE consumer = 'emails' AND key = $1 AND status = 'done'`, key).Scan(&result); err != nil {
		t.Fatalf("inbox: %v", err)
	}
	if err := json.Unmarshal(result, &res); err != nil || res.MessageID != id || res.To != "a@example.com" {
		t.Fatalf("stored result %s (%v), want message_id %s", result, err, id)
	}
	t.Logf("busy back-offs while the dead worker's lease ran out: %d", w.out.get(consumer.OutcomeBusy))

	// Done is done: a re-publish of the intent sends nothing.
	w.env.Publish(t, idem.SubjectEmail, key, "republish", emailPayload("a@example.com", "Receipt", "Thanks!"))
	testenv.Eventually(t, 45*time.Second, "the re-publish folded", func() bool {
		return w.out.get(consumer.OutcomeDuplicate) == 1
	})
	if n := w.sink.Deliveries(); n != 2 {
		t.Fatalf("deliveries after a duplicate = %d, want still 2", n)
	}
}

// The SMTP server takes the message and the connection breaks before its answer:
// the worker cannot know the mail went out, treats it as failed and retries — with
// the same Message-ID.
func TestEmailLostReplyIsResentWithSameMessageID(t *testing.T) {
	w := newEmailWorld(t)
	w.sink.HangUpAfterData(1)
	runExternal(t, w.env, w.config(t))
	w.env.Publish(t, idem.SubjectEmail, "k-lost-reply", "m1", emailPayload("b@example.com", "Hi", "body"))
	testenv.Eventually(t, 45*time.Second, "the retry to complete", func() bool {
		return w.out.get(consumer.OutcomeProcessed) == 1
	})
	if raw, distinct := w.sink.Deliveries(), w.sink.DistinctMessageIDs(); raw != 2 || distinct != 1 {
		t.Fatalf("SMTP server got %d raw deliveries with %d distinct Message-IDs; want 2 and 1", raw, distinct)
	}
	if n := w.out.get(consumer.OutcomeFailed); n != 1 {
		t.Errorf("failed attempts = %d, want 1 (the hang-up)", n)
	}
}

// Copies of one intent send one email, with the payload's recipient, subject and
// body; a second intent with the very same content is a second email (content is
// not a key). The subject is MIME-encoded, so a line break in it cannot smuggle in
// a header.
func TestEmailDuplicatesSendOnceAndContentIsNotAKey(t *testing.T) {
	w := newEmailWorld(t)
	payload := emailPayload("Zoë <zoe@example.com>", "Re: café\r\nBcc: evil@example.com", "line one\nline two é")
	for i := range 3 {
		w.env.Publish(t, idem.SubjectEmail, "k-first", fmt.Sprintf("copy-%d", i), payload)
	}
	w.env.Publish(t, idem.SubjectEmail, "k-second", "second", payload)
	runExternal(t, w.env, w.config(t))
	drained := w.env.Drained(t, "emails")
	testenv.Eventually(t, 45*time.Second, "both keys sent and all 4 messages acked", func() bool {
		return w.out.get(consumer.OutcomeProcessed) == 2 && drained()
	})
	if n := w.out.get(consumer.OutcomeDuplicate); n < 2 {
		t.Errorf("duplicates folded = %d, want at least 2 (the two extra copies of k-first)", n)
	}
	if raw, distinct := w.sink.Deliveries(), w.sink.DistinctMessageIDs(); raw != 2 || distinct != 2 {
		t.Fatalf("SMTP server got %d raw, %d distinct; want 2 and 2 (one per key)", raw, distinct)
	}
	m := w.sink.Messages()[0]
	if m.MessageID != demo.MessageID("k-first") {
		t.Errorf("Message-ID = %q, want %q", m.MessageID, demo.MessageID("k-first"))
	}
	if len(m.To) != 1 || m.To[0] != "zoe@example.com" {
		t.Errorf("envelope recipient = %q", m.To)
	}
	if got := m.Header.Get("Bcc"); got != "" {
		t.Errorf("a Bcc header was injected through the subject: %q", got)
	}
	subject, err := new(mime.WordDecoder).DecodeHeader(m.Header.Get("Subject"))
	if err != nil || subject != "Re: café\r\nBcc: evil@example.com" {
		t.Errorf("subject = %q (%v), want the payload's subject, encoded", subject, err)
	}
	if strings.TrimSuffix(string(m.Body), "\n") != "line one\nline two é" { // the sink reports "\n" line ends
		t.Errorf("body = %q", m.Body)
	}
}

// Poison emails are dead-lettered, not retried: a payload that is not an email and
// a recipient that is not one address.
func TestEmailPoisonIsDeadLettered(t *testing.T) {
	w := newEmailWorld(t)
	w.env.Publish(t, idem.SubjectEmail, "k-not-json", "p1", []byte(`{"to":`))
	w.env.Publish(t, idem.SubjectEmail, "k-two-rcpts", "p2", emailPayload("a@example.com, b@example.com", "s", "b"))
	w.env.Publish(t, idem.SubjectEmail, "k-fine", "ok", emailPayload("c@example.com", "s", "b"))
	runExternal(t, w.env, w.config(t))
	drained := w.env.Drained(t, "emails")
	testenv.Eventually(t, 45*time.Second, "1 sent and all 3 messages settled", func() bool {
		return w.out.get(consumer.OutcomeProcessed) == 1 && drained()
	})
	if n := w.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE consumer = 'emails' AND reason LIKE 'permanent handler error: %email:%'`); n != 2 {
		t.Errorf("dead letters = %d, want 2 with the email error as reason", n)
	}
	if n := w.sink.Deliveries(); n != 1 {
		t.Errorf("deliveries = %d, want 1", n)
	}
}

func TestMessageID(t *testing.T) {
	t.Parallel()
	a, b := demo.MessageID(idem.ScopedKey("t1", "k")), demo.MessageID(idem.ScopedKey("t2", "k"))
	if a == b {
		t.Fatal("two scopes' keys share a Message-ID")
	}
	if a != demo.MessageID(idem.ScopedKey("t1", "k")) {
		t.Fatal("Message-ID is not deterministic")
	}
	if !strings.HasPrefix(a, "<") || !strings.HasSuffix(a, "@idem>") || len(a) != len("<@idem>")+32 {
		t.Fatalf("Message-ID %q: want <32 hex digits@idem>", a)
	}
}

func TestNewEmailHandlerValidates(t *testing.T) {
	t.Parallel()
	for _, cfg := range []demo.EmailConfig{{}, {Addr: "no-port"}, {Addr: "localhost:25", From: "not an address"}} {
		if _, err := demo.NewEmailHandler(cfg); err == nil {
			t.Errorf("NewEmailHandler(%+v): want an error", cfg)
		}
	}
}
