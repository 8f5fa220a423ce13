package idemtest

import (
	"context"
	"fmt"
	"strings"

	"github.com/idemkit/idem"
)

// step is one scenario of a check.
type step struct {
	name string
	run  func(ctx context.Context, ck *check) (Scenario, error)
}

// scenarios lists a check's scenarios in the order they run. They share one
// consumer and one stream, and build on each other: the crash scenarios use fresh
// keys (an effect that happened already cannot be interrupted), the later ones
// repeat the first key, whose effect must stay at one.
func scenarios(external bool) []step {
	if external {
		return []step{
			{FirstDelivery, firstDelivery},
			{LostResponse, lostResponseRetry},
			{CrashAfterPerform, crashAfterPerform},
			{Redelivery, redelivery},
			{Resent, resent},
			{ChangedPayload, changedPayload},
		}
	}
	return []step{
		{FirstDelivery, firstDelivery},
		{CrashBeforeCommit, crashBeforeCommit},
		{CrashAfterCommit, crashAfterCommit},
		{Redelivery, redelivery},
		{Resent, resent},
		{ChangedPayload, changedPayload},
	}
}

// honourKey is what every external failure says: toward a downstream, the kit can
// only show that a second attempt happened; whether it was folded is the
// downstream's doing.
const honourKey = "toward a downstream, exactly once holds only if the downstream honours the key: " +
	"pass e.Key (or e.KeyFor(purpose)) as its idempotency key (an Idempotency-Key header, a Message-ID) on every attempt, " +
	"to a downstream that executes a key once"

// firstDelivery publishes the Case's message once, as the relay would, and expects
// one effect. Every later scenario rests on it, so a failure halts the check.
func firstDelivery(ctx context.Context, ck *check) (Scenario, error) {
	key := ck.p.msg.Key
	s, err := ck.deliver(ctx, key, ck.p.payloads[key], idem.MsgID(ck.p.msg.Subject, key), "the first delivery to settle", nil,
		func(n int) string {
			if n == 0 {
				return "the delivery left no effect that Case.Effects counts"
			}
			return fmt.Sprintf("one delivery left %d effects: the handler makes more than one per message, or Case.Effects counts more than this key's", n)
		})
	if !s.OK {
		ck.halt = true
	}
	return s, err
}

// crashBeforeCommit: the handler ran, the transaction did not commit (the worker
// "died"), so JetStream redelivers and the handler runs again. Only what the
// handler wrote through its tx was rolled back.
func crashBeforeCommit(ctx context.Context, ck *check) (Scenario, error) {
	key := ck.p.keyBefore
	return ck.deliver(ctx, key, ck.p.payloads[key], idem.MsgID(ck.p.msg.Subject, key), "the redelivery after the rolled-back attempt to settle", ck.before,
		func(n int) string {
			if n == 0 {
				return "after the rollback, the redelivery left no effect"
			}
			return fmt.Sprintf("the effect survived the rollback of its transaction and ran again on the redelivery (%d effects): "+
				"the handler writes through something other than the pgx.Tx it is given (the pool, another connection, another system). "+
				"Exactly once holds only for effects written through that tx: write through tx, "+
				"or make the effect an External handler that passes the key downstream", n)
		})
}

// lostResponseRetry (External): the effect reached the downstream, then the
// handler failed (the response was lost); the lease is released and the retry
// performs the effect again with the same key.
func lostResponseRetry(ctx context.Context, ck *check) (Scenario, error) {
	key := ck.p.keyBefore
	return ck.deliver(ctx, key, ck.p.payloads[key], idem.MsgID(ck.p.msg.Subject, key), "the retry after the failed attempt to settle", ck.before,
		func(n int) string {
			if n == 0 {
				return "the retry after the failed attempt left no effect"
			}
			return fmt.Sprintf("the first attempt reached the downstream and then failed (a lost response); the retry performed the effect again "+
				"with the same key and the downstream executed it again (%d effects): %s", n, honourKey)
		})
}

// crashAfterCommit: the effect and the inbox claim committed, the ack never went
// out; JetStream redelivers after AckWait and the redelivery must fold.
func crashAfterCommit(ctx context.Context, ck *check) (Scenario, error) {
	key := ck.p.keyAfter
	return ck.deliver(ctx, key, ck.p.payloads[key], idem.MsgID(ck.p.msg.Subject, key), "the redelivery after the unacknowledged commit to settle", ck.after,
		func(n int) string {
			if n == 0 {
				return "the committed effect is missing"
			}
			return fmt.Sprintf("the redelivery of a message whose effect had committed ran the effect again (%d effects): the inbox claim did not fold it", n)
		})
}

// crashAfterPerform (External): the effect reached the downstream, the worker
// "died" before completing the lease; after AckWait and the lease's expiry
// another attempt takes the key over and performs the effect again, with the same
// key.
func crashAfterPerform(ctx context.Context, ck *check) (Scenario, error) {
	key := ck.p.keyAfter
	return ck.deliver(ctx, key, ck.p.payloads[key], idem.MsgID(ck.p.msg.Subject, key), "the takeover of the expired lease to settle", ck.after,
		func(n int) string {
			if n == 0 {
				return "the takeover left no effect"
			}
			return fmt.Sprintf("the worker died after the effect reached the downstream, before it was recorded; the takeover performed it again "+
				"with the same key and the downstream executed it again (%d effects): %s", n, honourKey)
		})
}

