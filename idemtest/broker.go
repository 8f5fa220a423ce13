package idemtest

// The check's side of JetStream: its stream, its consumer instances, its publishes.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/faults"
)

// run is one consumer instance.
type run struct {
	cancel context.CancelFunc
	exited chan struct{}
	err    error // Run's result, once exited is closed
}

func (ck *check) startConsumer(ctx context.Context) error {
	cfg := ck.p.cfg
	if cfg.External != nil {
		cfg.External = lostResponse{h: cfg.External, shot: ck.before}
	}
	c, err := consumer.New(ck.p.inst.Observing(ck.out.observe), cfg)
	if err != nil {
		return fmt.Errorf("idemtest: %w", err)
	}
	rctx, cancel := context.WithCancel(faults.With(ctx, ck.fs))
	r := &run{cancel: cancel, exited: make(chan struct{})}
	go func() {
		defer close(r.exited)
		r.err = c.Run(rctx)
		if r.err == nil && rctx.Err() == nil {
			r.err = fmt.Errorf("consumer %s: Run returned before it was stopped", cfg.Name)
		}
	}()
	ck.run = r
	return nil
}

// stopConsumer stops the running instance and waits for it, at most one Timeout.
func (ck *check) stopConsumer() error {
	r := ck.run
	if r == nil {
		return nil
	}
	ck.run = nil
	r.cancel()
	select {
	case <-r.exited:
		if r.err != nil {
			return fmt.Errorf("idemtest: %w", r.err)
		}
		return nil
	case <-time.After(ck.p.timeout):
		return fmt.Errorf("idemtest: consumer %s did not stop within %s", ck.p.cfg.Name, ck.p.timeout)
	}
}

func (ck *check) createStream(ctx context.Context) error {
	name := ck.p.stream.Name
	_, err := ck.env.JS.Stream(ctx, name)
	switch {
	case err == nil:
		return fmt.Errorf("idemtest: stream %s already exists on the Env's server (Config.NATSURL); a check creates its own stream and deletes it at the end: give each Env that checks at the same time a server of its own, or its Case another Stream", name)
	case !errors.Is(err, jetstream.ErrStreamNotFound):
		return fmt.Errorf("idemtest: look up stream %s: %w", name, err)
	}
	if _, err := ck.p.inst.EnsureStream(ctx); err != nil {
		return fmt.Errorf("idemtest: %w", err)
	}
	return nil
}

func (ck *check) deleteStream(ctx context.Context) error {
	if err := ck.env.JS.DeleteStream(ctx, ck.p.stream.Name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("idemtest: delete stream %s: %w", ck.p.stream.Name, err)
	}
	return nil
}

// recreateDurable stops the consumer, deletes its durable JetStream consumer and
// starts a new instance, which creates the durable afresh with DeliverAll: the
// broker delivers every stream message again, under the same consumer name.
func (ck *check) recreateDurable(ctx context.Context) error {
	if err := ck.stopConsumer(); err != nil {
		return err
	}
	if err := ck.env.JS.DeleteConsumer(ctx, ck.p.stream.Name, ck.p.cfg.Name); err != nil {
		return fmt.Errorf("idemtest: delete durable consumer %s: %w", ck.p.cfg.Name, err)
	}
	return ck.startConsumer(ctx)
}

// publish sends one copy of the Case's message, as the relay would: the scoped key
// in Idempotency-Key and msgID in Nats-Msg-Id.
func (ck *check) publish(ctx context.Context, key string, payload []byte, msgID string) error {
	msg := nats.NewMsg(ck.p.msg.Subject)
	for k, v := range ck.p.msg.Headers {
		msg.Header.Set(k, v)
	}
	msg.Header.Set(idem.HeaderKey, key)
	msg.Header.Set(jetstream.MsgIDHeader, msgID)
	msg.Data = payload
	ack, err := ck.env.JS.PublishMsg(ctx, msg)
	if err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	if ack.Duplicate {
		return fmt.Errorf("publish: the broker folded Msg-Id %q as a duplicate", msgID)
	}
	return nil
}

// streamMsgs is how many messages the check's stream holds.
func (ck *check) streamMsgs(ctx context.Context) (uint64, error) {
	s, err := ck.env.JS.Stream(ctx, ck.p.stream.Name)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", ck.p.stream.Name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", ck.p.stream.Name, err)
	}
	return info.State.Msgs, nil
}

// count asks Case.Effects for key's count.
func (ck *check) count(ctx context.Context, key string) (int, error) {
	n, err := ck.p.effects(ctx, ck.env.Pool, key)
	if err != nil {
		return 0, fmt.Errorf("Case.Effects(%q): %w", key, err)
	}
	return n, nil
}
