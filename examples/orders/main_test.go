package main

import (
	"errors"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
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
	// From the package line to the end: the package comment is for the repository.
	body := string(src[strings.Index(string(src), "package main"):])
	if !strings.Contains(string(readme), body) {
		t.Fatal("README.md's \"Use idem in your service\" does not show examples/orders/main.go from its package line on; copy it over")
	}
}

// The README's install line says which Go the module needs (go.mod's go line).
func TestREADMENamesTheGoVersion(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	mod, err := os.ReadFile(filepath.Join("..", "..", "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(mod)
	if m == nil {
		t.Fatal("go.mod has no go line")
	}
	install := regexp.MustCompile("go get github.com/idemkit/idem@latest[^\n]*").Find(readme)
	if want := "Go " + string(m[1]); !strings.Contains(string(install), want) {
		t.Errorf("README's install line %q does not say %q, which go.mod requires", install, want)
	}
}

// The README's program works as a new user would run it: a retried request and its
// message fold into one order and one shipment; the pool is sized so that the
// worker does not warn; SIGTERM, what a supervisor sends, stops it cleanly.
func TestTheProgramShipsEachOrderOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the example")
	}
	t.Parallel()
	db, _, addr, p := startReady(t)
	post := func(key string) *http.Response { return postOrder(t, addr, key) }
	k1, k2 := string(idem.NewKey()), string(idem.NewKey())
	if r := post(k1); r.StatusCode != http.StatusAccepted {
		t.Fatalf("first order: %d\n%s", r.StatusCode, p.logs())
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
	if strings.Contains(p.logs(), "MaxConns") {
		t.Errorf("the worker warned about the pool:\n%s", p.logs())
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := p.wait(45 * time.Second); err != nil {
		t.Errorf("exit after SIGTERM: %v\n%s", err, p.logs())
	}
}

// A part of the worker that fails ends the program, non-zero and naming it, rather
// than leaving a process that answers requests whose messages nothing consumes.
func TestTheProgramExitsWhenTheWorkerFails(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the example")
	}
	t.Parallel()
	db := pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
	broker := natstest.Start(t)
	// Someone else's durable consumer under the program's consumer name, with an
	// ack policy that cannot be changed: the program's consumer fails on it.
	nc, err := nats.Connect(broker.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateConsumer(t.Context(), "ORDERS", jetstream.ConsumerConfig{Durable: "shipping", AckPolicy: jetstream.AckNonePolicy}); err != nil {
		t.Fatal(err)
	}
	p := start(t, "DATABASE_URL="+db.URL, "NATS_URL="+broker.URL(), "ADDR=127.0.0.1:0")
	err = p.wait(60 * time.Second)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() == 0 || !strings.Contains(p.logs(), "consumer shipping") {
		t.Fatalf("the program with a failed consumer: %v, want a non-zero exit naming consumer shipping\n%s", err, p.logs())
	}
}

// Without ADDR the program listens on loopback only. The test holds 127.0.0.1:8080
// (or finds it held), so the program's listen fails and says on which address it
// tried, without reaching beyond this machine or keeping the port.
func TestTheProgramListensOnLoopbackByDefault(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the example")
	}
	t.Parallel()
	db := pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
	broker := natstest.Start(t)
	if l, err := net.Listen("tcp", "127.0.0.1:8080"); err == nil {
		defer l.Close()
	}
	p := start(t, "DATABASE_URL="+db.URL, "NATS_URL="+broker.URL())
	err := p.wait(60 * time.Second)
	if err == nil || !strings.Contains(p.logs(), "listen tcp 127.0.0.1:8080") {
		t.Fatalf("the program without ADDR: %v, want it to have tried 127.0.0.1:8080\n%s", err, p.logs())
	}
}

// While the broker is away the program stays ready and takes orders into the
// outbox, and says so in its log; the orders are shipped once the broker is back.
// Its connection keeps reconnecting (nats.MaxReconnects(-1)), so an outage of any
// length never ends it.
func TestTheProgramTakesOrdersWhileTheBrokerIsAway(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the example")
	}
	t.Parallel()
	db, broker, addr, p := startReady(t)

	broker.Stop()
	testenv.Eventually(t, 20*time.Second, "a log line on the disconnect", func() bool {
		return strings.Contains(p.logs(), "nats: disconnected from the broker")
	})
	if !ready(addr) {
		t.Errorf("/readyz fails while the broker is away, though the ingress takes orders\n%s", p.logs())
	}
	key := string(idem.NewKey())
	if r := postOrder(t, addr, key); r.StatusCode != http.StatusAccepted {
		t.Fatalf("an order while the broker is away: %d, want 202\n%s", r.StatusCode, p.logs())
	}
	broker.Restart(t)
	testenv.Eventually(t, 45*time.Second, "the order shipped once the broker is back", func() bool {
		return db.Count(t, `SELECT count(*) FROM shipments WHERE key = $1`, key) == 1
	})
	if !strings.Contains(p.logs(), "nats: reconnected to the broker") {
		t.Errorf("no log line on the reconnect:\n%s", p.logs())
	}
}

