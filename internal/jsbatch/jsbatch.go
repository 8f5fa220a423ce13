// Package jsbatch sends JetStream atomic batches (nats-server 2.12 and later): a
// batch's messages are stored all at once or not at all, with one PubAck for the
// batch. It is the wire protocol only; what to do with a refusal is the caller's
// (worker.RelayConfig.AtomicPublish, and the bench's publish-batch scenario).
package jsbatch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
)

// The headers of an atomic batch.
const (
	HeaderID     = "Nats-Batch-Id"
	HeaderSeq    = "Nats-Batch-Sequence"
	HeaderCommit = "Nats-Batch-Commit"
)

// MaxBatch is the most messages nats-server takes in one batch by default (its
// jetstream max_batch_size).
const MaxBatch = 1000

// Error codes of a refused batch.
const (
	CodeDisabled  = 10174 // the stream does not allow atomic publish
	CodeTooLarge  = 10199 // the batch is over the broker's max_batch_size
	CodeDuplicate = 10201 // the batch holds a Msg-Id the stream already has
)

// Ack is the broker's answer to a stored batch: the stream, the sequence of the
// batch's last message, and how many messages it stored. A batch is stored
// contiguously, so message i of n is at Seq - n + 1 + i.
type Ack struct {
	Stream string
	Seq    uint64
}

// Refused is a batch the broker answered but did not store.
type Refused struct {
	Code        int
	Description string
}

func (e Refused) Error() string {
	return fmt.Sprintf("atomic batch refused: %s (err_code %d)", e.Description, e.Code)
}

// pubAck is the wire form of the commit message's reply.
type pubAck struct {
	Stream    string `json:"stream"`
	Seq       uint64 `json:"seq"`
	BatchID   string `json:"batch"`
	BatchSize int    `json:"count"`
	Error     *struct {
		ErrCode     int    `json:"err_code"`
		Description string `json:"description"`
	} `json:"error"`
}

// Publish sends msgs as one atomic batch and waits, until ctx is done, for its
// PubAck. It sets the batch headers on msgs (Strip removes them). Every message
// but the last goes without a reply; the last carries the commit. A refusal is a
// Refused error; a broker that does not know atomic batches (it stores each
// message as a plain publish and answers the last alone) is reported as Refused
// with CodeDisabled. Other errors are nats.go's (nats.ErrNoResponders when no
// stream takes the subject, the context's when no PubAck came in time).
func Publish(ctx context.Context, nc *nats.Conn, msgs []*nats.Msg) (Ack, error) {
	if len(msgs) == 0 {
		return Ack{}, errors.New("jsbatch: an empty batch")
	}
	id := uuid.NewString()
	last := len(msgs) - 1
	for i, m := range msgs {
		m.Header.Set(HeaderID, id)
		m.Header.Set(HeaderSeq, strconv.Itoa(i+1))
		if i < last {
			if err := nc.PublishMsg(m); err != nil {
				return Ack{}, err
			}
		}
	}
	msgs[last].Header.Set(HeaderCommit, "1")
	reply, err := nc.RequestMsgWithContext(ctx, msgs[last])
	if err != nil {
		return Ack{}, err
	}
	var ack pubAck
	if err := json.Unmarshal(reply.Data, &ack); err != nil {
		return Ack{}, fmt.Errorf("jsbatch: PubAck %q: %w", reply.Data, err)
	}
	if ack.Error != nil {
		return Ack{}, Refused{Code: ack.Error.ErrCode, Description: ack.Error.Description}
	}
	if ack.BatchSize != len(msgs) || ack.BatchID != id {
		return Ack{}, Refused{Code: CodeDisabled,
			Description: fmt.Sprintf("the PubAck counts %d messages of batch %q, want %d of %q (a broker before nats-server 2.12?)", ack.BatchSize, ack.BatchID, len(msgs), id)}
	}
	return Ack{Stream: ack.Stream, Seq: ack.Seq}, nil
}

// Strip removes what Publish set, so msgs can be published one by one.
func Strip(msgs []*nats.Msg) {
	for _, m := range msgs {
		m.Header.Del(HeaderID)
		m.Header.Del(HeaderSeq)
		m.Header.Del(HeaderCommit)
	}
}
