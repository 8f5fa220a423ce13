package worker_test

import (
	"context"
	"log/slog"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/worker"
)

// The default setup does not warn: NewPool sizes the pool from the Config (the
// parts' connections on top of pgxpool's default, which the ingress gets), where
// pgxpool's default alone (4 on two cores) is smaller than the parts use. A
// pool_max_conns in the URL is kept, and a pool too small for the parts is still
// named, with the way out.
func TestNewPoolSizesThePoolFromTheConfig(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	cfg := ordersConfig()
	cfg.Consumers = append(cfg.Consumers, consumer.Config{Name: "mailer", Subject: "orders.created",
		External: consumer.ExternalHandlerFunc(func(context.Context, *consumer.Effect) ([]byte, error) { return nil, nil })})
	// shipping 2, mailer 1, relay 2, collector 1, health 1 = 7; the ingress gets pgxpool's default.
	const reserved = 7
	pgxDefault := max(4, runtime.NumCPU())
	var logs strings.Builder
	icfg := ordersInstall("")
	icfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))

	for _, tc := range []struct {
		name     string
		url      string
		maxConns int
		inFlight int
		warns    bool
	}{
		{"sized from the Config", env.DB.URL, reserved + pgxDefault, pgxDefault, false},
		{"pool_max_conns kept", env.DB.URL + "&pool_max_conns=5", 5, 1, true},
	} {
		logs.Reset()
		pool, err := worker.NewPool(t.Context(), tc.url, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		if got := int(pool.Config().MaxConns); got != tc.maxConns {
			t.Errorf("%s: MaxConns = %d, want %d", tc.name, got, tc.maxConns)
		}
		w, err := worker.New(newInst(t, pool, env.NC, icfg), cfg)
		if err != nil {
			t.Fatal(err)
		}
		if got := w.Ingress().Config().MaxInFlight; got != tc.inFlight {
			t.Errorf("%s: ingress MaxInFlight = %d, want %d", tc.name, got, tc.inFlight)
		}
		warned := strings.Contains(logs.String(), "smaller than the 8 connections")
		if warned != tc.warns {
			t.Errorf("%s: warned about the pool = %v, want %v: %s", tc.name, warned, tc.warns, logs.String())
		}
		if warned {
			for _, want := range []string{"ingress 1", "worker.NewPool", "(" + strconv.Itoa(reserved+pgxDefault) + " connections here)", "pool_max_conns"} {
				if !strings.Contains(logs.String(), want) {
					t.Errorf("%s: the warning does not say %q: %s", tc.name, want, logs.String())
				}
			}
		}
	}
	// The pool is made usable, not only sized.
	pool, err := worker.NewPool(t.Context(), env.DB.URL, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := pool.Ping(t.Context()); err != nil {
		t.Fatal(err)
	}
	if _, err := worker.NewPool(t.Context(), env.DB.URL+"&pool_max_conns=zero", cfg); err == nil || !strings.Contains(err.Error(), "worker: pool:") {
		t.Errorf("a bad pool_max_conns = %v, want the parse error", err)
	}
}
