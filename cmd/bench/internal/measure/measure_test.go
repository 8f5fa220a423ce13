package measure

import (
	"os"
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	ms := func(vs ...int) []time.Duration {
		out := make([]time.Duration, len(vs))
		for i, v := range vs {
			out[i] = time.Duration(v) * time.Millisecond
		}
		return out
	}
	hundred := make([]time.Duration, 100)
	for i := range hundred {
		hundred[i] = time.Duration(i+1) * time.Millisecond
	}
	for _, tc := range []struct {
		name   string
		sorted []time.Duration
		p      float64
		want   time.Duration
	}{
		{"empty", nil, 50, 0},
		{"one value, any p", ms(7), 99, 7 * time.Millisecond},
		{"p0 is the smallest", ms(1, 2, 3), 0, time.Millisecond},
		{"p100 is the largest", ms(1, 2, 3), 100, 3 * time.Millisecond},
		{"median of four rounds to the second", ms(1, 2, 3, 4), 50, 2 * time.Millisecond},
		{"median of five", ms(1, 2, 3, 4, 5), 50, 3 * time.Millisecond},
		{"p99 of 1..100 is 99", hundred, 99, 99 * time.Millisecond},
		{"p50 of 1..100 is 50", hundred, 50, 50 * time.Millisecond},
		{"p99 of ten is the largest", ms(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), 99, 10 * time.Millisecond},
		{"p90 of ten is the ninth", ms(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), 90, 9 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Percentile(tc.sorted, tc.p); got != tc.want {
				t.Errorf("Percentile(%v, %v) = %v, want %v", tc.sorted, tc.p, got, tc.want)
			}
		})
	}
}

func TestSummarizeSortsAndTakesTheMax(t *testing.T) {
	lat := []time.Duration{5, 1, 4, 2, 3}
	got := Summarize(lat)
	want := Latency{P50: 3, P99: 5, Max: 5}
	if got != want {
		t.Fatalf("Summarize = %+v, want %+v", got, want)
	}
	if lat[0] != 1 || lat[4] != 5 {
		t.Errorf("Summarize left %v unsorted", lat)
	}
	if (Summarize(nil) != Latency{}) {
		t.Error("Summarize(nil) is not zero")
	}
}

func TestHalvesP99KeepsOrderAndInput(t *testing.T) {
	// The first half is slow, the second fast: the halves must show it.
	lat := []time.Duration{90, 80, 100, 1, 3, 2}
	got := HalvesP99(lat)
	if got != [2]time.Duration{100, 3} {
		t.Fatalf("HalvesP99 = %v, want [100 3]", got)
	}
	if lat[0] != 90 || lat[3] != 1 {
		t.Errorf("HalvesP99 modified its input: %v", lat)
	}
}

func TestRate(t *testing.T) {
	for _, tc := range []struct {
		n       int
		elapsed time.Duration
		want    float64
	}{
		{2000, time.Second, 2000},
		{2000, 500 * time.Millisecond, 4000},
		{3, 2 * time.Second, 1.5},
		{100, 0, 0},
		{100, -time.Second, 0},
	} {
		if got := Rate(tc.n, tc.elapsed); got != tc.want {
			t.Errorf("Rate(%d, %v) = %v, want %v", tc.n, tc.elapsed, got, tc.want)
		}
	}
}

func TestPerIntentMicros(t *testing.T) {
	for _, tc := range []struct {
		sec  float64
		n    int
		want float64
	}{
		{1, 1_000_000, 1},
		{0.3, 2000, 150},
		{2, 0, 0},
		{2, -1, 0},
	} {
		if got := PerIntentMicros(tc.sec, tc.n); got != tc.want {
			t.Errorf("PerIntentMicros(%v, %d) = %v, want %v", tc.sec, tc.n, got, tc.want)
		}
	}
}

func TestMs(t *testing.T) {
	if got := Ms(1500 * time.Microsecond); got != 1.5 {
		t.Errorf("Ms(1.5ms) = %v", got)
	}
}

