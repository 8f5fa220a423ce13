package scenario

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// e2eHTTP is the reference application as `go run ./cmd/worker` runs it
// (ingress, relay, reconciler, consumers), one intent per HTTP request from
// keep-alive clients; latency is request sent -> ledger row committed.
type e2eHTTP struct{}

func (e2eHTTP) Name() string { return "e2e-http" }

func (e2eHTTP) Summary() string {
	return "the reference application as `go run ./cmd/worker` runs it, one intent per HTTP request; latency is request sent -> ledger row committed"
}

func (s e2eHTTP) Rows(o Options) []string { return httpRows(s.Name(), o) }

func (s e2eHTTP) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	return httpScenario{name: s.Name(), serve: serveRefApp, throughBroker: true}.run(ctx, h)
}

// serveRefApp starts the reference application on env and records when each
// intent's ledger row commits (right after the consumer's COMMIT returned).
func serveRefApp(ctx context.Context, env *benchenv.Env, h *Harness, index map[string]int, n int) (*httpTarget, error) {
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
	svc, err := startRefApp(afterCommit(context.WithoutCancel(ctx), record), env, h.Opts.Relay, h.Log)
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
