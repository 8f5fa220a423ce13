package reconcile

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
)

// streamView answers, for one pass, whether the stream can still deliver a row to
// the consumers missing it. It reads the stream's state and each consumer's ack
// floor once per pass, and a message only when the row's sequence is in range.
type streamView struct {
	js   jetstream.JetStream
	name string

	loaded    bool
	stream    jetstream.Stream // nil: the stream does not exist
	state     jetstream.StreamState
	ackFloors map[string]*uint64 // nil entry: the durable consumer does not exist
}

func (s *streamView) load(ctx context.Context) error {
	if s.loaded {
		return nil
	}
	st, err := s.js.Stream(ctx, s.name)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		s.loaded = true
		return nil
	case err != nil:
		return fmt.Errorf("reconcile: stream %s: %w", s.name, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return fmt.Errorf("reconcile: stream %s: info: %w", s.name, err)
	}
	s.stream, s.state, s.loaded = st, info.State, true
	s.ackFloors = map[string]*uint64{}
	return nil
}

// ackFloor is the stream sequence up to which the named durable consumer has acked
// everything, or nil when it does not exist (a consumer recreates its durable
// consumer, which then delivers all the stream holds).
func (s *streamView) ackFloor(ctx context.Context, name string) (*uint64, error) {
	if f, ok := s.ackFloors[name]; ok {
		return f, nil
	}
	c, err := s.stream.Consumer(ctx, name)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		s.ackFloors[name] = nil
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reconcile: consumer %s: %w", name, err)
	}
	floor := c.CachedInfo().AckFloor.Stream
	s.ackFloors[name] = &floor
	return &floor, nil
}

// lost reports whether the stream can no longer deliver u to a consumer missing it,
// and why: the stream is gone; the sequence is below its first (expired, purged) or
// beyond its last (the stream was reset, or lost writes it had acknowledged); the
// message there is another one (the stream was recreated and reused the sequence)
// or none (deleted); or a missing consumer has acked past it without settling it (a
// durable consumer recreated to start later).
func (s *streamView) lost(ctx context.Context, u *unproven) (bool, string, error) {
	if err := s.load(ctx); err != nil {
		return false, "", err
	}
	if s.stream == nil {
		return true, "the stream does not exist", nil
	}
	seq := uint64(u.seq)
	switch {
	case seq < s.state.FirstSeq:
		return true, fmt.Sprintf("sequence %d is below the stream's first, %d", seq, s.state.FirstSeq), nil
	case seq > s.state.LastSeq:
		return true, fmt.Sprintf("sequence %d is beyond the stream's last, %d", seq, s.state.LastSeq), nil
	}
	m, err := s.stream.GetMsg(ctx, seq)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return true, fmt.Sprintf("sequence %d was deleted", seq), nil
	case err != nil:
		return false, "", fmt.Errorf("reconcile: stream %s: get %d: %w", s.name, seq, err)
	}
	if got := m.Header.Get(idem.HeaderMsgID); got != u.msgID {
		return true, fmt.Sprintf("sequence %d holds another message (%q): the stream was recreated", seq, got), nil
	}
	for _, c := range u.missing {
		floor, err := s.ackFloor(ctx, c.Name)
		if err != nil {
			return false, "", err
		}
		if floor != nil && *floor >= seq {
			return true, fmt.Sprintf("consumer %s acked past sequence %d without settling it", c.Name, seq), nil
		}
	}
	return false, "", nil
}
