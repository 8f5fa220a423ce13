package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// A consumer registers itself before it takes a message: the reconciler waits for
// the settlement of every registered consumer that reads a subject.
func TestConsumerRegistersItself(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	c, err := consumer.New(env.Inst, testenv.ConsumerConfig("reg"))
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, "consumer", c.Run)
	testenv.Eventually(t, 10*time.Second, "the registration", func() bool {
		return env.DB.Count(t, `SELECT count(*) FROM idem_consumers WHERE name = 'reg' AND stream = $1 AND filter_subject = $2
			AND key_lifetime = $3::interval`, testenv.Stream, testenv.Subject, c.Config().KeyLifetime) == 1
	})
}

// The stream goes missing, so recreating the durable consumer fails; then another
// worker recreates the stream and the shared durable consumer before this one looks
// again. The consumer must resume its subscription, not only report healthy.
func TestConsumerResumesAfterAFailedRecreation(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := context.Background()
	cfg := testenv.ConsumerConfig("shared")
	cfg.CheckInterval = 100 * time.Millisecond
	c, err := consumer.New(env.Inst, cfg)
	if err != nil {
		t.Fatal(err)
	}
	testenv.Go(t, "consumer", c.Run)
	env.Publish(t, testenv.Subject, idem.NewKey().String(), "", []byte(`{}`))
	testenv.Eventually(t, 10*time.Second, "the first effect", func() bool { return env.AllEffects(t) == 1 })

	if err := env.JS.DeleteStream(ctx, testenv.Stream); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "Health to say the durable consumer is missing", func() bool { return c.Health() != nil })
	// Another worker's stream keeper and consumer.
	if _, err := env.Inst.EnsureStream(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := env.JS.CreateOrUpdateConsumer(ctx, testenv.Stream, c.JetStreamConfig()); err != nil {
		t.Fatal(err)
	}
	env.Publish(t, testenv.Subject, idem.NewKey().String(), "", []byte(`{}`))
	testenv.Eventually(t, 15*time.Second, "the message published after the recreation to take effect", func() bool { return env.AllEffects(t) == 2 })
	if err := c.Health(); err != nil {
		t.Errorf("Health = %v after resuming", err)
	}
}
