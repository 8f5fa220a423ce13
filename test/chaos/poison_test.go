package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/outbox"
)

// poison is a message that must end up in idem_dead_letters, with its key and
// payload as injected: published straight to JetStream, or (raw) written straight
// into idem_outbox.
type poison struct {
	why      string
	key      string
	payload  []byte
	subject  string // default idem.payments.charge
	mismatch bool   // the key of an intent with another payload
	mark     string // the Idem-Fault header (faults.MarkHeader): "panic" or "kill"
	raw      bool   // an outbox row written around Enqueue, not a published message

	// What its dead letter must say: the consumer that filed it, and words its
	// reason must contain (all of them).
	consumer string
	reason   []string
	// retrying: the run ends before this message can use up its attempts (the
	// panicking one in the short run); it must then still be retrying, charged
	// with the handler's panic, and without effect, or else a dead letter as above.
	retrying bool
}

// The sizes of the oversize messages.
const (
	// oversizeBodyBytes is an oversize press's body: valid JSON just under 1 MiB,
	// over what the broker can carry with the message's headers (max_payload, 1 MiB
	// by default, minus the 4 KiB the worker reserves for headers).
	oversizeBodyBytes = 1_048_500
	// rawOversizeBytes is a raw outbox row's payload: over max_payload itself.
	rawOversizeBytes = 1_100_000
)

// chargeOfSize is a valid charge payload of exactly size bytes: the account is
// prefix padded with x.
func chargeOfSize(prefix string, cents int64, size int) []byte {
	b := fmt.Appendf(nil, `{"account":%q,"amount_cents":%d}`, prefix, cents)
	pad := strings.Repeat("x", max(0, size-len(b)))
	return fmt.Appendf(nil, `{"account":%q,"amount_cents":%d}`, prefix+pad, cents)
}

func chargePayload(account string, cents int64) []byte {
	return fmt.Appendf(nil, `{"account":%q,"amount_cents":%d}`, account, cents)
}

// injectPoison publishes the poison messages, and copies of some intents' messages
// (same key, same payload, a fresh Nats-Msg-Id: the at-least-once repeat that a
// dead-letter replay or a publisher past the broker's de-duplication window makes),
// which the inbox must fold; and it writes outbox rows the broker can never take,
// which the relay must dead-letter without holding up the rows behind them.
func (r *run) injectPoison(ctx context.Context, rng *rand.Rand) ([]poison, map[string]bool, error) {
	// A key an intent already used, for "same key, different payload": wait until
	// some effect exists, so the poison is the second arrival and not the first.
	var key, account string
	var cents int64
	if err := r.waitFor(ctx, time.Minute, "a first effect to exist", func() (bool, string, error) {
		err := r.db.Pool.QueryRow(ctx, `SELECT idempotency_key, account, amount_cents FROM ledger_entries ORDER BY id LIMIT 1`).
			Scan(&key, &account, &cents)
		if err != nil {
			return false, "no ledger row yet (or the database is down)", nil
		}
		return true, "", nil
	}); err != nil {
		return nil, nil, err
	}
	tag := fmt.Sprintf("poison-%d", rng.Uint32())
	const (
		charges  = refapp.ChargeConsumer
		emails   = refapp.EmailConsumer
		noKey    = "missing Idempotency-Key header"
		badKey   = "malformed Idempotency-Key"
		refused  = "permanent handler error"
		mismatch = "fingerprint mismatch"
	)
	ps := []poison{
		{why: "no Idempotency-Key", payload: chargePayload(tag+"-nokey", 100), consumer: charges, reason: []string{noKey}},
		{why: "key longer than 255 bytes", key: strings.Repeat("k", idem.MaxKeyLen+1), payload: chargePayload(tag+"-longkey", 100), consumer: charges, reason: []string{badKey}},
		{why: "key with a DEL byte", key: "bad\x7fkey-" + tag, payload: chargePayload(tag+"-delkey", 100), consumer: charges, reason: []string{badKey}},
		{why: "payload is not JSON", key: idem.NewKey().String(), payload: []byte(`{"account": "` + tag + `-notjson", amount_cents: oops`), consumer: charges, reason: []string{refused}},
		{why: "payload with an unknown field", key: idem.NewKey().String(), payload: []byte(`{"account":"` + tag + `-unknown","amount_cents":100,"currency":"EUR"}`), consumer: charges, reason: []string{refused}},
		{why: "negative amount", key: idem.NewKey().String(), payload: chargePayload(tag+"-negative", -5), consumer: charges, reason: []string{refused}},
		{why: "same key as an intent, different payload", key: key, payload: chargePayload(account, cents+1), mismatch: true, consumer: charges, reason: []string{mismatch}},
		{why: "email without Idempotency-Key", subject: refapp.SubjectEmail, payload: []byte(`{"to":"` + tag + `@chaos.test","subject":"nokey","body":""}`), consumer: emails, reason: []string{noKey}},
		{why: "email to no address", subject: refapp.SubjectEmail, key: idem.NewKey().String(), payload: []byte(`{"to":"` + tag + ` not an address","subject":"bad","body":""}`), consumer: emails, reason: []string{refused}},
	}
	msgs := make([]*nats.Msg, len(ps))
	for i, p := range ps {
		msgs[i] = p.msg(fmt.Sprintf("chaos-%s-%d", tag, i))
	}
	if err := r.publishBurst(ctx, msgs); err != nil {
		return nil, nil, fmt.Errorf("publish poison: %w", err)
	}
	r.logf("published %d poison messages", len(ps))

	raw, err := r.insertOversizeRows(ctx, tag, r.cfg.rawOversize)
	if err != nil {
		return nil, nil, err
	}
	ps = append(ps, raw...)
	r.logf("wrote %d outbox rows of %d bytes straight into idem_outbox (around Enqueue)", len(raw), rawOversizeBytes)

	copies, copied, err := r.copiesOfIntents(ctx, rng, r.cfg.copies, tag)
	if err != nil {
		return nil, nil, err
	}
	if err := r.publishBurst(ctx, copies); err != nil {
		return nil, nil, fmt.Errorf("publish copies: %w", err)
	}
	r.logf("published %d copies of already-published intents", len(copies))
	return ps, copied, nil
}

