package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/internal/app/refapp"
)

// HTTPConfig configures the scenarios that go through a real HTTP server, one
// intent per request: the shape users run.
type HTTPConfig struct {
	N int
	// Clients is how many keep-alive clients send requests in the max phase.
	Clients int
	// Rate is the offered load of the latency phase, requests/s (open loop).
	Rate int
	// RateN is how many requests the latency phase sends.
	RateN   int
	Timeout time.Duration
	Log     *slog.Logger
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

// httpRun is what one phase measured.
type httpRun struct {
	meas      Measurement
	elapsed   time.Duration // first request sent -> last effect committed
	latencies []time.Duration
	// responses are request sent -> response received, sorted: for e2e-http the
	// ingress's share of the latency.
	responses []time.Duration
	busy      int64 // 503s retried with the same key
	proven    int64 // outbox rows the reconciler had proven complete when the meter stopped
}

// runHTTPScenario runs the max and the rate phase of scenario (e2e-http or
// plain-http), each on a fresh environment.
func runHTTPScenario(ctx context.Context, newEnv envFactory, scenario string, cfg HTTPConfig) ([]Result, error) {
	var results []Result
	for _, phase := range []struct {
		row, label string // label: in messages and the CPU profile's file name
		rate       int
		n          int
	}{{scenario + " (max)", scenario, 0, cfg.N}, {fmt.Sprintf("%s @%d/s", scenario, cfg.Rate), scenario + "-rate", cfg.Rate, min(cfg.RateN, cfg.N)}} {
		run, err := withEnv(ctx, labelled(newEnv, phase.label), func(env *Env) (httpRun, error) {
			return runHTTPPhase(ctx, env, scenario, phase.row, phase.n, phase.rate, cfg)
		})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", phase.row, err)
		}
		r := Result{Scenario: scenario, Row: phase.row, N: phase.n, Messages: phase.n,
			Config: map[string]any{"clients": cfg.Clients, "rate": phase.rate, "one_intent_per_request": true}}
		if scenario == scPlainHTTP {
			r.Messages = 0
		}
		r.setMeasurement(run.meas, phase.n)
		r.Seconds, r.Rate = run.elapsed.Seconds(), float64(phase.n)/run.elapsed.Seconds()
		r.P50ms, r.P99ms = ms(percentile(run.latencies, 50)), ms(percentile(run.latencies, 99))
		r.MaxMs = ms(run.latencies[len(run.latencies)-1])
		if scenario == scE2EHTTP {
			r.Notes = append(r.Notes, fmt.Sprintf("of which request sent -> response: p50 %.1f ms, p99 %.1f ms",
				ms(percentile(run.responses, 50)), ms(percentile(run.responses, 99))))
		}
		r.Verified = "ok"
		what := "request sent -> ledger row committed"
		if scenario == scPlainHTTP {
			what = "request sent -> response (the payment row committed)"
		} else {
			r.Notes = append(r.Notes, fmt.Sprintf("reconciler (a pass each second): %d of %d rows proven complete when the CPU meter stopped", run.proven, phase.n))
		}
		if phase.rate > 0 {
			r.Notes = append(r.Notes, fmt.Sprintf("offered %d requests/s, open loop; latency = %s; max %.1f ms", phase.rate, what, r.MaxMs))
		} else {
			r.Notes = append(r.Notes, fmt.Sprintf("%d keep-alive clients, one intent per request; latency under saturation = %s", cfg.Clients, what))
		}
		if run.busy > 0 {
			r.Notes = append(r.Notes, fmt.Sprintf("%d requests answered 503 (ingress at MaxInFlight) and re-sent with the same key", run.busy))
		}
		results = append(results, r)
	}
	return results, nil
}

