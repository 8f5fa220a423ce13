package reconcile

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/installation"
)

// streamView answers, for one batch, whether the stream can still deliver a row to
// the consumers missing it. It reads the stream's state and each consumer's ack
// floor once, and a message only when the row's sequence is in range.
type streamView struct {
	js   jetstream.JetStream
	name string
	// installation is the reconciler's own old-style name (installation.Of), and
	// own reads its row (token and epoch): a durable consumer that belongs to
	// another installation, or that a later binding of a copy of this database
	// took, says nothing about this installation's consumer of the same name.
	installation string
	own          func(ctx context.Context) (installation.State, error)
	state        *installation.State // read with the first durable
	// anyInstallation is the negative control (faults.AnyInstallation): every
	// durable's acks are read as this installation's.
	anyInstallation bool

	loaded    bool
	stream    jetstream.Stream // nil: the stream does not exist
	info      *jetstream.StreamInfo
	ackFloors map[string]*uint64 // nil entry: no durable consumer of this installation
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
	s.stream, s.info, s.loaded = st, info, true
	s.ackFloors = map[string]*uint64{}
	return nil
}

// maxAge is the stream's MaxAge (0: unlimited); known is false when the stream
// does not exist.
func (s *streamView) maxAge(ctx context.Context) (maxAge time.Duration, known bool, err error) {
	if err := s.load(ctx); err != nil {
		return 0, false, err
	}
	if s.stream == nil {
		return 0, false, nil
	}
	return s.info.Config.MaxAge, true, nil
}

// ackFloor is the stream sequence up to which the named durable consumer has acked
// everything, or nil when this installation has no such durable consumer: it does
// not exist (a consumer recreates its durable consumer, which then delivers all
// the stream holds), or it belongs to another installation, whose acks prove
// nothing here.
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
	info := c.CachedInfo()
	owns, err := s.owns(ctx, installation.FromMetadata(info.Config.Metadata))
	if err != nil {
		return nil, err
	}
	if !owns && !s.anyInstallation {
		s.ackFloors[name] = nil
		return nil, nil
	}
	floor := info.AckFloor.Stream
	s.ackFloors[name] = &floor
	return &floor, nil
}

// owns reports whether a durable that recorded r is this installation's. The row
// is read after the durable, and again when the durable's epoch is ahead of it: a
// binder of this database may have bumped the epoch in between.
func (s *streamView) owns(ctx context.Context, r installation.Recorded) (bool, error) {
	for fresh := s.state == nil; ; fresh = true {
		if fresh {
			st, err := s.own(ctx)
			if err != nil {
				return false, fmt.Errorf("reconcile: %w", err)
			}
			s.state = &st
		}
		if installation.Owns(*s.state, s.installation, r) || fresh {
			return installation.Owns(*s.state, s.installation, r), nil
		}
	}
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
	case seq < s.info.State.FirstSeq:
		return true, fmt.Sprintf("sequence %d is below the stream's first, %d", seq, s.info.State.FirstSeq), nil
	case seq > s.info.State.LastSeq:
		return true, fmt.Sprintf("sequence %d is beyond the stream's last, %d", seq, s.info.State.LastSeq), nil
	}
	msgID, found, err := s.msgIDAt(ctx, seq)
	switch {
	case err != nil:
		return false, "", fmt.Errorf("reconcile: stream %s: get %d: %w", s.name, seq, err)
	case !found:
		return true, fmt.Sprintf("sequence %d was deleted", seq), nil
	case msgID != u.msgID:
		return true, fmt.Sprintf("sequence %d holds another message (%q): the stream was recreated", seq, msgID), nil
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

// msgIDAt reads the Nats-Msg-Id of the message at seq from the stream's leader.
// nats.go's GetMsg uses a direct get when the stream allows it, which any replica
// (or a mirror) answers: a lagging one says "not found" for a message the stream
// holds. So a "not found" from a direct get is asked again of the leader.
func (s *streamView) msgIDAt(ctx context.Context, seq uint64) (msgID string, found bool, err error) {
	m, err := s.stream.GetMsg(ctx, seq)
	switch {
	case err == nil:
		return m.Header.Get(idem.HeaderMsgID), true, nil
	case !errors.Is(err, jetstream.ErrMsgNotFound):
		return "", false, err
	case !s.info.Config.AllowDirect:
		return "", false, nil
	}
	return s.leaderMsgID(ctx, seq)
}

// leaderMsgID is msgIDAt through the JetStream API's (not direct) message get.
func (s *streamView) leaderMsgID(ctx context.Context, seq uint64) (msgID string, found bool, err error) {
	prefix := s.js.Options().APIPrefix
	if prefix == "" {
		prefix = jetstream.DefaultAPIPrefix
	}
	req, err := json.Marshal(map[string]uint64{"seq": seq})
	if err != nil {
		return "", false, err
	}
	reply, err := s.js.Conn().RequestWithContext(ctx, prefix+"STREAM.MSG.GET."+s.name, req)
	if err != nil {
		return "", false, err
	}
	var resp struct {
		Message *struct {
			Header []byte `json:"hdrs"`
		} `json:"message"`
		Error *jetstream.APIError `json:"error"`
	}
	if err := json.Unmarshal(reply.Data, &resp); err != nil {
		return "", false, err
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		return "", false, nil
	case resp.Error != nil:
		return "", false, resp.Error
	case resp.Message == nil:
		return "", false, jetstream.ErrInvalidJetStreamResponse
	}
	if len(resp.Message.Header) == 0 {
		return "", true, nil
	}
	h, err := nats.DecodeHeadersMsg(resp.Message.Header)
	if err != nil {
		return "", false, err
	}
	return h.Get(idem.HeaderMsgID), true, nil
}
