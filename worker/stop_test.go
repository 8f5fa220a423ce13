package worker_test

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/worker"
)

// A handler that does not finish holds up the soft stop only until Stop's context
// ends: then its context is cancelled, its transaction rolls back (no effect, no
// inbox row), and Stop returns that it cancelled work, with every goroutine of the
// worker gone. The message stays in the stream for the next worker.
func TestStopCancelsWorkThatOutlivesItsContext(t *testing.T) {
	env := testenv.New(t)
	entered := make(chan struct{})
	handlerErr := make(chan error, 1)
	hang := consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO public.test_effects (key, payload) VALUES ($1, $2)`, d.Key, d.Payload); err != nil {
			return nil, err
		}
		close(entered)
		<-ctx.Done() // a handler stuck on something that only its context ends
		handlerErr <- ctx.Err()
		return nil, ctx.Err()
	})
	cfg := testenv.ConsumerConfig("hang")
	cfg.BatchHandler, cfg.Handler, cfg.AckWait = nil, hang, 30*time.Second
	w, err := worker.New(env.Inst, worker.Config{Consumers: []consumer.Config{cfg}, DisableRetention: true})
	if err != nil {
		t.Fatal(err)
	}
	before := idemGoroutines()
	if err := w.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	env.Publish(t, testenv.Subject, idem.ScopedKey("", "k-hang"), "m-hang", []byte(`{}`))
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler never ran")
	}

	stopCtx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	stopped := make(chan error, 1)
	go func() { stopped <- w.Stop(stopCtx) }()
	select {
	case err = <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("Stop did not return after its context ended: the work in flight was never cancelled")
	}
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "cancelled") {
		t.Errorf("Stop = %v, want it to say the work in flight was cancelled at its deadline", err)
	}
	if got := <-handlerErr; !errors.Is(got, context.Canceled) {
		t.Errorf("the handler's context ended with %v, want it cancelled", got)
	}
	if n := env.Effects(t, idem.ScopedKey("", "k-hang")); n != 0 {
		t.Errorf("%d effects committed by a cancelled handler, want its transaction rolled back", n)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'hang'`); n != 0 {
		t.Errorf("%d inbox rows for a rolled-back batch", n)
	}
	// Every goroutine the worker started has returned (the pool's and the NATS
	// connection's are the caller's).
	if after := idemGoroutines(); after > before {
		buf := make([]byte, 1<<20)
		t.Errorf("%d of idem's goroutines still run after Stop (%d before Start):\n%s", after, before, buf[:runtime.Stack(buf, true)])
	}
	if n := env.StreamMsgs(t, testenv.Stream); n != 1 {
		t.Errorf("the stream holds %d messages, want the cancelled one kept for the next worker", n)
	}
}

// idemGoroutines counts the goroutines running idem's code outside tests.
func idemGoroutines() int {
	buf := make([]byte, 1<<20)
	n := 0
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		if strings.Contains(g, "github.com/idemkit/idem/") && !strings.Contains(g, "_test.go") && !strings.Contains(g, "testing.tRunner") {
			n++
		}
	}
	return n
}
