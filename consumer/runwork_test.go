package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// A consumer run on its own has a hard stop too: RunWork's ctx ending (the soft
// stop) leaves the effect in flight running; its work context ending (the hard
// stop) cancels the handler's, and RunWork returns once the handler has. The
// abandoned effect is not recorded: its key is left to the next attempt.
func TestRunWorkHasAHardStop(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	entered := make(chan context.Context, 1)
	cfg := testenv.ConsumerConfig("mail")
	cfg.Handler, cfg.BatchHandler = nil, nil
	cfg.External = consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		entered <- ctx
		<-ctx.Done()
		return nil, ctx.Err()
	})
	c, err := consumer.New(env.Inst, cfg)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, softStop := context.WithCancel(context.Background())
	defer softStop()
	workCtx, hardStop := context.WithCancel(context.Background())
	defer hardStop()
	done := make(chan error, 1)
	go func() { done <- c.RunWork(runCtx, workCtx) }()
	env.Publish(t, testenv.Subject, idem.ScopedKey("", "k-mail"), "m-mail", []byte(`{}`))

	var handlerCtx context.Context
	select {
	case handlerCtx = <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the effect never started")
	}
	softStop()
	if err := handlerCtx.Err(); err != nil {
		t.Fatalf("the soft stop cancelled the effect in flight: %v", err)
	}
	hardStop()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("RunWork after the hard stop = %v, want nil", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("RunWork did not return after the hard stop")
	}
	if !errors.Is(handlerCtx.Err(), context.Canceled) {
		t.Fatalf("the handler's context after the hard stop: %v, want canceled", handlerCtx.Err())
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'mail' AND status = 'done'`); n != 0 {
		t.Fatalf("the abandoned effect was recorded as done (%d rows)", n)
	}
}

// Consumers started together register first, then run: a sibling that has
// already settled messages does not make one registered beside it look renamed
// from it. Without Register, b's Run after a settled is refused (ErrLikelyRenamed),
// which is what a worker whose consumers registered as they ran did, at random.
func TestRegisteredSiblingsAreNotRenames(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	for i := range 5 {
		env.Publish(t, testenv.Subject, idem.ScopedKey("", idem.Key(fmt.Sprintf("k-%d", i))), "", []byte(`{}`))
	}
	def := func(name string) consumer.Config {
		cfg := testenv.ConsumerConfig(name)
		cfg.Start = consumer.StartDefault
		return cfg
	}
	a, err := consumer.New(env.Inst, def("a"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := consumer.New(env.Inst, def("b"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, c := range []*consumer.Consumer{a, b} {
		if err := c.Register(ctx); err != nil {
			t.Fatalf("Register %s: %v", c.Config().Name, err)
		}
	}
	stopA := testenv.Go(t, "consumer a", a.Run)
	testenv.Eventually(t, 20*time.Second, "a settles the stream", func() bool { return env.AllEffects(t) == 5 })
	stopA()
	stopB := testenv.Go(t, "consumer b", b.Run) // fails the test if Run returns an error
	defer stopB()
	testenv.Eventually(t, 20*time.Second, "b settles the stream too", func() bool { return env.AllEffects(t) == 10 })

	// The control: c, registered only by its Run after a settled, is refused.
	c, err := consumer.New(env.Inst, def("c"))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Run(ctx); !errors.Is(err, consumer.ErrLikelyRenamed) {
		t.Fatalf("c's Run after a settled, unregistered = %v, want ErrLikelyRenamed", err)
	}
}
