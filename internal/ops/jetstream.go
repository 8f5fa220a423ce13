package ops

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// JetStreamStats is the stream's size and each durable consumer's lag.
type JetStreamStats struct {
	// URL is the server's, for the caller to fill in (ReadJetStream does not know it).
	URL    string `json:"url"`
	Stream string `json:"stream"`
	// At is when it was read, by this process's clock.
	At        time.Time     `json:"at"`
	Messages  uint64        `json:"messages"`
	Bytes     uint64        `json:"bytes"`
	FirstSeq  uint64        `json:"first_seq"`
	LastSeq   uint64        `json:"last_seq"`
	Consumers []ConsumerLag `json:"consumers"`
}

// ConsumerLag is one durable consumer's position.
type ConsumerLag struct {
	Name           string   `json:"name"`
	FilterSubjects []string `json:"filter_subjects"`
	// NumPending: messages in the stream not yet delivered to this consumer.
	NumPending uint64 `json:"num_pending"`
	// NumAckPending: delivered, not yet acknowledged (in flight, or its worker died
	// and the ack wait has not run out).
	NumAckPending int `json:"num_ack_pending"`
	// NumRedelivered: messages delivered more than once and still unacknowledged.
	NumRedelivered int `json:"num_redelivered"`
	// AckFloor is the stream sequence below which everything is acknowledged.
	AckFloor uint64 `json:"ack_floor"`
	// Lag is NumPending + NumAckPending: the messages the consumer has not
	// finished, whether it has fetched them or not.
	Lag uint64 `json:"lag"`
	// Delivered counts its deliveries so far, redeliveries included (the durable's
	// consumer sequence); two readings give its rate (LagHistory).
	Delivered uint64 `json:"delivered"`
}

// ReadJetStream reads stream's state and its consumers' lag. The stream is the
// application's topology, so the caller names it.
func ReadJetStream(ctx context.Context, js jetstream.JetStream, stream string) (*JetStreamStats, error) {
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("ops: stream %s: %w", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("ops: stream %s: %w", stream, err)
	}
	out := &JetStreamStats{
		Stream:    stream,
		At:        time.Now(),
		Messages:  info.State.Msgs,
		Bytes:     info.State.Bytes,
		FirstSeq:  info.State.FirstSeq,
		LastSeq:   info.State.LastSeq,
		Consumers: []ConsumerLag{},
	}
	list := st.ListConsumers(ctx)
	for ci := range list.Info() {
		filters := ci.Config.FilterSubjects
		if ci.Config.FilterSubject != "" {
			filters = append([]string{ci.Config.FilterSubject}, filters...)
		}
		out.Consumers = append(out.Consumers, ConsumerLag{
			Name:           ci.Name,
			FilterSubjects: filters,
			NumPending:     ci.NumPending,
			NumAckPending:  ci.NumAckPending,
			NumRedelivered: ci.NumRedelivered,
			AckFloor:       ci.AckFloor.Stream,
			Lag:            ci.NumPending + uint64(max(ci.NumAckPending, 0)),
			Delivered:      ci.Delivered.Consumer,
		})
	}
	if err := list.Err(); err != nil {
		return nil, fmt.Errorf("ops: consumers of %s: %w", stream, err)
	}
	return out, nil
}