// runHTTPPhase starts the scenario's server in env, sends n requests (rate 0: as
// fast as cfg.Clients clients go), waits for every effect and verifies there is
// exactly one per request.
func runHTTPPhase(ctx context.Context, env *Env, scenario, row string, n, rate int, cfg HTTPConfig) (httpRun, error) {
	var out httpRun
	keys := make([]string, n)
	index := make(map[string]int, n)
	for i := range keys {
		keys[i] = idem.NewKey().String()
		index[keys[i]] = i
	}
	var target *httpTarget
	var err error
	switch scenario {
	case scE2EHTTP:
		target, err = startRefApp(ctx, env, index, n, cfg.Log)
	case scPlainHTTP:
		target, err = startPlainHTTP(env)
	default:
		err = fmt.Errorf("unknown HTTP scenario %q", scenario)
	}
	if err != nil {
		return out, err
	}
	defer target.stop(context.WithoutCancel(ctx)) //nolint:errcheck

	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		MaxIdleConns: 4 * cfg.Clients, MaxIdleConnsPerHost: 4 * cfg.Clients, IdleConnTimeout: time.Minute}}
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
		for range cfg.Clients {
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
	// Every request answered; for e2e-http, wait for the effects too.
	last := slices.MaxFunc(answered, func(a, b time.Time) int { return a.Compare(b) })
	if target.effectAt != nil {
		deadline := time.Now().Add(cfg.Timeout)
		for target.effects() < int64(n) {
			if time.Now().After(deadline) {
				_, _ = meter.Stop(ctx)
				return out, fmt.Errorf("timed out after %s: %d of %d effects committed", cfg.Timeout, target.effects(), n)
			}
			time.Sleep(5 * time.Millisecond) // poll interval of a condition
		}
	}
	if out.meas, err = meter.Stop(ctx); err != nil {
		return out, err
	}
	if scenario != scPlainHTTP {
		// How much of the reconciler's proof fell inside the phase (the rest is
		// still to be paid).
		if err := env.Pool.QueryRow(ctx, `SELECT count(*) FROM idem_outbox WHERE completed_at IS NOT NULL`).Scan(&out.proven); err != nil {
			return out, fmt.Errorf("count proven rows: %w", err)
		}
	}
	out.latencies = make([]time.Duration, n)
	out.responses = make([]time.Duration, n)
	for i := range n {
		end := answered[i]
		if target.effectAt != nil {
			end = target.effectAt(keys[i])
		}
		out.latencies[i] = end.Sub(sent[i])
		out.responses[i] = answered[i].Sub(sent[i])
		if end.After(last) {
			last = end
		}
	}
	slices.Sort(out.latencies)
	slices.Sort(out.responses)
	out.elapsed = last.Sub(base)
	out.busy = busy.Load()
	return out, verifyHTTP(ctx, env, scenario, n)
}

// verifyHTTP checks one business row per request, and for e2e-http one ledger row
// per intent.
func verifyHTTP(ctx context.Context, env *Env, scenario string, n int) error {
	var payments int
	if err := env.Pool.QueryRow(ctx, `SELECT count(DISTINCT idempotency_key) FROM payments`).Scan(&payments); err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	if payments != n {
		return fmt.Errorf("VERIFY FAILED: %d payments, want %d", payments, n)
	}
	if scenario == scE2EHTTP {
		if _, err := verifyExactlyOnce(ctx, env, n); err != nil {
			return err
		}
	}
	return nil
}

// startRefApp runs the reference application as `go run ./cmd/worker` does — its
// ingress, relay, reconciler, consumers and collector — on env, and records when
// each intent's ledger row commits (the consumer.after-commit fault point runs
// right after the COMMIT returned).
func startRefApp(ctx context.Context, env *Env, index map[string]int, n int, log *slog.Logger) (*httpTarget, error) {
	committed := make([]atomic.Int64, n)
	var effects atomic.Int64
	base := time.Now()
	record := func(_ context.Context, keys []string) error {
		now := int64(time.Since(base))
		for _, k := range keys {
			if i, ok := index[k]; ok && committed[i].CompareAndSwap(0, now) {
				effects.Add(1)
			}
		}
		return nil
	}
	svcCtx := faults.With(context.WithoutCancel(ctx), faults.New().Func(faults.ConsumerAfterCommit, record))
	svc, err := refapp.Start(svcCtx, env.Pool, env.NC, refapp.Config{HTTPAddr: "127.0.0.1:0", Logger: log,
		// A reconciler pass every second, not the default 30s, as in the e2e
		// scenarios: a timed phase lasts seconds, and with the default it would
		// hardly prove a row in it, leaving out a cost every intent pays.
		Reconcile: reconcile.Config{Interval: time.Second}})
	if err != nil {
		return nil, fmt.Errorf("start the reference application: %w", err)
	}
	return &httpTarget{
		url: "http://" + svc.Addr() + "/v1/payments",
		effectAt: func(key string) time.Time {
			return base.Add(time.Duration(committed[index[key]].Load()))
		},
		effects: effects.Load,
		stop:    svc.Shutdown,
	}, nil
}

// startPlainHTTP serves the floor of "one commit per request": the same route,
// writing the payment row in one transaction, with no idempotency and no outbox.
func startPlainHTTP(env *Env) (*httpTarget, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/payments", func(w http.ResponseWriter, r *http.Request) {
		var c refapp.Charge
		if err := json.NewDecoder(r.Body).Decode(&c); err != nil || c.Validate() != nil {
			http.Error(w, "bad charge", http.StatusBadRequest)
			return
		}
		err := pgx.BeginFunc(r.Context(), env.Pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(r.Context(), `INSERT INTO payments (idempotency_key, account, amount_cents) VALUES ($1, $2, $3)`,
				r.Header.Get(idem.HeaderKey), c.Account, c.AmountCents)
			return err
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusAccepted)
		_, _ = w.Write([]byte(`{"status":"accepted"}`))
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintf(os.Stderr, "plain-http: %v\n", err)
		}
	}()
	return &httpTarget{url: "http://" + ln.Addr().String() + "/v1/payments", stop: srv.Shutdown}, nil
}
