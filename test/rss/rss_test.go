// Package rss measures the worker's memory with large messages: the real worker
// binary, 1 MiB request bodies through its HTTP ingress, the relay and the charge
// consumer, and the peak resident set size the kernel reports for the process.
// Run it with `make rss` (it is skipped otherwise: it is a measurement, not a test
// of behaviour); the figures are in BENCHMARKS.md.
package rss

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestPeakRSS(t *testing.T) {
	if os.Getenv("IDEM_RSS") == "" {
		t.Skip("a measurement: run it with `make rss` (IDEM_RSS=1)")
	}
	// IDEM_RSS_BIN measures another build of the worker (another commit's, say).
	bin := os.Getenv("IDEM_RSS_BIN")
	if bin == "" {
		bin = filepath.Join(t.TempDir(), "worker")
		if out, err := exec.Command("go", "build", "-o", bin, "../../cmd/worker").CombinedOutput(); err != nil {
			t.Fatalf("go build: %v\n%s", err, out)
		}
	}
	n := 400
	if v := os.Getenv("IDEM_RSS_N"); v != "" {
		n, _ = strconv.Atoi(v)
	}
	for _, size := range []int{100, 1_000_000} {
		peak, took := measure(t, bin, n, size)
		fmt.Printf("rss: %d requests of %d bytes: worker peak RSS %d MiB (%s)\n", n, size, peak>>20, took.Round(time.Millisecond))
	}
}

// measure runs one worker, sends n payments of about size bytes with 16 clients,
// waits for every ledger row, and returns the worker's peak RSS in bytes.
func measure(t *testing.T, bin string, n, size int) (int64, time.Duration) {
	db := pgtest.New(t)
	if err := refapp.Migrate(context.Background(), db.Pool); err != nil {
		t.Fatal(err)
	}
	broker := natstest.Start(t)
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := l.Addr().String()
	l.Close()
	cmd := exec.Command(bin, "--database-url", db.URL, "--nats-url", broker.URL(), "--http-addr", addr, "--data-dir", t.TempDir(), "--log-level", "warn")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	testenv.Eventually(t, 60*time.Second, "the worker ready", func() bool {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	head, tail := `{"account":"`, `","amount_cents":1}`
	pad := strings.Repeat("a", max(1, size-len(head)-len(tail)-6))
	start := time.Now()
	var wg sync.WaitGroup
	next := make(chan int)
	for range 16 {
		wg.Go(func() {
			for i := range next {
				body := fmt.Sprintf("%s%s%06d%s", head, pad, i, tail)
				for {
					req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/v1/payments", strings.NewReader(body))
					req.Header.Set(idem.HeaderKey, fmt.Sprintf("k-%d-%d", size, i))
					resp, err := http.DefaultClient.Do(req)
					if err == nil {
						resp.Body.Close()
						if resp.StatusCode == http.StatusAccepted {
							break
						}
					}
					time.Sleep(10 * time.Millisecond) // 503 beyond the ingress's bound: retry, same key
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	testenv.Eventually(t, 10*time.Minute, "every charge in the ledger", func() bool {
		return db.Count(t, `SELECT count(*) FROM ledger_entries`) == n
	})
	return peakRSS(t, cmd.Process.Pid), time.Since(start)
}

// peakRSS reads VmHWM, the process's peak resident set size.
func peakRSS(t *testing.T, pid int) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM")
	return 0
}
