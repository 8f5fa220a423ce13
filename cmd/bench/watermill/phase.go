package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// measurePhase starts the Watermill application on e, sends n requests (rate 0:
// as fast as opts.clients clients go; otherwise request i is due at start +
// i/rate), waits for every ledger row, and verifies one payment and one ledger
// row per request. It follows cmd/bench's runHTTPPhase (http.go) step for step.
func measurePhase(ctx context.Context, e *env, opts options, log *slog.Logger, row string, n, rate int) (report.Result, error) {
	r := report.Result{Scenario: scenario, Row: row, N: n, Messages: n}
	keys := make([]string, n)
	index := make(map[string]int, n)
	for i := range keys {
		id, err := uuid.NewV7() // the shape of idem.NewKey
		if err != nil {
			id = uuid.New()
		}
		keys[i] = id.String()
		index[keys[i]] = i
	}
	base := time.Now()
	p, err := startPipeline(ctx, e, index, base, pipelineConfig{subscribers: opts.subscribers, pollInterval: opts.pollInterval, log: log})
	if err != nil {
		return r, err
	}
	stopped := false
	stop := func() error {
		if stopped {
			return nil
		}
		stopped = true
		return p.stop(context.WithoutCancel(ctx))
	}
	defer stop() //nolint:errcheck

	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		MaxIdleConns: 4 * opts.clients, MaxIdleConnsPerHost: 4 * opts.clients, IdleConnTimeout: time.Minute}}
	defer client.CloseIdleConnections()
	sent := make([]time.Time, n)
	answered := make([]time.Time, n)
	send := func(i int) error {
		body := fmt.Sprintf(`{"account":"acct_%d","amount_cents":%d}`, i%1000, 100+i%9000)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url, bytes.NewBufferString(body))
		if err != nil {
			return err
		}
		req.Header.Set(headerKey, keys[i])
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			return fmt.Errorf("request %d: %w", i, err)
		}
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		resp.Body.Close()
		if resp.StatusCode >= 300 {
			return fmt.Errorf("request %d: HTTP %d: %s", i, resp.StatusCode, bytes.TrimSpace(msg))
		}
		answered[i] = time.Now()
		return nil
	}

	progressCtx, stopProgress := context.WithCancel(ctx)
	defer stopProgress()
	go progress(progressCtx, row, n, p.effects.Load)

	m, err := e.startMeter(ctx)
	if err != nil {
		return r, err
	}
	start := time.Now()
	errs := make(chan error, 1)
	fail := func(err error) {
		select {
		case errs <- err:
		default:
		}
	}
	var wg sync.WaitGroup
	if rate == 0 {
		var next atomic.Int64
		for range opts.clients {
			wg.Go(func() {
				for {
					i := int(next.Add(1) - 1)
					if i >= n {
						return
					}
					sent[i] = time.Now()
					if err := send(i); err != nil {
						fail(err)
						return
					}
				}
			})
		}
	} else {
		// Open loop: request i is due at start + i/rate, whatever the others cost.
		sem := make(chan struct{}, 1024)
		for i := range n {
			if d := time.Until(start.Add(time.Duration(float64(i) / float64(rate) * float64(time.Second)))); d > 0 {
				time.Sleep(d)
			}
			sem <- struct{}{}
			sent[i] = time.Now()
			wg.Go(func() {
				defer func() { <-sem }()
				if err := send(i); err != nil {
					fail(err)
				}
			})
		}
	}
	wg.Wait()
	select {
	case err := <-errs:
		return r, err
	default:
	}
	// Every request answered: wait for the ledger rows.
	deadline := time.Now().Add(opts.timeout)
	for p.effects.Load() < int64(n) {
		if err := p.failed(); err != nil {
			return r, err
		}
		if err := ctx.Err(); err != nil {
			return r, err
		}
		if time.Now().After(deadline) {
			return r, fmt.Errorf("timed out after %s: %d of %d ledger rows committed", opts.timeout, p.effects.Load(), n)
		}
		time.Sleep(5 * time.Millisecond) // poll interval of a condition
	}
	meas, err := m.stop(ctx)
	if err != nil {
		return r, err
	}
	stopProgress()

	latencies := make([]time.Duration, n)
	responses := make([]time.Duration, n)
	var last time.Time
	for i := range n {
		end := p.effectAt(i)
		latencies[i] = end.Sub(sent[i])
		responses[i] = answered[i].Sub(sent[i])
		if end.After(last) {
			last = end
		}
	}
	slices.Sort(latencies)
	slices.Sort(responses)
	elapsed := last.Sub(start)

	// Not timed: let any redelivery land before counting rows, then shut down
	// gracefully and count.
	if err := p.waitDrained(ctx, 30*time.Second); err != nil {
		fmt.Fprintf(os.Stderr, "[%s] warning: %v\n", row, err)
	}
	if err := stop(); err != nil {
		fmt.Fprintf(os.Stderr, "[%s] warning: shutdown: %v\n", row, err)
	}
	verified, l, err := verify(ctx, e, n)
	if err != nil {
		return r, err
	}

	r.Seconds, r.Rate = elapsed.Seconds(), measure.Rate(n, elapsed)
	r.SetLatency(measure.Summarize(latencies))
	r.ProcCPUSec, r.PGCPUSec = meas.ProcCPU.Seconds(), meas.PGCPU.Seconds()
	r.Ledger, r.Verified = &l, verified
	const what = "request sent -> ledger row committed"
	if rate > 0 {
		r.Notes = append(r.Notes, fmt.Sprintf("offered %d requests/s, open loop; latency = %s; max %.1f ms", rate, what, r.MaxMs))
	} else {
		r.Notes = append(r.Notes, fmt.Sprintf("%d keep-alive clients, one intent per request; latency under saturation = %s", opts.clients, what))
	}
	r.Notes = append(r.Notes,
		fmt.Sprintf("of which request sent -> response: p50 %.1f ms, p99 %.1f ms", measure.Ms(measure.Percentile(responses, 50)), measure.Ms(measure.Percentile(responses, 99))),
		"dedup: Watermill middleware.Deduplicator keyed on the Idempotency-Key metadata (NewMessageHasherFromMetadataField); "+
			"its repository is the one Watermill ships, NewMapExpiringKeyRepository with the default 1-minute window: in process memory, "+
			"not shared between instances, lost on restart, and the key is marked seen before the handler runs (a failed handler's redelivery is dropped)",
		"ledger handler: one autocommit INSERT per message, not in a transaction with the dedup check; JetStream ack after it returns",
		fmt.Sprintf("forwarder: watermill-sql Subscriber on the forwarder topic, PollInterval %s (the sleep after an empty poll; %s), ", pollInterval(opts), pollDefault(opts))+
			"batches of 100 rows (DefaultPostgreSQLSchema.SubscribeBatchSize), AckDeadline 30s; each message is forwarded to JetStream one at a time, "+
			"waiting for its PubAck, inside the subscriber's transaction",
		fmt.Sprintf("JetStream: watermill-nats/v2 pkg/nats with JetStream enabled, durable push consumer %q, AckAsync false (AckSync), "+
			"TrackMsgId (Nats-Msg-Id = message UUID = idempotency key), SubscribersCount %d (Watermill's default is 1), publisher AutoProvision off", durable, opts.subscribers),
		"ingress: no request-level idempotency (nothing like idem's idem_requests): a retried request would write a second payment and message",
	)
	if verified != "ok" {
		fmt.Fprintf(os.Stderr, "[%s] %s\n", row, verified)
	}
	return r, nil
}