// redelivery deletes the durable consumer and creates it again: JetStream delivers
// every message of the stream again, the same stream sequences to the same
// consumer name, as after a consumer reset or a restore. Every key must keep the
// count it had.
func redelivery(ctx context.Context, ck *check) (Scenario, error) {
	msgs, err := ck.streamMsgs(ctx)
	if err != nil {
		return Scenario{}, err
	}
	base := ck.out.snapshot()
	if err := ck.recreateDurable(ctx); err != nil {
		return Scenario{}, err
	}
	waitFail, err := ck.settled(ctx, base, int(msgs), fmt.Sprintf("the %d stream messages to be delivered again and settle", msgs))
	if err != nil {
		return Scenario{}, err
	}
	key := ck.p.msg.Key
	n, err := ck.count(ctx, key)
	if err != nil {
		return Scenario{}, err
	}
	s := Scenario{Key: key, Effects: n, Want: 1, OK: waitFail == "" && n == 1}
	var problems []string
	if waitFail != "" {
		problems = append(problems, waitFail)
	}
	if n != 1 {
		problems = append(problems, fmt.Sprintf("key %s: %d effects", key, n))
	}
	for _, k := range []string{ck.p.keyBefore, ck.p.keyAfter} {
		before, ok := ck.counted[k]
		if !ok {
			continue
		}
		now, err := ck.count(ctx, k)
		if err != nil {
			return Scenario{}, err
		}
		if now != before {
			s.OK = false
			problems = append(problems, fmt.Sprintf("key %s (of an earlier scenario): %d effects, %d before", k, now, before))
		}
	}
	if !s.OK {
		s.Detail = "the broker delivered the same stream messages again and they ran the effect again: " + strings.Join(problems, "; ") +
			"; outcomes " + ck.out.since(base).String()
	}
	ck.counted[key] = n
	return s, nil
}

// resent publishes the first key's message again under a new Nats-Msg-Id, as the
// relay does after the broker's duplicate window or a producer retrying: the
// broker stores a second message, and the inbox must fold it by key.
func resent(ctx context.Context, ck *check) (Scenario, error) {
	key := ck.p.msg.Key
	return ck.deliver(ctx, key, ck.p.payloads[key], idem.MsgID(ck.p.msg.Subject, key)+" resent", "the re-sent copy to settle", nil,
		func(n int) string {
			return fmt.Sprintf("a copy re-sent with the same key and payload under a new Nats-Msg-Id (%d effects): the inbox did not fold it by key", n)
		})
}

// changedPayload publishes the first key with another payload: a producer bug
// (two intents under one key), which must be dead-lettered with a fingerprint
// mismatch, never run and never merged silently.
func changedPayload(ctx context.Context, ck *check) (Scenario, error) {
	key := ck.p.msg.Key
	return ck.deliver(ctx, key, ck.p.changed, idem.MsgID(ck.p.msg.Subject, key)+" changed", "the changed copy to settle", nil,
		func(n int) string {
			return fmt.Sprintf("a message with the same key and a different payload changed the effects (%d)", n)
		},
		func(ctx context.Context) (string, error) {
			reasons, err := ck.deadLetters(ctx, key)
			if err != nil {
				return "", err
			}
			for _, r := range reasons {
				if strings.HasPrefix(r, mismatchPrefix) {
					return "", nil
				}
			}
			return "it was not dead-lettered (want a row in idem_dead_letters for this consumer and key with a \"" + mismatchPrefix + "\" reason)", nil
		})
}

// deliver publishes one copy of key's message and waits until one delivery
// settled and the consumer drained; if crash is set it must have fired on the way.
// It judges the scenario by key's count (exactly one), describing a wrong count
// with why, and by each of also, which returns a problem or "".
func (ck *check) deliver(ctx context.Context, key string, payload []byte, msgID, what string, crash *shot, why func(n int) string,
	also ...func(ctx context.Context) (string, error)) (Scenario, error) {
	base := ck.out.snapshot()
	if err := ck.publish(ctx, key, payload, msgID); err != nil {
		return Scenario{}, err
	}
	// The crash is not a wait condition: the first settled delivery comes after
	// it in every run but one whose handler never got that far (it failed, it was
	// dead-lettered), and that one must not wait out the timeout.
	waitFail, err := ck.settled(ctx, base, 1, what)
	if err != nil {
		return Scenario{}, err
	}
	n, err := ck.count(ctx, key)
	if err != nil {
		return Scenario{}, err
	}
	ck.counted[key] = n
	s := Scenario{Key: key, Effects: n, Want: 1, OK: waitFail == "" && n == 1}
	var problems []string
	if waitFail != "" {
		problems = append(problems, waitFail)
	}
	if crash != nil && !crash.hasFired() {
		s.OK = false
		problems = append(problems, "the simulated crash never happened: the handler did not get that far for key "+key)
	}
	if n != 1 {
		problems = append(problems, why(n))
	}
	for _, check := range also {
		problem, err := check(ctx)
		if err != nil {
			return Scenario{}, err
		}
		if problem != "" {
			s.OK = false
			problems = append(problems, problem)
		}
	}
	if s.OK {
		return s, nil
	}
	reasons, err := ck.deadLetters(ctx, key)
	if err != nil {
		return Scenario{}, err
	}
	if len(reasons) > 0 {
		problems = append(problems, "dead-lettered: "+strings.Join(reasons, " | "))
	}
	s.Detail = strings.Join(problems, "; ") + "; outcomes " + ck.out.since(base).String()
	return s, nil
}
