package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// A dead letter is one message: its consumer, stream sequence, key and payload. A
// redelivered copy of a poison message whose terminate was lost (simulated by
// recreating the durable consumer, so the broker delivers sequence 1 again) files
// nothing new; a different poison message at the same sequence of a recreated
// stream (sequences restart at 1) is filed beside the old one, not terminated
// without a trace — whether its key or only its payload differs.
func TestDeadLetterIdentitySurvivesARecreatedStream(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	cfg := b.config()
	cfg.BatchHandler = decodingEffect{} // a negative n is a permanent error
	dead := 0
	round := func(what string, resetStream, resetDurable bool, key string, n int) {
		t.Helper()
		if resetStream {
			if err := b.env.JS.DeleteStream(ctx, testenv.Stream); err != nil {
				t.Fatalf("%s: delete stream: %v", what, err)
			}
			if _, err := b.env.Inst.EnsureStream(ctx); err != nil {
				t.Fatalf("%s: recreate stream: %v", what, err)
			}
		}
		if resetDurable {
			if err := b.env.JS.DeleteConsumer(ctx, testenv.Stream, effectName); err != nil {
				t.Fatalf("%s: delete durable consumer: %v", what, err)
			}
		}
		if key != "" {
			b.env.Publish(t, testenv.Subject, key, "", fmt.Appendf(nil, `{"n":%d}`, n))
		}
		stop := b.start(t, cfg)
		dead++
		drained := b.env.Drained(t, effectName)
		testenv.Eventually(t, 45*time.Second, what+": dead-lettered", func() bool {
			return b.out.Get(idem.OutcomeDeadLettered) >= dead && drained()
		})
		stop()
	}
	rows := func(what string, want int) {
		t.Helper()
		if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE stream_seq = 1`); n != want {
			t.Fatalf("%s: %d dead letters at stream sequence 1, want %d", what, n, want)
		}
	}

	round("first poison message", false, false, "k-poison", -1)
	rows("first poison message", 1)

	round("redelivered copy", false, true, "", 0)
	rows("redelivered copy of the same message", 1)

	round("recreated stream, another key", true, false, "k-other", -2)
	rows("another poison message at sequence 1 of a recreated stream", 2)

	round("recreated again, the first key with another payload", true, false, "k-poison", -3)
	rows("the first key with another payload at sequence 1", 3)

	if n := b.env.DB.Count(t, `SELECT count(DISTINCT fingerprint) FROM idem_dead_letters WHERE key = 'k-poison'`); n != 2 {
		t.Errorf("fingerprints of k-poison's dead letters = %d distinct, want 2", n)
	}
	if n := b.env.AllEffects(t); n != 0 {
		t.Errorf("effects = %d, want 0", n)
	}
}
