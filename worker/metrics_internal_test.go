package worker

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// syncBuffer collects log lines from any goroutine.
type syncBuffer struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) lines(subs ...string) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
next:
	for _, l := range strings.Split(b.buf.String(), "\n") {
		for _, s := range subs {
			if !strings.Contains(l, s) {
				continue next
			}
		}
		out = append(out, l)
	}
	return out
}

// Two consumers read one subject: one keeps up, the other (an external effect
// one at a time, behind a slow provider) cannot. The worker names the one that
// falls behind, in a warning and in idem_consumer_behind, and says when it keeps
// up again; the other is never named.
func TestWorkerWarnsWhenAConsumerFallsBehind(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	ctx := context.Background()
	logs := &syncBuffer{}
	inst := env.Install(t, func(c *install.Config) { c.Logger = slog.New(slog.NewTextHandler(logs, nil)) })
	w, err := New(inst, Config{
		Consumers: []consumer.Config{
			{Name: "fast", Subject: testenv.Subject, Handler: consumer.HandlerFunc(func(context.Context, pgx.Tx, *consumer.Delivery) ([]byte, error) {
				return nil, nil
			})},
			{Name: "slow", Subject: testenv.Subject, External: consumer.ExternalHandlerFunc(func(ctx context.Context, _ *consumer.Effect) ([]byte, error) {
				select {
				case <-ctx.Done():
					return nil, ctx.Err()
				case <-time.After(15 * time.Millisecond): // the provider
				}
				return nil, nil
			})},
		},
		DisableRelay:     true,
		DisableRetention: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	// Readings ten times a second, judged over one second: the test's minute.
	w.metrics.lag.every, w.metrics.lag.window = 100*time.Millisecond, time.Second
	reg := prometheus.NewRegistry()
	if err := w.RegisterMetrics(reg); err != nil {
		t.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Stop(context.Background()) })

	const n = 300
	for i := range n {
		m := nats.NewMsg(testenv.Subject)
		key := fmt.Sprintf("k-%d", i)
		m.Header.Set(idem.HeaderKey, key)
		m.Header.Set(idem.HeaderMsgID, key)
		m.Data = []byte(`{}`)
		if _, err := env.JS.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	behind := func() []string { return logs.lines("level=WARN", "consumer falls behind") }
	testenv.Eventually(t, 30*time.Second, "a warning that slow falls behind", func() bool { return len(behind()) > 0 })
	if got := behind(); len(got) != 1 || !strings.Contains(got[0], "consumer=slow") || !strings.Contains(got[0], "lag=") || !strings.Contains(got[0], "rate_per_s=") {
		t.Fatalf("warnings: %q, want one naming slow, its lag and rate", got)
	}
	if v := gaugeValue(t, reg, "idem_consumer_behind", "slow"); v != 1 {
		t.Errorf("idem_consumer_behind{consumer=slow} = %v while it is behind, want 1", v)
	}
	if v := gaugeValue(t, reg, "idem_consumer_behind", "fast"); v != 0 {
		t.Errorf("idem_consumer_behind{consumer=fast} = %v, want 0", v)
	}
	testenv.Eventually(t, 60*time.Second, "slow keeps up again", func() bool {
		return len(logs.lines("consumer keeps up again", "consumer=slow")) == 1
	})
	testenv.Eventually(t, 60*time.Second, "slow settles every message", func() bool {
		return env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'slow'`) == n
	})
	if got := logs.lines("consumer=fast", "falls behind"); len(got) != 0 {
		t.Errorf("fast was said to fall behind: %q", got)
	}
}

// gaugeValue is the value of gauge name{consumer}, or -1 when it has no such series.
func gaugeValue(t *testing.T, reg *prometheus.Registry, name, consumer string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "consumer" && l.GetValue() == consumer {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	return -1
}