// directCharge is a valid charge published straight to the stream, with a fresh
// key, around the marked messages: a batch-mate that must take effect exactly once
// whatever its batch-mates do.
type directCharge struct {
	key, account string
	cents        int64
}

// injectMarked publishes two valid charges with fresh keys, marked for the workers'
// consumer.marked-messages switch: one whose handler panics (Idem-Fault: panic) and
// one that SIGKILLs the worker that runs it (Idem-Fault: kill), every time. They go
// out in the middle of one burst of valid charges with fresh keys, published
// without waiting for each PubAck, so that the consumers take them in the same
// batches. Both marked messages must end as the charge consumer's dead letters;
// every charge of the burst must take effect exactly once.
func (r *run) injectMarked(ctx context.Context, rng *rand.Rand) ([]poison, []directCharge, error) {
	tag := fmt.Sprintf("marked-%d", rng.Uint32())
	ps := []poison{
		{why: "handler panics on it (Idem-Fault: panic)", key: idem.NewKey().String(), payload: chargePayload(tag+"-panic", 100),
			mark: "panic", consumer: refapp.ChargeConsumer, reason: []string{"max deliveries exceeded", "handler panicked"},
			retrying: !r.cfg.panicDeadLetter},
		{why: "crashes its worker every time (Idem-Fault: kill)", key: idem.NewKey().String(), payload: chargePayload(tag+"-kill", 100),
			mark: "kill", consumer: refapp.ChargeConsumer, reason: []string{"max deliveries exceeded", "without an outcome"}},
	}
	direct := make([]directCharge, r.cfg.burst)
	var burst []*nats.Msg
	for i := range direct {
		d := directCharge{key: idem.NewKey().String(), account: fmt.Sprintf("%s-direct-%03d", tag, i), cents: 100 + rng.Int64N(99_900)}
		direct[i] = d
		msg := nats.NewMsg(refapp.SubjectCharge)
		msg.Header.Set(idem.HeaderKey, d.key)
		msg.Header.Set(jetstream.MsgIDHeader, idem.MsgID(refapp.SubjectCharge, d.key))
		msg.Data = chargePayload(d.account, d.cents)
		burst = append(burst, msg)
		if i == len(direct)/2-1 || len(direct) < 2 && i == 0 {
			for j, p := range ps {
				burst = append(burst, p.msg(fmt.Sprintf("chaos-%s-%d", tag, j)))
			}
		}
	}
	if err := r.publishBurst(ctx, burst); err != nil {
		return nil, nil, fmt.Errorf("publish marked messages: %w", err)
	}
	r.logf("published the marked messages (panic %s, kill %s) in the middle of a burst of %d charges", ps[0].key, ps[1].key, len(direct))
	return ps, direct, nil
}

// msg is the poison as a message, with its own Nats-Msg-Id.
func (p poison) msg(msgID string) *nats.Msg {
	subject := refapp.SubjectCharge
	if p.subject != "" {
		subject = p.subject
	}
	msg := nats.NewMsg(subject)
	if p.key != "" {
		msg.Header.Set(idem.HeaderKey, p.key)
	}
	if p.mark != "" {
		msg.Header.Set(faults.MarkHeader, p.mark)
	}
	msg.Header.Set(jetstream.MsgIDHeader, msgID)
	msg.Data = p.payload
	return msg
}

