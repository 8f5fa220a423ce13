package idemwatermill_test

// Side by side: Watermill's own middleware.Deduplicator (v1.5.1, used as shipped)
// and this package's middleware, behind a real message.Router on gochannel, with
// the effect written to a real Postgres table that has no unique constraint on
// the key.

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemkit/idem"
	idemwatermill "github.com/idemkit/idem/watermill"
)

// contender is one deduplication strategy under test.
type contender struct {
	name string
	// middleware returns the strategy's router middleware.
	middleware func(t *testing.T, db testDB) message.HandlerMiddleware
	// effect is the handler's side effect: through the pool for the Deduplicator,
	// which has no transaction, through the idem transaction for the adapter.
	effect func(db testDB) message.NoPublishHandlerFunc
}

// watermillDefault returns middleware.Deduplicator with its defaults: the key is an
// Adler-32 hash of the payload, remembered for a minute in process memory.
func watermillDefault() contender {
	return contender{
		name: "watermill Deduplicator, default payload-hash key",
		middleware: func(*testing.T, testDB) message.HandlerMiddleware {
			return (&middleware.Deduplicator{}).Middleware
		},
		effect: effectViaPool,
	}
}

// watermillByKey returns middleware.Deduplicator keyed on the Idempotency-Key metadata,
// the best a Watermill user can configure it.
func watermillByKey() contender {
	return contender{
		name: "watermill Deduplicator keyed on Idempotency-Key metadata",
		middleware: func(*testing.T, testDB) message.HandlerMiddleware {
			d := &middleware.Deduplicator{KeyFactory: middleware.NewMessageHasherFromMetadataField(idem.HeaderKey)}
			return d.Middleware
		},
		effect: effectViaPool,
	}
}

// adapter returns this package's middleware.
func adapter() contender {
	return contender{
		name: "idemwatermill.Middleware",
		middleware: func(t *testing.T, db testDB) message.HandlerMiddleware {
			return idemwatermill.Middleware(newInst(t, db, ""), idemwatermill.Config{Consumer: consumerName})
		},
		effect: func(testDB) message.NoPublishHandlerFunc { return effectInTx },
	}
}

func effectViaPool(db testDB) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error { return insertEffect(msg.Context(), db.Pool, msg) }
}

// A handler fails once, transiently, before its effect. The router nacks and
// gochannel redelivers the message.
//
// Watermill's Deduplicator recorded the key before the handler ran, so it drops
// the redelivery as a duplicate and acks it: the handler ran once, failed, and the
// order is never billed. Keying on Idempotency-Key does not help; the flaw is the
// order (record, then run), not the key. The adapter's claim is rolled back with
// the failed attempt, so the redelivery runs: exactly one effect.
func TestTransientFailureLosesMessageOnlyWithWatermillDeduplicator(t *testing.T) {
	cases := []struct {
		contender
		wantCalls   int64 // handler invocations, the failed one included
		wantEffects int   // effect rows
	}{
		{contender: watermillDefault(), wantCalls: 1, wantEffects: 0},
		{contender: watermillByKey(), wantCalls: 1, wantEffects: 0},
		{contender: adapter(), wantCalls: 2, wantEffects: 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := newDB(t, "")
			ps := newPubSub()
			h := &flaky{failures: 1, next: tc.effect(db)}
			startRouter(t, ps, h.handle, tc.middleware(t, db))

			// Returns once the message is acked: processed or dropped.
			publish(t, ps, order(idem.NewKey().String(), "acct_1", 1250))

			if got := h.calls.Load(); got != tc.wantCalls {
				t.Errorf("handler ran %d times, want %d", got, tc.wantCalls)
			}
			if got := effects(t, db); got != tc.wantEffects {
				t.Errorf("effect rows = %d, want %d", got, tc.wantEffects)
			}
		})
	}
}

// Two devices each place "an order of 12.50 from acct_1": two intents, two keys,
// the same bytes.
//
// Watermill's default Deduplicator keys on a hash of the payload and folds the
// second order into the first. (Keyed on Idempotency-Key it keeps both: that
// flaw is fixable by configuration, the lost retry above is not.) The adapter keys
// on Idempotency-Key only and bills twice, as asked.
func TestIdenticalPaymentsFoldedOnlyByPayloadHash(t *testing.T) {
	cases := []struct {
		contender
		wantEffects int
	}{
		{contender: watermillDefault(), wantEffects: 1},
		{contender: watermillByKey(), wantEffects: 2},
		{contender: adapter(), wantEffects: 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := newDB(t, "")
			ps := newPubSub()
			h := &flaky{next: tc.effect(db)}
			startRouter(t, ps, h.handle, tc.middleware(t, db))

			first, second := order("device-a-press-1", "acct_1", 1250), order("device-b-press-1", "acct_1", 1250)
			if string(first.Payload) != string(second.Payload) {
				t.Fatal("test setup: the two orders must be byte-identical")
			}
			publish(t, ps, first)
			publish(t, ps, second)

			if got := effects(t, db); got != tc.wantEffects {
				t.Errorf("effect rows = %d, want %d", got, tc.wantEffects)
			}
		})
	}
}
