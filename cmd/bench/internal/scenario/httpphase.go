package scenario

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// The HTTP scenarios (plain-http, e2e-http, and the watermill-http peer) go
// through a real HTTP server, one intent per request: the shape users run. Each
// has two phases on fresh environments: "<name> (max)", N requests from
// -http-clients keep-alive clients as fast as they go, and "<name> @<rate>/s",
// min(-http-rate-n, N) requests offered open loop at -http-rate requests/s.

// httpRows are an HTTP scenario's rows.
func httpRows(name string, o Options) []string {
	return []string{name + " (max)", fmt.Sprintf("%s @%d/s", name, o.HTTPRate)}
}

// httpTarget is a server under test: where to send, and when request i's effect
// is durable.
type httpTarget struct {
	url string
	// effectAt returns when the effect of key committed, measured on the same
	// monotonic clock as the client (zero: not yet), or nil when the response
	// itself is the commit (plain-http).
	effectAt func(key string) time.Time
	effects  func() int64
	stop     func(context.Context) error
}

// httpServer starts a scenario's server on env for the n requests whose keys
// index maps to their position.
type httpServer func(ctx context.Context, env *benchenv.Env, h *Harness, index map[string]int, n int) (*httpTarget, error)

// httpScenario is an HTTP scenario served in this process.
type httpScenario struct {
	name  string
	serve httpServer
	// throughBroker: the effect is a ledger row written behind the broker, and
	// the reconciler runs; otherwise the response is the commit.
	throughBroker bool
}

// httpRun is what one phase measured.
type httpRun struct {
	meas      measure.Measurement
	elapsed   time.Duration // first request sent -> last effect committed
	latencies []time.Duration
	// responses are request sent -> response received, sorted: for e2e-http the
	// ingress's share of the latency.
	responses []time.Duration
	busy      int64 // 503s retried with the same key
	proven    int64 // outbox rows the reconciler had proven complete when the meter stopped
}

// run runs the max and the rate phase, each on a fresh environment.
func (s httpScenario) run(ctx context.Context, h *Harness) ([]report.Result, error) {
	rows := httpRows(s.name, h.Opts)
	var results []report.Result
	for _, phase := range []struct {
		row, label string // label: in messages and the CPU profile's file name
		rate       int
		n          int
	}{{rows[0], s.name, 0, h.Opts.N}, {rows[1], s.name + "-rate", h.Opts.HTTPRate, min(h.Opts.HTTPRateN, h.Opts.N)}} {
		run, err := withEnv(ctx, h, phase.label, func(env *benchenv.Env) (httpRun, error) {
			return s.phase(ctx, env, h, phase.row, phase.n, phase.rate)
		})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", phase.row, err)
		}
		results = append(results, s.result(h.Opts, phase.row, phase.n, phase.rate, run))
	}
	return results, nil
}

// result is a phase's row.
func (s httpScenario) result(o Options, row string, n, rate int, run httpRun) report.Result {
	r := report.Result{Scenario: s.name, Row: row, N: n, Messages: n,
		Config: map[string]any{"clients": o.HTTPClients, "rate": rate, "one_intent_per_request": true}}
	if !s.throughBroker {
		r.Messages = 0
	}
	r.SetMeasurement(run.meas, n)
	r.Seconds, r.Rate = run.elapsed.Seconds(), measure.Rate(n, run.elapsed)
	r.SetLatency(measure.Summarize(run.latencies))
	r.Verified = "ok"
	what := "request sent -> response (the payment row committed)"
	if s.throughBroker {
		what = "request sent -> ledger row committed"
		r.Notes = append(r.Notes,
			fmt.Sprintf("of which request sent -> response: p50 %.1f ms, p99 %.1f ms",
				measure.Ms(measure.Percentile(run.responses, 50)), measure.Ms(measure.Percentile(run.responses, 99))),
			fmt.Sprintf("reconciler (a pass each second): %d of %d rows proven complete when the CPU meter stopped", run.proven, n))
	}
	if rate > 0 {
		r.Notes = append(r.Notes, fmt.Sprintf("offered %d requests/s, open loop; latency = %s; max %.1f ms", rate, what, r.MaxMs))
	} else {
		r.Notes = append(r.Notes, fmt.Sprintf("%d keep-alive clients, one intent per request; latency under saturation = %s", o.HTTPClients, what))
	}
	if run.busy > 0 {
		r.Notes = append(r.Notes, fmt.Sprintf("%d requests answered 503 (ingress at MaxInFlight) and re-sent with the same key", run.busy))
	}
	return r
}

