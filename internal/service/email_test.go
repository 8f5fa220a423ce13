package service_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/demo"
	"github.com/idemkit/idem/internal/smtptest"
	"github.com/idemkit/idem/internal/testenv"
)

// POST /v1/emails through the whole worker: the same key sent three times is one
// email on a real SMTP socket, with the Message-ID derived from the scoped key.
func TestEmailThroughTheWorkerSendsOnce(t *testing.T) {
	b := setup(t)
	sink := smtptest.Start(t)
	cfg := b.config()
	cfg.SMTPAddr = sink.Addr()
	svc := b.start(t, cfg)

	body := `{"to":"a@example.com","subject":"Receipt","body":"Thanks"}`
	hdr := map[string]string{idem.HeaderScope: "tenant-a"}
	for range 3 {
		if r := post(t, "http://"+svc.HTTPAddr()+"/v1/emails", "k-mail", body, hdr); r.StatusCode != http.StatusAccepted {
			t.Fatalf("status %d", r.StatusCode)
		}
	}
	scoped := idem.ScopedKey("tenant-a", "k-mail")
	testenv.Eventually(t, 45*time.Second, "the email consumer to complete the key", func() bool {
		return b.db.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'emails' AND key = $1 AND status = 'done'`, scoped) == 1
	})
	if n := sink.Deliveries(); n != 1 {
		t.Fatalf("SMTP deliveries = %d, want 1", n)
	}
	if n := sink.DeliveriesOf(demo.MessageID(scoped)); n != 1 {
		t.Fatalf("deliveries with Message-ID %s = %d, want 1", demo.MessageID(scoped), n)
	}
}
