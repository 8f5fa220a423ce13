package ops

import (
	"slices"
	"strings"
	"sync"
	"time"
)

// LagHistory keeps a stream's recent readings (ReadJetStream) in memory, for what
// one reading cannot tell: how fast each consumer works through its messages, and
// whether it keeps up. It is safe for concurrent use.
type LagHistory struct {
	keep time.Duration

	mu       sync.Mutex
	readings []*JetStreamStats // oldest first
}

// NewLagHistory returns a history that keeps readings for keep.
func NewLagHistory(keep time.Duration) *LagHistory {
	return &LagHistory{keep: keep}
}

// Add records a reading, which must carry its time (ReadJetStream sets At), and
// forgets the readings older than the history keeps.
func (h *LagHistory) Add(s *JetStreamStats) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.readings = append(h.readings, s)
	cut := 0
	for cut < len(h.readings)-1 && s.At.Sub(h.readings[cut].At) > h.keep {
		cut++
	}
	h.readings = slices.Delete(h.readings, 0, cut)
}

// Trends is what the readings kept say of a stream's consumers.
type Trends struct {
	Stream string `json:"stream"`
	// At is the time of the latest reading, Since of the oldest kept.
	At    time.Time `json:"at"`
	Since time.Time `json:"since"`
	// Window is what the rates and Behind are measured over (or the readings' span,
	// when shorter).
	Window time.Duration `json:"window"`
	// PublishedPerSec is how many messages per second the stream took in over
	// Window, from the growth of its last sequence.
	PublishedPerSec float64 `json:"published_per_s"`
	// Messages, FirstSeq and LastSeq are the stream's in the latest reading.
	Messages  uint64          `json:"messages"`
	FirstSeq  uint64          `json:"first_seq"`
	LastSeq   uint64          `json:"last_seq"`
	Consumers []ConsumerTrend `json:"consumers"`
}

// ConsumerTrend is one durable consumer over the readings kept.
type ConsumerTrend struct {
	// ConsumerLag is the latest reading.
	ConsumerLag
	// RatePerSec is how many deliveries per second it finished (acknowledged, or
	// gave up on) over Window: its deliveries less the ones still unacknowledged.
	// A message delivered again counts again.
	RatePerSec float64 `json:"rate_per_s"`
	// Behind: for the whole of Window its lag never reached 0, and it ends larger
	// than what the consumer finished in that time, so at its pace it needs more
	// than another Window to catch up. Judged only once the readings span Window.
	Behind bool `json:"behind"`
	// Points are the consumer's readings, oldest first; a point's rate is over the
	// time since the point before it.
	Points []TrendPoint `json:"points"`
}

// TrendPoint is one reading of one consumer.
type TrendPoint struct {
	At         time.Time `json:"at"`
	Lag        uint64    `json:"lag"`
	RatePerSec float64   `json:"rate_per_s"`
}

// Trends returns the trends of every consumer in the latest reading, by name,
// measuring rates and Behind over window; nil before the first reading.
func (h *LagHistory) Trends(window time.Duration) *Trends {
	h.mu.Lock()
	readings := slices.Clone(h.readings)
	h.mu.Unlock()
	if len(readings) == 0 {
		return nil
	}
	last := readings[len(readings)-1]
	// The window starts at the latest reading at least window before the last;
	// covered says the readings reach that far back.
	start, covered := 0, false
	for i := len(readings) - 1; i >= 0; i-- {
		if last.At.Sub(readings[i].At) >= window {
			start, covered = i, true
			break
		}
	}
	tr := &Trends{Stream: last.Stream, At: last.At, Since: readings[0].At, Window: window,
		Messages: last.Messages, FirstSeq: last.FirstSeq, LastSeq: last.LastSeq, Consumers: []ConsumerTrend{}}
	if !covered {
		tr.Window = last.At.Sub(readings[start].At)
	}
	if secs := last.At.Sub(readings[start].At).Seconds(); secs > 0 && last.LastSeq >= readings[start].LastSeq {
		tr.PublishedPerSec = float64(last.LastSeq-readings[start].LastSeq) / secs
	}
	for _, cl := range last.Consumers {
		ct := ConsumerTrend{ConsumerLag: cl}
		var prev *ConsumerLag
		var prevAt time.Time
		var finished int64 // deliveries finished since the window started
		present, clear := false, true
		for i, r := range readings {
			cur := find(r.Consumers, cl.Name)
			if cur == nil {
				prev = nil
				continue
			}
			p := TrendPoint{At: r.At, Lag: cur.Lag}
			var step int64
			if prev != nil {
				// A durable consumer made anew starts counting again: no rate across it.
				step = max(done(cur)-done(prev), 0)
				if secs := r.At.Sub(prevAt).Seconds(); secs > 0 {
					p.RatePerSec = float64(step) / secs
				}
			}
			ct.Points = append(ct.Points, p)
			if i == start {
				present = true
			}
			if i > start && prev != nil {
				finished += step
			}
			if i >= start && cur.Lag == 0 {
				clear = false
			}
			prev, prevAt = cur, r.At
		}
		if secs := tr.Window.Seconds(); secs > 0 {
			ct.RatePerSec = float64(finished) / secs
		}
		ct.Behind = covered && present && clear && int64(cl.Lag) > finished
		tr.Consumers = append(tr.Consumers, ct)
	}
	slices.SortFunc(tr.Consumers, func(a, b ConsumerTrend) int { return strings.Compare(a.Name, b.Name) })
	return tr
}

// done is how many of a consumer's deliveries are finished: acknowledged, or
// given up on (terminated, or delivered again).
func done(c *ConsumerLag) int64 { return int64(c.Delivered) - int64(c.NumAckPending) }

func find(cs []ConsumerLag, name string) *ConsumerLag {
	for i := range cs {
		if cs[i].Name == name {
			return &cs[i]
		}
	}
	return nil
}
