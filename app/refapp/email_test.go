package refapp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testkit/smtptest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// runEmails runs an email consumer until the returned stop is called (or the test
// ends); ctx carries fault points, if any.
func runEmails(t *testing.T, ctx context.Context, env *testenv.Env, cfg consumer.Config, obs idem.Observer) (stop func()) {
	t.Helper()
	c, err := consumer.New(appInstall(t, env, obs), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return testenv.GoCtx(t, ctx, "emails consumer", c.Run)
}

// emailWorld is an email consumer's world: Postgres, JetStream with the
// application's stream, a real SMTP server.
type emailWorld struct {
	env  *testenv.Env
	sink *smtptest.Server
	out  *testenv.Outcomes
}

func newEmailWorld(t *testing.T) *emailWorld {
	t.Helper()
	t.Parallel()
	return &emailWorld{env: newAppEnv(t), sink: smtptest.Start(t), out: &testenv.Outcomes{}}
}

// config is the email consumer as the worker runs it, with test timings: a lease
// that outlives the ack wait, so a crashed worker's redelivery first finds the
// lease live and backs off, then takes it over.
func (w *emailWorld) config(t *testing.T) consumer.Config {
	t.Helper()
	h, err := refapp.NewEmailHandler(refapp.EmailConfig{Addr: w.sink.Addr(), Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return consumer.Config{
		Name:     refapp.EmailConsumer,
		Subject:  refapp.SubjectEmail,
		External: h,
		LeaseFor: 800 * time.Millisecond,
		AckWait:  300 * time.Millisecond,
		Backoff:  func(int) time.Duration { return 50 * time.Millisecond },
	}
}

func emailPayload(to, subject, body string) []byte {
	b, _ := json.Marshal(refapp.Email{To: to, Subject: subject, Body: body})
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
	w.env.Publish(t, refapp.SubjectEmail, key, idem.MsgID(refapp.SubjectEmail, key), emailPayload("a@example.com", "Receipt", "Thanks!"))

	var died atomic.Bool
	cfg := w.config(t)
	crash := faults.With(context.Background(), faults.New().Func(faults.ExternalAfterPerform, func(context.Context, []string) error {
		if died.CompareAndSwap(false, true) {
			return errors.New("fault: worker killed after the SMTP server took the message")
		}
		return nil
	}))
	stop := runEmails(t, crash, w.env, cfg, w.out.Observe)
	testenv.Eventually(t, 45*time.Second, "the first worker to send and die", died.Load)
	stop()
	if n := w.sink.Deliveries(); n != 1 {
		t.Fatalf("after the crash: %d deliveries, want 1", n)
	}

	runEmails(t, context.Background(), w.env, cfg, w.out.Observe) // the next worker
	testenv.Eventually(t, 45*time.Second, "the takeover to complete the key", func() bool {
		return w.out.Get(idem.OutcomeProcessed) == 1
	})
	if raw, distinct := w.sink.Deliveries(), w.sink.DistinctMessageIDs(); raw != 2 || distinct != 1 {
		t.Fatalf("SMTP server got %d raw deliveries with %d distinct Message-IDs; want 2 and 1", raw, distinct)
	}
	id := refapp.MessageID(key)
	if n := w.sink.DeliveriesOf(id); n != 2 {
		t.Fatalf("deliveries with Message-ID %s = %d, want 2 (both attempts stamped with the key's id)", id, n)
	}
	var res refapp.EmailResult
	var result []byte
	if err := w.env.DB.Pool.QueryRow(context.Background(),
		`SELECT result FROM idem_inbox WHERE consumer = 'emails' AND key = $1 AND status = 'done'`, key).Scan(&result); err != nil {
		t.Fatalf("inbox: %v", err)
	}
	if err := json.Unmarshal(result, &res); err != nil || res.MessageID != id || res.To != "a@example.com" {
		t.Fatalf("stored result %s (%v), want message_id %s", result, err, id)
	}
	t.Logf("busy back-offs while the dead worker's lease ran out: %d", w.out.Get(idem.OutcomeBusy))

	// Done is done: a re-publish of the intent sends nothing.
	w.env.Publish(t, refapp.SubjectEmail, key, "republish", emailPayload("a@example.com", "Receipt", "Thanks!"))
	testenv.Eventually(t, 45*time.Second, "the re-publish folded", func() bool {
		return w.out.Get(idem.OutcomeDuplicate) == 1
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
	runEmails(t, context.Background(), w.env, w.config(t), w.out.Observe)
	w.env.Publish(t, refapp.SubjectEmail, "k-lost-reply", "m1", emailPayload("b@example.com", "Hi", "body"))
	testenv.Eventually(t, 45*time.Second, "the retry to complete", func() bool {
		return w.out.Get(idem.OutcomeProcessed) == 1
	})
	if raw, distinct := w.sink.Deliveries(), w.sink.DistinctMessageIDs(); raw != 2 || distinct != 1 {
		t.Fatalf("SMTP server got %d raw deliveries with %d distinct Message-IDs; want 2 and 1", raw, distinct)
	}
	if n := w.out.Get(idem.OutcomeFailed); n != 1 {
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
		w.env.Publish(t, refapp.SubjectEmail, "k-first", fmt.Sprintf("copy-%d", i), payload)
	}
	w.env.Publish(t, refapp.SubjectEmail, "k-second", "second", payload)
	runEmails(t, context.Background(), w.env, w.config(t), w.out.Observe)
	drained := w.env.DrainedOn(t, refapp.StreamName, refapp.EmailConsumer)
	testenv.Eventually(t, 45*time.Second, "both keys sent and all 4 messages acked", func() bool {
		return w.out.Get(idem.OutcomeProcessed) == 2 && drained()
	})
	if n := w.out.Get(idem.OutcomeDuplicate); n < 2 {
		t.Errorf("duplicates folded = %d, want at least 2 (the two extra copies of k-first)", n)
	}
	if raw, distinct := w.sink.Deliveries(), w.sink.DistinctMessageIDs(); raw != 2 || distinct != 2 {
		t.Fatalf("SMTP server got %d raw, %d distinct; want 2 and 2 (one per key)", raw, distinct)
	}
	m := w.sink.Messages()[0]
	if m.MessageID != refapp.MessageID("k-first") {
		t.Errorf("Message-ID = %q, want %q", m.MessageID, refapp.MessageID("k-first"))
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
	w.env.Publish(t, refapp.SubjectEmail, "k-not-json", "p1", []byte(`{"to":`))
	w.env.Publish(t, refapp.SubjectEmail, "k-two-rcpts", "p2", emailPayload("a@example.com, b@example.com", "s", "b"))
	w.env.Publish(t, refapp.SubjectEmail, "k-fine", "ok", emailPayload("c@example.com", "s", "b"))
	runEmails(t, context.Background(), w.env, w.config(t), w.out.Observe)
	drained := w.env.DrainedOn(t, refapp.StreamName, refapp.EmailConsumer)
	testenv.Eventually(t, 45*time.Second, "1 sent and all 3 messages settled", func() bool {
		return w.out.Get(idem.OutcomeProcessed) == 1 && drained()
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
	a, b := refapp.MessageID(idem.ScopedKey("t1", "k")), refapp.MessageID(idem.ScopedKey("t2", "k"))
	if a == b {
		t.Fatal("two scopes' keys share a Message-ID")
	}
	if a != refapp.MessageID(idem.ScopedKey("t1", "k")) {
		t.Fatal("Message-ID is not deterministic")
	}
	if !strings.HasPrefix(a, "<") || !strings.HasSuffix(a, "@idem>") || len(a) != len("<@idem>")+32 {
		t.Fatalf("Message-ID %q: want <32 hex digits@idem>", a)
	}
}

func TestNewEmailHandlerValidates(t *testing.T) {
	t.Parallel()
	for _, cfg := range []refapp.EmailConfig{{}, {Addr: "no-port"}, {Addr: "localhost:25", From: "not an address"}} {
		if _, err := refapp.NewEmailHandler(cfg); err == nil {
			t.Errorf("NewEmailHandler(%+v): want an error", cfg)
		}
	}
}
