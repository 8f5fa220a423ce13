package worker

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/relay"
)

// chooseRelay decides, at Start, which relay publishes the outbox (see
// RelayConfig.Mode), says which and why, and builds the log relay when it is that
// one. The polling relay runs in either case: beside the log relay it publishes
// the rows that are its own then (handed over, re-driven, or written before).
func (w *Worker) chooseRelay(ctx context.Context) error {
	if w.relay == nil {
		return nil
	}
	mode, why, err := w.relayMode(ctx)
	if err != nil {
		return err
	}
	if mode == relay.ModePoll {
		w.log.InfoContext(ctx, "relay: polling relay (SELECT ... FOR UPDATE SKIP LOCKED): "+why, "relay", relay.ModePoll)
		// Rows a log relay left unpublished, from an earlier start, are the
		// polling relay's now; its slot, if no relay reads it, is dropped.
		c, err := relay.LogCapability(ctx, w.pool, w.inst.Schema())
		if err != nil {
			return fmt.Errorf("worker: %w", err)
		}
		n, err := relay.UsePolling(ctx, w.pool, parts.Of(w.inst).Store, c.Database, w.inst.Schema())
		if err != nil {
			return fmt.Errorf("worker: %w", err)
		}
		if n > 0 {
			w.log.WarnContext(ctx, "relay: rows the log relay never published go to the polling relay", "rows", n)
		}
		return nil
	}
	cfg := w.cfg.Relay.config(w.cfg)
	cfg.BehindLog = true
	if w.relay, err = relay.New(parts.Of(w.inst), cfg); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	if w.logRelay, err = relay.NewLog(parts.Of(w.inst), w.cfg.Relay.config(w.cfg), w.relay.Wake); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	w.log.InfoContext(ctx, "relay: log relay (reads committed outbox rows from a logical replication slot): "+why, "relay", relay.ModeLog)
	return nil
}

// relayMode is the relay RelayConfig.Mode asks for and the server allows.
func (w *Worker) relayMode(ctx context.Context) (relay.Mode, string, error) {
	r := w.cfg.Relay
	switch {
	case r.Mode == relayPoll:
		return relay.ModePoll, `Relay.Mode is "poll"`, nil
	case len(r.OrderedSubjects) > 0:
		return relay.ModePoll, "OrderedSubjects are relayed in order by the polling relay", nil
	case r.AtomicPublish:
		return relay.ModePoll, "AtomicPublish batches are published by the polling relay", nil
	}
	c, err := relay.LogCapability(ctx, w.pool, w.inst.Schema())
	if err != nil {
		return "", "", fmt.Errorf("worker: %w", err)
	}
	if c.Mode == relay.ModeLog {
		return relay.ModeLog, c.Why, nil
	}
	if r.Mode == relayLog {
		return "", "", errors.New(`worker: refusing to start: Relay.Mode is "log", but ` + c.Why)
	}
	return relay.ModePoll, c.Why, nil
}
