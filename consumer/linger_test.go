package consumer_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// Messages that arrive one by one at a steady trickle share transactions: a batch
// that is not full waits (the linger) for the next ones. The transactions are
// counted in the inbox itself: each row's xmin is the transaction that wrote it
// with its effect. The trickle is slower than a commit, so without the linger
// nearly every message is a transaction of its own. The linger is stretched here
// (the default is a few milliseconds) so that a loaded test machine's commits stay
// well inside the gaps. A message that arrives alone afterwards still goes once
// its linger is over.
func TestTrickleSharesTransactions(t *testing.T) {
	b := setup(t)
	const messages, gap, linger = 30, 10 * time.Millisecond, 60 * time.Millisecond
	cfg := b.config()
	consumer.SetLinger(&cfg, linger)
	b.start(t, cfg)
	testenv.Eventually(t, 45*time.Second, "the consumer registered", func() bool {
		return b.env.DB.Count(t, `SELECT count(*) FROM idem_consumers WHERE name = $1`, effectName) == 1
	})

	tick := time.NewTicker(gap) // the trickle's pace, not a wait for a condition
	defer tick.Stop()
	for i := range messages {
		<-tick.C
		b.env.Publish(t, testenv.Subject, fmt.Sprintf("k-trickle-%02d", i), "", payload(i))
	}
	testenv.Eventually(t, 45*time.Second, "the trickle processed", func() bool {
		return b.out.Get(idem.OutcomeProcessed) >= messages
	})
	txs := b.env.DB.Count(t, `SELECT count(DISTINCT xmin::text) FROM idem_inbox WHERE consumer = $1`, effectName)
	t.Logf("%d messages %s apart: %d transactions", messages, gap, txs)
	if txs > messages/3 {
		t.Errorf("%d messages took %d transactions, want at most %d: arrivals did not share transactions", messages, txs, messages/3)
	}
	if n := b.env.AllEffects(t); n != messages {
		t.Errorf("effects = %d, want %d", n, messages)
	}

	published := time.Now()
	b.env.Publish(t, testenv.Subject, "k-alone", "", payload(messages))
	testenv.Eventually(t, 45*time.Second, "the lone message processed", func() bool {
		return b.env.Effects(t, "k-alone") == 1
	})
	took := time.Since(published)
	t.Logf("a lone message: %s from publish to its effect (linger %s)", took, linger)
	// Generous for a loaded machine; what it rules out is a batch held until it
	// fills. The linger's own bound is TestTakeHoldsALoneMessageForTheLingerOnly's.
	if took > linger+5*time.Second {
		t.Errorf("a lone message took %s, far past the linger %s", took, linger)
	}
}
