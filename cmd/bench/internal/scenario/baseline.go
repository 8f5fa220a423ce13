package scenario

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// The baselines (naive, handwritten-inbox) drain a pre-filled stream the way a
// team would without idem: a plain JetStream pull consumer and a handler per
// message.

// sqlLedgerOne is the baselines' effect: one ledger row.
const sqlLedgerOne = `INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ($1, $2, $3)`

// baselineMaxAckPending is the bound the idem consumer runs with by default, so
// the baselines get the same.
const baselineMaxAckPending = 1000

// handleFunc handles one message with the database; an error means nak.
type handleFunc func(ctx context.Context, pool *pgxpool.Pool, key string, c refapp.Charge) error

// baseline is one baseline's handler and what its ledger must show.
type baseline struct {
	name   string
	handle handleFunc
	// atLeastOnce: a redelivery may charge again, which is reported, not failed.
	atLeastOnce bool
}

// run drains a pre-filled stream with a plain JetStream pull consumer (Consume)
// feeding Workers goroutines; each decodes the charge, runs handle and acks. A
// message whose handler fails is naked for redelivery.
func (b baseline) run(ctx context.Context, env *benchenv.Env, h *Harness) ([]report.Result, error) {
	n, workers, log := h.Opts.N, h.Opts.Workers, h.Log
	intents := makeIntents(n, 0)
	if err := prefill(ctx, env, b.name, intents); err != nil {
		return nil, fmt.Errorf("%s: %w", b.name, err)
	}
	durable := "bench-" + b.name
	cons, err := env.JS.CreateOrUpdateConsumer(ctx, refapp.StreamName, jetstream.ConsumerConfig{
		Durable:       durable,
		FilterSubject: refapp.SubjectCharge,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       30 * time.Second,
		MaxAckPending: baselineMaxAckPending,
	})
	if err != nil {
		return nil, fmt.Errorf("%s: create consumer: %w", b.name, err)
	}

	acked := newCounter(n)
	var failures atomic.Int64
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go progress(runCtx, b.name, "acked", n, acked.Load)

	meter, err := env.StartMeter(ctx)
	if err != nil {
		return nil, err
	}
	work := make(chan jetstream.Msg, workers)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				var m jetstream.Msg
				select {
				case <-runCtx.Done():
					return
				case m = <-work:
				}
				c, err := refapp.DecodeCharge(m.Data())
				if err != nil {
					log.Error("poison message", "scenario", b.name, "err", err)
					_ = m.Term()
					continue
				}
				if err := b.handle(runCtx, env.Pool, m.Headers().Get(idem.HeaderKey), c); err != nil {
					if runCtx.Err() == nil {
						failures.Add(1)
						log.Error("handler failed; nak", "scenario", b.name, "err", err)
					}
					_ = m.Nak()
					continue
				}
				if err := m.Ack(); err != nil {
					log.Error("ack failed", "scenario", b.name, "err", err)
				}
				acked.Add(1)
			}
		}()
	}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		select {
		case work <- m:
		case <-runCtx.Done():
		}
	}, jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
		log.Warn("pull error", "scenario", b.name, "err", err)
	}))
	if err != nil {
		return nil, fmt.Errorf("%s: consume: %w", b.name, err)
	}
	waitErr := acked.wait(ctx, h.Opts.Timeout, "acked")
	meas, merr := meter.Stop(ctx)
	cc.Stop()
	cancel()
	wg.Wait()
	if waitErr != nil {
		return nil, fmt.Errorf("%s: %w", b.name, waitErr)
	}
	if merr != nil {
		return nil, merr
	}

	res := report.Result{Scenario: b.name, Row: b.name, N: n, Messages: n,
		Config: map[string]any{"workers": workers, "max_ack_pending": baselineMaxAckPending}}
	res.SetMeasurement(meas, n)
	if _, err := waitDrained(ctx, env, durable, 10*time.Second); err != nil {
		res.Notes = append(res.Notes, err.Error())
	}
	if f := failures.Load(); f > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d handler failures were naked and redelivered", f))
	}
	l, err := readLedger(ctx, env)
	if err != nil {
		return nil, err
	}
	res.Ledger = &l
	if res.Verified, err = b.verify(l, n); err != nil {
		return nil, fmt.Errorf("%s: %w", b.name, err)
	}
	return []report.Result{res}, nil
}

// verify checks the ledger after n intents: one row per key, but for an
// at-least-once baseline, whose extra rows (double charges) are reported.
func (b baseline) verify(l report.Ledger, n int) (string, error) {
	switch {
	case l.Keys != n:
		return "", fmt.Errorf("VERIFY FAILED: ledger has %d distinct keys, want %d", l.Keys, n)
	case l.Rows != n && b.atLeastOnce:
		// Not a benchmark failure, but it must be visible.
		return fmt.Sprintf("at-least-once: %d double charges", l.Rows-n), nil
	case l.Rows != n:
		return "", fmt.Errorf("VERIFY FAILED: ledger has %d rows, want %d", l.Rows, n)
	}
	return "ok", nil
}