// phase starts the scenario's server in env, sends n requests (rate 0: as fast as
// the clients go), waits for every effect and verifies there is exactly one per
// request.
func (s httpScenario) phase(ctx context.Context, env *benchenv.Env, h *Harness, row string, n, rate int) (httpRun, error) {
	var out httpRun
	clients := h.Opts.HTTPClients
	keys := make([]string, n)
	index := make(map[string]int, n)
	for i := range keys {
		keys[i] = idem.NewKey().String()
		index[keys[i]] = i
	}
	target, err := s.serve(ctx, env, h, index, n)
	if err != nil {
		return out, err
	}
	defer target.stop(context.WithoutCancel(ctx)) //nolint:errcheck

	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		MaxIdleConns: 4 * clients, MaxIdleConnsPerHost: 4 * clients, IdleConnTimeout: time.Minute}}
	sent := make([]time.Time, n)
	answered := make([]time.Time, n)
	var busy, done atomic.Int64
	send := func(i int) error {
		body := fmt.Sprintf(`{"account":"acct_%d","amount_cents":%d}`, i%1000, 100+i%9000)
		for {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, target.url, bytes.NewBufferString(body))
			if err != nil {
				return err
			}
			req.Header.Set(idem.HeaderKey, keys[i])
			req.Header.Set("Content-Type", "application/json")
			resp, err := client.Do(req)
			if err != nil {
				return fmt.Errorf("request %d: %w", i, err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			switch {
			case resp.StatusCode == http.StatusServiceUnavailable:
				busy.Add(1)
				wait, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
				time.Sleep(time.Duration(max(wait, 0))*time.Second + time.Millisecond)
				continue // the same key: a real client retries it
			case resp.StatusCode >= 300:
				return fmt.Errorf("request %d: HTTP %d", i, resp.StatusCode)
			}
			answered[i] = time.Now()
			done.Add(1)
			return nil
		}
	}

	progressCtx, stopProgress := context.WithCancel(ctx)
	defer stopProgress()
	count := done.Load
	what := "requests answered"
	if target.effects != nil {
		count, what = target.effects, "effects committed"
	}
	go progress(progressCtx, row, what, n, count)

	meter, err := env.StartMeter(ctx)
	if err != nil {
		return out, err
	}
	base := time.Now()
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
		for range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
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
			}()
		}
	} else {
		// Open loop: request i is due at base + i/rate, whatever the others cost.
		sem := make(chan struct{}, 1024)
		for i := range n {
			if d := time.Until(base.Add(time.Duration(float64(i) / float64(rate) * float64(time.Second)))); d > 0 {
				time.Sleep(d)
			}
			sem <- struct{}{}
			wg.Add(1)
			sent[i] = time.Now()
			go func() {
				defer func() { <-sem; wg.Done() }()
				if err := send(i); err != nil {
					fail(err)
				}
			}()
		}
	}
	wg.Wait()
	select {
	case err := <-errs:
		_, _ = meter.Stop(ctx)
		return out, err
	default:
	}
	// Every request answered; when the effect is behind the broker, wait for the
	// effects too.
	if target.effectAt != nil {
		deadline := time.Now().Add(h.Opts.Timeout)
		for target.effects() < int64(n) {
			if time.Now().After(deadline) {
				_, _ = meter.Stop(ctx)
				return out, fmt.Errorf("timed out after %s: %d of %d effects committed", h.Opts.Timeout, target.effects(), n)
			}
			time.Sleep(5 * time.Millisecond) // poll interval of a condition
		}
	}
	if out.meas, err = meter.Stop(ctx); err != nil {
		return out, err
	}
	if s.throughBroker {
		// How much of the reconciler's proof fell inside the phase (the rest is
		// still to be paid).
		if err := env.Pool.QueryRow(ctx, `SELECT count(*) FROM idem_outbox WHERE completed_at IS NOT NULL`).Scan(&out.proven); err != nil {
			return out, fmt.Errorf("count proven rows: %w", err)
		}
	}
	var effects []time.Time
	if target.effectAt != nil {
		effects = make([]time.Time, n)
		for i := range n {
			effects[i] = target.effectAt(keys[i])
		}
	}
	out.latencies, out.responses, out.elapsed = requestLatencies(base, sent, answered, effects)
	out.busy = busy.Load()
	return out, s.verify(ctx, env, n)
}

// requestLatencies returns, sorted, each request's latency (sent to its effect,
// or to its answer when effects is nil) and its response time (sent to answer),
// and the time from base to the last answer or effect.
func requestLatencies(base time.Time, sent, answered, effects []time.Time) (lat, resp []time.Duration, elapsed time.Duration) {
	lat = make([]time.Duration, len(sent))
	resp = make([]time.Duration, len(sent))
	var last time.Time
	for i := range sent {
		end := answered[i]
		if effects != nil {
			end = effects[i]
		}
		lat[i], resp[i] = end.Sub(sent[i]), answered[i].Sub(sent[i])
		last = maxTime(last, maxTime(end, answered[i]))
	}
	slices.Sort(lat)
	slices.Sort(resp)
	return lat, resp, last.Sub(base)
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// verify checks one business row per request, and when the effect is behind the
// broker, one ledger row per intent.
func (s httpScenario) verify(ctx context.Context, env *benchenv.Env, n int) error {
	var payments int
	if err := env.Pool.QueryRow(ctx, `SELECT count(DISTINCT idempotency_key) FROM payments`).Scan(&payments); err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	if payments != n {
		return fmt.Errorf("VERIFY FAILED: %d payments, want %d", payments, n)
	}
	if s.throughBroker {
		if _, err := verifyExactlyOnce(ctx, env, n); err != nil {
			return err
		}
	}
	return nil
}
