package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Atomic batch publish (RelayConfig.AtomicPublish): a batch's messages go to the
// stream as one JetStream atomic batch. Every message but the last is published
// without a reply; the last carries Nats-Batch-Commit and gets one PubAck for the
// whole batch, which the stream stores at once or not at all. With fsync on every
// write that is one fsync per batch instead of one per message: 97,000 against
// 5,100 messages/s in `go run ./cmd/bench -scenarios publish-batch` (BENCHMARKS.md).
//
// The broker refuses a whole batch that holds a Msg-Id it already stored, where
// a plain publish would be answered "duplicate". A relay meets that after a crash
// between publishing a batch and marking it published: such a batch is published
// again message by message, and the Msg-Id dedupe folds what is stored. Every
// other refusal of one batch (a row whose subject another stream stores, say) is
// answered the same way, so each row meets the broker's verdict on it alone, as
// without AtomicPublish.

// The headers of JetStream's atomic batch publish (nats-server 2.12 and later).
const (
	headerBatchID     = "Nats-Batch-Id"
	headerBatchSeq    = "Nats-Batch-Sequence"
	headerBatchCommit = "Nats-Batch-Commit"
)

// MaxAtomicBatch is the most messages nats-server takes in one atomic batch by
// default (its jetstream max_batch_size): RelayConfig.BatchSize may not exceed it
// with AtomicPublish.
const MaxAtomicBatch = 1000

// The broker's error codes for a refused batch that say atomic batches will not
// work on this stream at all: the relay turns AtomicPublish off. Any other refusal
// (a Msg-Id the stream has, err_code 10201, or a row of the batch the stream
// cannot take) concerns this batch only, which is published message by message.
const (
	errCodeAtomicDisabled = 10174 // the stream does not allow atomic publish
	errCodeAtomicTooLarge = 10199 // the broker's max_batch_size is below BatchSize
)

// batchPubAck is the broker's answer to a batch's commit message: the stream, the
// sequence of the batch's last message, and how many messages it stored.
type batchPubAck struct {
	Stream    string `json:"stream"`
	Seq       uint64 `json:"seq"`
	BatchID   string `json:"batch"`
	BatchSize int    `json:"count"`
	Error     *struct {
		ErrCode     int    `json:"err_code"`
		Description string `json:"description"`
	} `json:"error"`
}

// errBatchRefused is a batch the broker answered but did not store.
type errBatchRefused struct {
	code        int
	description string
}

func (e errBatchRefused) Error() string {
	return fmt.Sprintf("atomic batch refused: %s (err_code %d)", e.description, e.code)
}

// turnsOff reports whether refused says no atomic batch will work here.
func turnsOff(refused error) bool {
	var br errBatchRefused
	return errors.As(refused, &br) && (br.code == errCodeAtomicDisabled || br.code == errCodeAtomicTooLarge)
}

// publishAtomic sends msgs (rows[i]'s message is msgs[i]) as one atomic batch and
// waits for its PubAck, up to PublishTimeout. On success every row is acked, at
// the sequences the batch took: it is stored contiguously, so row i is at
// seq - len + 1 + i. What the caller should publish message by message instead is
// returned as refused: a batch the broker refused (errBatchRefused), or one no
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
	nc := r.js.Conn()
	id := uuid.NewString()
	last := len(msgs) - 1
	for i, m := range msgs {
		m.Header.Set(headerBatchID, id)
		m.Header.Set(headerBatchSeq, strconv.Itoa(i+1))
		if r.cfg.Stream != "" {
			// Checked for the whole batch before anything is stored.
			m.Header.Set(jetstream.ExpectedStreamHeader, r.cfg.Stream)
		}
		if i < last {
			if err := nc.PublishMsg(m); err != nil {
				return failAll(err)
			}
		}
	}
	msgs[last].Header.Set(headerBatchCommit, "1")
	deadline, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	reply, err := nc.RequestMsgWithContext(deadline, msgs[last])
	if errors.Is(err, nats.ErrNoResponders) {
		return acked{}, nil, fmt.Errorf("atomic batch: no stream answered: %w", err)
	}
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("no PubAck for the atomic batch within PublishTimeout %s", r.cfg.PublishTimeout)
		}
		return failAll(err)
	}
	var ack batchPubAck
	if err := json.Unmarshal(reply.Data, &ack); err != nil {
		return failAll(fmt.Errorf("atomic batch: PubAck %q: %w", reply.Data, err))
	}
	if ack.Error != nil {
		return acked{}, nil, errBatchRefused{code: ack.Error.ErrCode, description: ack.Error.Description}
	}
	if ack.BatchSize != len(msgs) || ack.BatchID != id {
		// A broker that does not know atomic batches stores each message as a
		// plain publish and answers the last alone: nothing says where the others
		// went. Publishing the batch again message by message finds out (they are
		// duplicates by Msg-Id now).
		return acked{}, nil, errBatchRefused{code: errCodeAtomicDisabled,
			description: fmt.Sprintf("the PubAck counts %d messages of batch %q, want %d of %q (a broker before nats-server 2.12?)", ack.BatchSize, ack.BatchID, len(msgs), id)}
	}
	if r.cfg.Stream != "" && ack.Stream != r.cfg.Stream {
		return failAll(fmt.Errorf("atomic batch stored by stream %s, want %s", ack.Stream, r.cfg.Stream))
	}
	first := int64(ack.Seq) - int64(last)
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
	for _, m := range msgs {
		m.Header.Del(headerBatchID)
		m.Header.Del(headerBatchSeq)
		m.Header.Del(headerBatchCommit)
		m.Header.Del(jetstream.ExpectedStreamHeader)
	}
}