// An unset NATS_URL (or DATABASE_URL) is refused, naming the variable: nats.Connect
// would otherwise go to whatever listens on localhost:4222, someone else's broker
// perhaps, and create the program's stream there.
func TestTheProgramRefusesAnUnsetServer(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the example")
	}
	t.Parallel()
	db := pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
	for _, tc := range []struct{ env, name string }{
		{"DATABASE_URL=" + db.URL, "NATS_URL"},
		{"NATS_URL=nats://127.0.0.1:1", "DATABASE_URL"},
	} {
		p := start(t, tc.env, tc.name+"=", "ADDR=127.0.0.1:0")
		err := p.wait(60 * time.Second)
		if err == nil || !strings.Contains(p.logs(), tc.name+" is not set") {
			t.Errorf("the program without %s: %v, want it refused by name\n%s", tc.name, err, p.logs())
		}
	}
}

// startReady runs the program on a database and a broker of its own, listening on
// addr, and waits until it is ready.
func startReady(t *testing.T) (db *pgtest.DB, broker *natstest.Server, addr string, p *process) {
	t.Helper()
	db = pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
	broker = natstest.Start(t)
	addr = freeAddr(t)
	p = start(t, "DATABASE_URL="+db.URL, "NATS_URL="+broker.URL(), "ADDR="+addr)
	testenv.Eventually(t, 45*time.Second, "the service to be ready", func() bool { return ready(addr) })
	return db, broker, addr, p
}

// freeAddr is a loopback address nothing listens on, for the program's ADDR.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// ready reports whether the program at addr answers /readyz with 200.
func ready(addr string) bool {
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// postOrder posts an order with key to the program at addr.
func postOrder(t *testing.T, addr, key string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/orders", strings.NewReader(`{"item":"teapot"}`))
	req.Header.Set(idem.HeaderKey, key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp
}

// build compiles the program once for every test that runs it.
var build = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "orders-")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "orders")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		return "", errors.New("go build: " + err.Error() + "\n" + string(out))
	}
	return bin, nil
})

func TestMain(m *testing.M) {
	code := m.Run()
	if bin, err := build(); err == nil {
		os.RemoveAll(filepath.Dir(bin))
	}
	os.Exit(code)
}

// process is the program running with the environment a test gave it.
type process struct {
	cmd  *exec.Cmd
	mu   sync.Mutex
	out  strings.Builder
	done chan error
}

func (p *process) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.Write(b)
}

func (p *process) logs() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// wait returns the program's exit, or an error when it is still running after d.
func (p *process) wait(d time.Duration) error {
	select {
	case err := <-p.done:
		p.done <- err
		return err
	case <-time.After(d):
		return errors.New("still running after " + d.String())
	}
}

// start runs the program with env on top of this process's environment, less ADDR,
// and kills it at cleanup if it is still running.
func start(t *testing.T, env ...string) *process {
	t.Helper()
	bin, err := build()
	if err != nil {
		t.Fatal(err)
	}
	p := &process{cmd: exec.Command(bin), done: make(chan error, 1)}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "ADDR=") {
			p.cmd.Env = append(p.cmd.Env, kv)
		}
	}
	p.cmd.Env = append(p.cmd.Env, env...)
	p.cmd.Stdout, p.cmd.Stderr = p, p
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		_ = p.wait(10 * time.Second)
	})
	return p
}
