package ops_test

import (
	"math"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/ops"
)

// consumerAt is one consumer's reading: pending, ack pending, deliveries so far.
func consumerAt(name string, pending uint64, ackPending int, delivered uint64) ops.ConsumerLag {
	return ops.ConsumerLag{Name: name, NumPending: pending, NumAckPending: ackPending, Delivered: delivered,
		Lag: pending + uint64(ackPending)}
}

func trendOf(t *testing.T, tr *ops.Trends, name string) ops.ConsumerTrend {
	t.Helper()
	for _, c := range tr.Consumers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no trend of %s in %+v", name, tr.Consumers)
	return ops.ConsumerTrend{}
}

func near(a, b float64) bool { return math.Abs(a-b) < 0.01*max(math.Abs(b), 1) }

// Readings every 10 s for two minutes, as the worker takes them. The stream takes
// in 150 messages/s: 100/s for "fast", 50/s for "slow", which finishes 25/s.
func TestLagHistoryTrends(t *testing.T) {
	h := ops.NewLagHistory(15 * time.Minute)
	if h.Trends(time.Minute) != nil {
		t.Fatal("Trends before any reading is not nil")
	}
	t0 := time.Date(2026, 1, 2, 3, 4, 0, 0, time.UTC)
	for i := range 13 {
		n := uint64(i)
		cs := []ops.ConsumerLag{
			// Keeps up: finishes what arrives, the odd batch in flight; its lag
			// touches 0.
			consumerAt("fast", 0, []int{0, 40, 0, 20}[i%4], 1000*n+uint64([]int{0, 40, 0, 20}[i%4])),
			// Falls behind: 500 in, 250 finished every 10 s; it fetched 1000 ahead.
			consumerAt("slow", 250*n, 1000, 250*n+1000),
			// Stuck on one message: lag 1, nothing finished.
			consumerAt("stuck", 0, 1, 7),
			// Draining a backlog fast: behind in messages, not in time.
			consumerAt("draining", 30000-2000*n, 100, 2000*n+100),
		}
		if i >= 10 {
			cs = append(cs, consumerAt("new", 100, 0, 0)) // too recent to judge
		}
		h.Add(&ops.JetStreamStats{Stream: "S", At: t0.Add(time.Duration(i) * 10 * time.Second), LastSeq: 1500 * n, Consumers: cs})
		if i == 4 {
			// 40 s of readings: nothing is judged on less than the window.
			for _, c := range h.Trends(time.Minute).Consumers {
				if c.Behind {
					t.Errorf("%s judged behind on 40s of readings", c.Name)
				}
			}
		}
	}
	tr := h.Trends(time.Minute)
	if tr.Window != time.Minute || !tr.At.Equal(t0.Add(2*time.Minute)) || !tr.Since.Equal(t0) {
		t.Fatalf("trends span %s..%s over %s", tr.Since, tr.At, tr.Window)
	}
	if !near(tr.PublishedPerSec, 150) {
		t.Errorf("published %.2f/s, want 150", tr.PublishedPerSec)
	}
	for _, c := range []struct {
		name   string
		rate   float64
		lag    uint64
		behind bool
	}{
		{"fast", 100, 0, false},
		{"slow", 25, 250*12 + 1000, true},
		{"stuck", 0, 1, true},
		{"draining", 200, 30000 - 24000 + 100, false},
		{"new", 0, 100, false},
	} {
		ct := trendOf(t, tr, c.name)
		if !near(ct.RatePerSec, c.rate) || ct.Lag != c.lag || ct.Behind != c.behind {
			t.Errorf("%s: rate %.2f/s, lag %d, behind %v; want %.2f/s, %d, %v", c.name, ct.RatePerSec, ct.Lag, ct.Behind, c.rate, c.lag, c.behind)
		}
	}
	slow := trendOf(t, tr, "slow")
	if len(slow.Points) != 13 || slow.Points[0].RatePerSec != 0 || !near(slow.Points[12].RatePerSec, 25) || slow.Points[12].Lag != 4000 {
		t.Errorf("slow's points: %+v", slow.Points)
	}
	if n := len(trendOf(t, tr, "new").Points); n != 3 {
		t.Errorf("new has %d points, want its 3 readings", n)
	}

	// A durable made anew counts its deliveries from 0: no negative rate.
	h.Add(&ops.JetStreamStats{Stream: "S", At: t0.Add(130 * time.Second), LastSeq: 1500 * 13,
		Consumers: []ops.ConsumerLag{consumerAt("fast", 0, 0, 500)}})
	fast := trendOf(t, h.Trends(time.Minute), "fast")
	if last := fast.Points[len(fast.Points)-1]; last.RatePerSec != 0 || fast.RatePerSec < 0 {
		t.Errorf("after a reset: point rate %.2f, window rate %.2f; want 0 and not negative", last.RatePerSec, fast.RatePerSec)
	}

	// Readings older than the history keeps are forgotten.
	h.Add(&ops.JetStreamStats{Stream: "S", At: t0.Add(20 * time.Minute), Consumers: []ops.ConsumerLag{}})
	if tr := h.Trends(time.Minute); !tr.Since.After(t0.Add(4*time.Minute)) || len(tr.Consumers) != 0 {
		t.Errorf("after 20 minutes the history keeps readings since %s (%d consumers)", tr.Since, len(tr.Consumers))
	}
}