// insertOversizeRows writes n outbox rows whose payload is over the broker's
// max_payload straight into idem_outbox, as an older version (or a hand-written
// INSERT) could have: Enqueue would refuse them. The relay must dead-letter them at
// once, and the rows behind them must flow on.
func (r *run) insertOversizeRows(ctx context.Context, tag string, n int) ([]poison, error) {
	if n == 0 {
		return nil, nil
	}
	var ps []poison
	var keys, msgIDs []string
	var payloads [][]byte
	for i := range n {
		p := poison{why: "outbox row over max_payload, written around Enqueue", key: idem.NewKey().String(), raw: true,
			payload:  chargeOfSize(fmt.Sprintf("%s-raw-oversize-%d-", tag, i), 100, rawOversizeBytes),
			consumer: outbox.RelayConsumer, reason: []string{"maximum payload"}}
		ps = append(ps, p)
		keys, msgIDs, payloads = append(keys, p.key), append(msgIDs, idem.MsgID(refapp.SubjectCharge, p.key)), append(payloads, p.payload)
	}
	// Idempotent, so that a retry after a commit whose answer was lost in an outage
	// writes nothing twice.
	err := r.retryDB(ctx, "insert oversize outbox rows", func(ctx context.Context) error {
		_, err := r.db.Pool.Exec(ctx, `
INSERT INTO idem_outbox (key, subject, msg_id, payload)
SELECT k, $2, m, p FROM unnest($1::text[], $3::text[], $4::bytea[]) AS t(k, m, p)
WHERE NOT EXISTS (SELECT 1 FROM idem_outbox WHERE key = ANY($1::text[]))`, keys, refapp.SubjectCharge, msgIDs, payloads)
		return err
	})
	return ps, err
}

// copiesOfIntents makes up to n copies of intents' published messages: same key,
// same payload, a fresh Nats-Msg-Id.
func (r *run) copiesOfIntents(ctx context.Context, rng *rand.Rand, n int, tag string) ([]*nats.Msg, map[string]bool, error) {
	type outboxRow struct {
		key, subject string
		payload      []byte
	}
	var published []outboxRow
	err := r.retryDB(ctx, "read outbox for copies", func(ctx context.Context) error {
		published = published[:0]
		rows, err := r.db.Pool.Query(ctx, `SELECT key, subject, payload FROM `+outboxView+` WHERE published_at IS NOT NULL ORDER BY id`)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var o outboxRow
			if err := rows.Scan(&o.key, &o.subject, &o.payload); err != nil {
				return err
			}
			published = append(published, o)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, nil, err
	}
	n = min(n, len(published))
	copied := map[string]bool{}
	var msgs []*nats.Msg
	for i, j := range rng.Perm(len(published))[:n] {
		o := published[j]
		copied[o.key] = true
		msg := nats.NewMsg(o.subject)
		msg.Header.Set(idem.HeaderKey, o.key)
		msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("chaos-copy-%s-%d", tag, i))
		msg.Data = o.payload
		msgs = append(msgs, msg)
	}
	return msgs, copied, nil
}

// publishBurst publishes msgs back to back without waiting for each PubAck (so
// that they reach the consumers together), then makes sure each was stored,
// publishing again one by one what did not get its PubAck. The Nats-Msg-Id makes
// the repeats safe: the broker keeps one.
func (r *run) publishBurst(ctx context.Context, msgs []*nats.Msg) error {
	futures := make([]jetstream.PubAckFuture, len(msgs))
	for i, m := range msgs {
		futures[i], _ = r.js.PublishMsgAsync(m) // a failure is published again below
	}
	wait, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	for i, f := range futures {
		ok := false
		if f != nil {
			select {
			case <-f.Ok():
				ok = true
			case <-f.Err():
			case <-wait.Done():
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !ok {
			if err := r.publish(ctx, msgs[i]); err != nil {
				return err
			}
		}
	}
	return nil
}

// publish publishes to JetStream, retrying through a nats-server restart. The
// Nats-Msg-Id makes the retries safe: the broker keeps one.
func (r *run) publish(ctx context.Context, msg *nats.Msg) error {
	var err error
	for attempt := 1; attempt <= 60; attempt++ {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err = r.js.PublishMsg(pctx, msg)
		cancel()
		if err == nil || ctx.Err() != nil {
			return err
		}
		select { // a publisher's back-off
		case <-time.After(250 * time.Millisecond):
		case <-ctx.Done():
		}
	}
	return err
}
