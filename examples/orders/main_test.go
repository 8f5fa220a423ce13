package main

import (
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/natstest"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/testenv"
)

// The README shows this program; it must show it as it is.
func TestREADMEShowsThisProgram(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	// From the import block to the end: the package comment is for the repository.
	body := string(src[strings.Index(string(src), "import ("):])
	if !strings.Contains(string(readme), body) {
		t.Fatal("README.md's \"Use idem in your service\" does not show examples/orders/main.go from its import block on; copy it over")
	}
}

// The README's program works as a new user would run it: a retried request and its
// message fold into one order and one shipment.
func TestTheProgramShipsEachOrderOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the example")
	}
	t.Parallel()
	db := pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
	broker := natstest.Start(t)
	bin := filepath.Join(t.TempDir(), "orders")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+db.URL, "NATS_URL="+broker.URL(), "ADDR="+addr)
	var logs strings.Builder
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	testenv.Eventually(t, 45*time.Second, "the service to be ready", func() bool {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	post := func(key string) *http.Response {
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/orders", strings.NewReader(`{"item":"teapot"}`))
		req.Header.Set(idem.HeaderKey, key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	k1, k2 := string(idem.NewKey()), string(idem.NewKey())
	if r := post(k1); r.StatusCode != http.StatusAccepted {
		t.Fatalf("first order: %d\n%s", r.StatusCode, logs.String())
	}
	if r := post(k1); r.StatusCode != http.StatusAccepted || r.Header.Get(idem.HeaderReplayed) != "true" {
		t.Fatalf("retried order: %d replayed=%q", r.StatusCode, r.Header.Get(idem.HeaderReplayed))
	}
	if r := post(k2); r.StatusCode != http.StatusAccepted {
		t.Fatalf("second order: %d", r.StatusCode)
	}
	testenv.Eventually(t, 45*time.Second, "two shipments", func() bool {
		return db.Count(t, `SELECT count(*) FROM shipments`) == 2
	})
	for _, k := range []string{k1, k2} {
		if n := db.Count(t, `SELECT count(*) FROM shipments WHERE key = $1`, k); n != 1 {
			t.Errorf("shipments for %s = %d, want 1", k, n)
		}
		if n := db.Count(t, `SELECT count(*) FROM orders WHERE key = $1`, k); n != 1 {
			t.Errorf("orders for %s = %d, want 1", k, n)
		}
	}
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Errorf("exit after SIGINT: %v\n%s", err, logs.String())
	}
}