// verify counts payments and ledger rows: exactly n of each with n distinct keys
// is "ok"; anything else is reported, as a finding, in the returned string.
func verify(ctx context.Context, e *env, n int) (string, report.Ledger, error) {
	var payments, paymentKeys int
	var l report.Ledger
	if err := e.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT idempotency_key) FROM payments`).Scan(&payments, &paymentKeys); err != nil {
		return "", l, fmt.Errorf("verify payments: %w", err)
	}
	if err := e.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT idempotency_key) FROM ledger_entries`).Scan(&l.Rows, &l.Keys); err != nil {
		return "", l, fmt.Errorf("verify ledger: %w", err)
	}
	var problems []string
	if payments != n || paymentKeys != n {
		problems = append(problems, fmt.Sprintf("%d payments rows with %d distinct keys, want %d", payments, paymentKeys, n))
	}
	if l.Rows != n || l.Keys != n {
		problems = append(problems, fmt.Sprintf("ledger has %d rows with %d distinct keys (%d duplicates, %d keys missing), want %d",
			l.Rows, l.Keys, l.Rows-l.Keys, n-l.Keys, n))
	}
	if len(problems) == 0 {
		return "ok", l, nil
	}
	s := "FAILED: " + problems[0]
	for _, p := range problems[1:] {
		s += "; " + p
	}
	return s, l, nil
}

// progress prints ledger rows committed every second until ctx is done.
func progress(ctx context.Context, row string, total int, done func() int64) {
	start := time.Now()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			d := done()
			fmt.Fprintf(os.Stderr, "[%s] effects committed %d/%d (%.0f/s)\n", row, d, total, float64(d)/time.Since(start).Seconds())
		}
	}
}

func pollDefault(o options) string {
	if o.pollInterval == 0 {
		return "Watermill's default"
	}
	return "set by -poll-interval; Watermill's default is 1s"
}