func TestCPUDelta(t *testing.T) {
	before := map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: time.Second}
	after := map[int]time.Duration{1: 3 * time.Second, 2: 2 * time.Second, 4: 500 * time.Millisecond}
	// pid 1 used 2s, pid 2 nothing, pid 4 started during the phase (0.5s), pid 3 exited.
	if got, want := CPUDelta(before, after), 2500*time.Millisecond; got != want {
		t.Errorf("CPUDelta = %v, want %v", got, want)
	}
}

func TestParseProcStat(t *testing.T) {
	// utime (field 14) 150 ticks and stime (field 15) 50: 2 s at 100 ticks/s.
	tail := " S 1 2 3 4 5 6 7 8 9 10 150 50 0 0 20 0 1 0 100 1000 10"
	for _, tc := range []struct {
		name, stat string
		want       time.Duration
		err        string
	}{
		{"plain", "1234 (postgres)" + tail, 2 * time.Second, ""},
		{"command with spaces and parentheses", "1234 (postgres: idle (x))" + tail, 2 * time.Second, ""},
		{"no command", "1234 postgres" + tail, 0, "malformed"},
		{"short", "1234 (postgres) S 1 2 3", 0, "short"},
		{"not a number", "1234 (postgres) S 1 2 3 4 5 6 7 8 9 10 x 50 0", 0, "/proc stat"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseProcStat([]byte(tc.stat))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want one containing %q", err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("ParseProcStat = %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}

func TestParseKB(t *testing.T) {
	status := []byte("Name:\tbench\nVmPeak:\t  900 kB\nVmHWM:\t   43008 kB\nVmRSS:\t 40000 kB\n")
	if got, err := ParseKB(status, "VmHWM"); err != nil || got != 43008 {
		t.Errorf("ParseKB(VmHWM) = %d, %v", got, err)
	}
	if _, err := ParseKB(status, "MemTotal"); err == nil {
		t.Error("ParseKB found a field that is not there")
	}
	if _, err := ParseKB([]byte("VmHWM: lots kB\n"), "VmHWM"); err == nil {
		t.Error("ParseKB accepted a non-number")
	}
}

func TestCPUModel(t *testing.T) {
	info := []byte("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nprocessor\t: 1\nmodel name\t: other\n")
	if got := CPUModel(info); got != "AMD EPYC 7B13" {
		t.Errorf("CPUModel = %q", got)
	}
	if got := CPUModel([]byte("processor: 0\n")); got != "" {
		t.Errorf("CPUModel without a model = %q", got)
	}
}

func TestSelfCPUAndPeakRSSReadThisProcess(t *testing.T) {
	if _, err := SelfCPU(); err != nil {
		t.Fatal(err)
	}
	rss, err := PeakRSS()
	if err != nil {
		t.Fatal(err)
	}
	if rss < 1<<20 {
		t.Errorf("PeakRSS = %d bytes, less than 1 MiB", rss)
	}
}

func TestBetween(t *testing.T) {
	t0 := time.Unix(100, 0)
	start := Sample{At: t0, CPU: time.Second, Backends: map[int]time.Duration{7: time.Second}}
	end := Sample{At: t0.Add(3 * time.Second), CPU: 2500 * time.Millisecond, Backends: map[int]time.Duration{7: 2 * time.Second, 8: time.Second}}
	got := Between(start, end)
	want := Measurement{Elapsed: 3 * time.Second, ProcCPU: 1500 * time.Millisecond, PGCPU: 2 * time.Second}
	if got != want {
		t.Errorf("Between = %+v, want %+v", got, want)
	}
}

func TestTakeReadsThisProcessAsABackend(t *testing.T) {
	s, err := Take([]int{os.Getpid(), -1})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := s.Backends[os.Getpid()]; !ok {
		t.Error("Take skipped a readable pid")
	}
	if _, ok := s.Backends[-1]; ok {
		t.Error("Take read a pid that does not exist")
	}
}
