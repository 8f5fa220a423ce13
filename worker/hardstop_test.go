package worker_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/worker"
)

// An external effect that succeeds after the hard stop cancelled its context (the
// handler, like an SMTP client past DATA, does not abort on ctx) is recorded before
// Stop returns: the hard stop does not throw the record away, and no takeover
// performs the effect a second time.
func TestHardStopRecordsAnEffectThatSucceeded(t *testing.T) {
	env := testenv.New(t)
	var performs atomic.Int32
	entered := make(chan struct{}, 4)
	h := consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		n := performs.Add(1)
		entered <- struct{}{}
		if n == 1 {
			<-ctx.Done()                      // the hard stop cancels it ...
			time.Sleep(50 * time.Millisecond) // ... while the send it started completes
		}
		return []byte(`{"sent":true}`), nil // the effect happened
	})
	cfg := testenv.ConsumerConfig("mail")
	cfg.BatchHandler, cfg.Handler, cfg.External = nil, nil, h
	cfg.LeaseFor, cfg.AckWait = 2*time.Second, 2*time.Second
	w, err := worker.New(env.Inst, worker.Config{Consumers: []consumer.Config{cfg}, DisableRetention: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	env.Publish(t, testenv.Subject, idem.ScopedKey("", "k-mail"), "m-mail", []byte(`{}`))
	<-entered
	stopCtx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	t.Logf("stop: %v", w.Stop(stopCtx))
	if st := env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer='mail' AND status='done'`); st != 1 {
		t.Errorf("inbox rows done after the hard stop: %d, want 1 (the effect succeeded)", st)
	}

	// The next worker finds the message acked, or the key done if it is redelivered.
	w2, err := worker.New(env.Inst, worker.Config{Consumers: []consumer.Config{cfg}, DisableRetention: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := w2.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	defer w2.Stop(context.Background())
	testenv.Eventually(t, 30*time.Second, "the message settled", env.Drained(t, "mail"))
	if n := performs.Load(); n != 1 {
		t.Errorf("performs = %d, want 1: the first succeeded", n)
	}
}
