package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/natstest"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/runenv"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/refapp"
)

func TestUsageAndBadFlags(t *testing.T) {
	t.Parallel()
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"help"}, 0, "worker dead-letters replay"},
		{[]string{"frobnicate"}, 1, `unknown subcommand "frobnicate"`},
		{[]string{"--log-format", "xml"}, 1, "--log-format must be text or json"},
		{[]string{"--roles", "ingress,cook"}, 1, `unknown role "cook"`},
		{[]string{"dead-letters"}, 1, "want list or replay"},
		{[]string{"--ack-wait", "soon"}, 1, "want a positive duration"},
		{[]string{"--ack-wait", "-5s"}, 1, "want a positive duration"},
		{[]string{"--reconcile-after", "later"}, 1, "--reconcile-after: want a positive duration such as 5m, or off"},
		{[]string{"--reconcile-after", "0s"}, 1, "--reconcile-after: want a positive duration"},
		{[]string{"migrate", "--schema", "Bad-Name"}, 1, "lower-case identifier"},
		{[]string{"dead-letters", "replay"}, 1, "dead-letters replay: want"}, // admin.go is being reworded (ID or filter)
	}
	for _, tc := range cases {
		var out, errb bytes.Buffer
		code := run(tc.args, &out, &errb)
		if code != tc.code || !strings.Contains(errb.String()+out.String(), tc.want) {
			t.Errorf("run(%q) = %d, output %q; want %d and %q", tc.args, code, errb.String(), tc.code, tc.want)
		}
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// The real binary under load: SIGTERM stops fetching, lets in-flight batches commit
// and ack, and exits 0. A second worker then finishes the rest; every key once.
func TestSIGTERMUnderLoadExitsZeroAndLosesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the worker binary")
	}
	t.Parallel()
	db := pgtest.New(t)
	bin := filepath.Join(t.TempDir(), "worker")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	const n = 5000
	ctx := context.Background()
	if err := refapp.Migrate(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		msgs := make([]idem.Message, n)
		for i := range msgs {
			msgs[i] = idem.Message{Key: fmt.Sprintf("term-%05d", i), Subject: refapp.SubjectCharge,
				Payload: fmt.Appendf(nil, `{"account":"acct_term","amount_cents":%d}`, i+1)}
		}
		return ob.Enqueue(ctx, tx, msgs...)
	})
	if err != nil {
		t.Fatal(err)
	}
	dataDir := t.TempDir()
	start := func(extra ...string) (*exec.Cmd, *bytes.Buffer) {
		cmd := exec.Command(bin, append([]string{"--database-url", db.URL, "--data-dir", dataDir, "--http-addr", freeAddr(t)}, extra...)...)
		var logs bytes.Buffer
		cmd.Stderr = &logs
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill() })
		return cmd, &logs
	}

	first, logs := start()
	testenv.Eventually(t, 60*time.Second, "the first worker to process some charges", func() bool {
		return db.Count(t, `SELECT count(*) FROM ledger_entries`) > 0
	})
	if err := first.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	err = first.Wait()
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) || err != nil {
		t.Fatalf("worker exit after SIGTERM: %v\n%s", err, logs.String())
	}
	if !strings.Contains(logs.String(), "worker stopped") {
		t.Fatalf("no clean stop in the logs:\n%s", logs.String())
	}
	midway := db.Count(t, `SELECT count(*) FROM ledger_entries`)
	if midway == 0 || midway >= n {
		t.Fatalf("ledger rows at SIGTERM: %d of %d; the signal did not land mid-stream, so this run proves nothing", midway, n)
	}
	t.Logf("ledger rows at SIGTERM: %d of %d", midway, n)

	second, logs2 := start("--ack-wait", "7s")
	testenv.Eventually(t, 90*time.Second, "the second worker to finish", func() bool {
		return db.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'charges'`) == n
	})
	// --ack-wait reached the durable consumer (the embedded server's URL is in the
	// data dir while the worker runs).
	url, err := os.ReadFile(filepath.Join(dataDir, runenv.NATSURLFile))
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(strings.TrimSpace(string(url)))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	jc, err := js.Consumer(ctx, refapp.StreamName, refapp.ChargeConsumer)
	if err != nil {
		t.Fatal(err)
	}
	if got := jc.CachedInfo().Config.AckWait; got != 7*time.Second {
		t.Errorf("charges consumer AckWait = %v, want 7s from --ack-wait", got)
	}
	_ = second.Process.Signal(syscall.SIGTERM)
	if err := second.Wait(); err != nil {
		t.Errorf("second worker: %v", err)
	}
	if got := db.Count(t, `SELECT count(*) FROM ledger_entries`); got != n {
		sc := bufio.NewScanner(logs2)
		for sc.Scan() {
			t.Log(sc.Text())
		}
		t.Fatalf("ledger rows = %d, want %d", got, n)
	}
	if got := db.Count(t, `SELECT count(DISTINCT idempotency_key) FROM ledger_entries`); got != n {
		t.Fatalf("distinct keys = %d, want %d", got, n)
	}
	_ = os.Remove(bin)
}

// The shipped binary cannot arm fault points: IDEM_FAULTS (which could switch the
// inbox claim off) is refused before anything connects.
func TestShippedWorkerRefusesFaultPoints(t *testing.T) {
	t.Setenv(faults.EnvVar, string(faults.SkipInboxClaim)+"=on")
	var out, errb bytes.Buffer
	code := run([]string{"--database-url", "postgres://nobody@127.0.0.1:1/none", "--data-dir", t.TempDir()}, &out, &errb)
	if code == 0 || !strings.Contains(errb.String(), "built without fault injection") {
		t.Fatalf("run with %s set = %d, %q; want a refusal", faults.EnvVar, code, errb.String())
	}
}

// migrate --print writes the SQL of both schemas without connecting; a schema option
// places idem's tables.
func TestMigratePrint(t *testing.T) {
	t.Parallel()
	var out, errb bytes.Buffer
	if code := run([]string{"migrate", "--print", "--schema", "billing", "--database-url", "postgres://nobody@127.0.0.1:1/none"}, &out, &errb); code != 0 {
		t.Fatalf("migrate --print = %d: %s", code, errb.String())
	}
	for _, want := range []string{`CREATE SCHEMA IF NOT EXISTS "billing"`, "CREATE TABLE IF NOT EXISTS idem_outbox", "CREATE TABLE IF NOT EXISTS ledger_entries"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("migrate --print lacks %q", want)
		}
	}
}

// --no-migrate on a database nobody migrated is a clear error at start, naming the
// way out, not failed statements later.
func TestNoMigrateOnAnEmptyDatabase(t *testing.T) {
	t.Parallel()
	db := pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
	var out, errb bytes.Buffer
	code := run([]string{"--no-migrate", "--database-url", db.URL, "--data-dir", t.TempDir(), "--http-addr", freeAddr(t)}, &out, &errb)
	if code == 0 || !strings.Contains(errb.String(), "worker migrate") {
		t.Fatalf("run --no-migrate on an empty database = %d, %q; want an error naming `worker migrate`", code, errb.String())
	}
}

// Earlier versions kept the data dir in ./idem-data; a worker started where one is
// left says that it now uses another, and how to keep the old one.
func TestWarnsAboutTheDataDirOfAnEarlierVersion(t *testing.T) {
	state := t.TempDir()
	t.Setenv("XDG_STATE_HOME", state) // rules out t.Parallel
	t.Setenv("IDEM_DATA_DIR", "")
	t.Chdir(t.TempDir())
	if err := os.Mkdir("idem-data", 0o700); err != nil {
		t.Fatal(err)
	}
	dead := "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable"
	var out, errb bytes.Buffer
	if code := run([]string{"--database-url", dead, "--http-addr", freeAddr(t)}, &out, &errb); code == 0 {
		t.Fatal("started without a database")
	}
	mustContain(t, "stderr", errb.String(), "data dir of an earlier version", "idem-data", filepath.Join(state, "idem"), "--data-dir")

	errb.Reset()
	run([]string{"--database-url", dead, "--http-addr", freeAddr(t), "--data-dir", "idem-data"}, &out, &errb)
	if strings.Contains(errb.String(), "earlier version") {
		t.Errorf("warned although --data-dir was given:\n%s", errb.String())
	}
}

// A worker that loses a part exits non-zero, so that a supervisor with
// restart-on-failure restarts it (it used to exit 0). Here the charges consumer
// cannot take over a durable consumer someone else created with another ack policy.
func TestComponentFailureExitsNonZero(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	broker := natstest.Start(t)
	nc, err := nats.Connect(broker.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx := context.Background()
	if _, err := outbox.EnsureStream(ctx, js, outbox.StreamConfig{Name: refapp.StreamName, Subjects: []string{refapp.StreamSubjects}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateConsumer(ctx, refapp.StreamName, jetstream.ConsumerConfig{Durable: refapp.ChargeConsumer, AckPolicy: jetstream.AckNonePolicy}); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	done := make(chan int, 1)
	go func() {
		done <- run([]string{"--database-url", db.URL, "--nats-url", broker.URL(), "--data-dir", t.TempDir(), "--http-addr", freeAddr(t)}, &out, &errb)
	}()
	select {
	case code := <-done:
		if code == 0 || !strings.Contains(errb.String(), "consumer charges") {
			t.Fatalf("exit %d, stderr:\n%s\nwant non-zero naming the failed consumer", code, errb.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the worker kept running without its charges consumer")
	}
}

// --version prints the build and exits 0 without connecting anywhere.
func TestVersion(t *testing.T) {
	t.Parallel()
	var out, errb bytes.Buffer
	if code := run([]string{"--version", "--database-url", "postgres://nobody@127.0.0.1:1/none"}, &out, &errb); code != 0 {
		t.Fatalf("--version = %d: %s", code, errb.String())
	}
	if !strings.HasPrefix(out.String(), "idem ") || !strings.Contains(out.String(), runtime.Version()) {
		t.Errorf("--version printed %q, want \"idem <version> (<revision>, <go version>)\"", out.String())
	}
}
