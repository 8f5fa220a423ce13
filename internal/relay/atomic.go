package relay

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/jsbatch"
)

// Atomic batch publish (Config.AtomicPublish): a batch's messages go to the
// stream as one JetStream atomic batch. Every message but the last is published
// without a reply; the last carries Nats-Batch-Commit and gets one PubAck for the
// whole batch, which the stream stores at once or not at all. With fsync on every
// write that is one fsync per batch instead of one per message (BENCHMARKS.md,
// publish-batch, has the measured difference).
//
// The broker refuses a whole batch that holds a Msg-Id it already stored, where
// a plain publish would be answered "duplicate". A relay meets that after a crash
// between publishing a batch and marking it published: such a batch is published
// again message by message, and the Msg-Id dedupe folds what is stored. Every
// other refusal of one batch (a row whose subject another stream stores, say) is
// answered the same way, so each row meets the broker's verdict on it alone, as
// without AtomicPublish.

// MaxAtomicBatch is the most messages nats-server takes in one atomic batch by
// default (its jetstream max_batch_size): Config.BatchSize may not exceed it
// with AtomicPublish.
const MaxAtomicBatch = jsbatch.MaxBatch

// turnsOff reports whether refused says no atomic batch will work here: the stream
// does not allow them (or the broker does not know them), or its max_batch_size is
// below BatchSize. Any other refusal (a Msg-Id the stream has, a row of the batch
// the stream cannot take) concerns that batch only.
func turnsOff(refused error) bool {
	var r jsbatch.Refused
	return errors.As(refused, &r) && (r.Code == jsbatch.CodeDisabled || r.Code == jsbatch.CodeTooLarge)
}

// publishAtomic sends msgs (rows[i]'s message is msgs[i]) as one atomic batch and
// waits for its PubAck, up to PublishTimeout. On success every row is acked, at
// the sequences the batch took: it is stored contiguously, so row i is at
// seq - len + 1 + i. What the caller should publish message by message instead is
// returned as refused: a batch the broker refused (jsbatch.Refused), or one no
// stream answered, so that each row meets the broker's verdict on it alone. A
// batch lost on the way (no PubAck in time, the connection dropped) fails every
// row, as missing PubAcks do.
func (r *Relay) publishAtomic(ctx context.Context, rows []outboxRow, msgs []*nats.Msg) (ok acked, failed map[int64]error, refused error) {
	failed = map[int64]error{}
	failAll := func(err error) (acked, map[int64]error, error) {
		for _, o := range rows {
			failed[o.id] = err
		}
		return acked{}, failed, nil
	}
	if r.stream != "" {
		for _, m := range msgs {
			// Checked for the whole batch before anything is stored.
			m.Header.Set(jetstream.ExpectedStreamHeader, r.stream)
		}
	}
	deadline, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	ack, err := jsbatch.Publish(deadline, r.js.Conn(), msgs)
	var rf jsbatch.Refused
	switch {
	case errors.As(err, &rf):
		return acked{}, nil, err
	case errors.Is(err, nats.ErrNoResponders):
		return acked{}, nil, fmt.Errorf("atomic batch: no stream answered: %w", err)
	case errors.Is(err, context.DeadlineExceeded):
		return failAll(fmt.Errorf("no PubAck for the atomic batch within PublishTimeout %s", r.cfg.PublishTimeout))
	case err != nil:
		return failAll(err)
	}
	if r.stream != "" && ack.Stream != r.stream {
		return failAll(fmt.Errorf("atomic batch stored by stream %s, want %s", ack.Stream, r.stream))
	}
	first := int64(ack.Seq) - int64(len(msgs)-1)
	for i, o := range rows {
		ok.ids = append(ok.ids, o.id)
		ok.streams = append(ok.streams, ack.Stream)
		ok.seqs = append(ok.seqs, first+int64(i))
	}
	return ok, failed, nil
}

// withoutBatchHeaders strips what publishAtomic set, for the message-by-message
// publish of a refused batch (which sets the expected stream its own way).
func withoutBatchHeaders(msgs []*nats.Msg) {
	jsbatch.Strip(msgs)
	for _, m := range msgs {
		m.Header.Del(jetstream.ExpectedStreamHeader)
	}
}
