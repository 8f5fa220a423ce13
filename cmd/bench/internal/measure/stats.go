package measure

import (
	"slices"
	"time"
)

// Percentile returns the p-th percentile (0..100) of sorted durations by nearest
// rank: the smallest value with at least p% of the values at or below it. Empty
// input gives 0.
func Percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p/100*float64(len(sorted))+0.5) - 1
	i = max(0, min(i, len(sorted)-1))
	return sorted[i]
}

// Ms is d in milliseconds.
func Ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Rate is n per second of elapsed, or 0 when nothing elapsed (JSON cannot carry
// an infinity).
func Rate(n int, elapsed time.Duration) float64 {
	if elapsed <= 0 {
		return 0
	}
	return float64(n) / elapsed.Seconds()
}

// PerIntentMicros is seconds of CPU spread over n intents, in microseconds, or 0
// when n is not positive.
func PerIntentMicros(cpuSeconds float64, n int) float64 {
	if n <= 0 {
		return 0
	}
	return 1e6 * cpuSeconds / float64(n)
}

// Latency summarises a set of latencies.
type Latency struct {
	P50, P99, Max time.Duration
}

// Summarize sorts lat in place and returns its median, 99th percentile and maximum.
func Summarize(lat []time.Duration) Latency {
	slices.Sort(lat)
	if len(lat) == 0 {
		return Latency{}
	}
	return Latency{P50: Percentile(lat, 50), P99: Percentile(lat, 99), Max: lat[len(lat)-1]}
}

// HalvesP99 returns the 99th percentile of the first and of the second half of lat,
// taken in the order given (intents are produced in index order, so this shows a
// latency that grows as the tables grow). lat is not modified.
func HalvesP99(lat []time.Duration) [2]time.Duration {
	half := len(lat) / 2
	first, second := slices.Clone(lat[:half]), slices.Clone(lat[half:])
	slices.Sort(first)
	slices.Sort(second)
	return [2]time.Duration{Percentile(first, 99), Percentile(second, 99)}
}
