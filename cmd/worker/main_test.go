package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/runenv"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestUsageAndBadFlags(t *testing.T) {
	t.Parallel()
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"help"}, 0, "worker dead-letters replay"},
		{[]string{"frobnicate"}, 2, `unknown subcommand "frobnicate"`},
		{[]string{"--log-format", "xml"}, 2, "--log-format must be text or json"},
		{[]string{"--roles", "ingress,cook"}, 2, `unknown role "cook"`},
		{[]string{"dead-letters"}, 2, "want list or replay"},
		{[]string{"dead-letters", "frob"}, 2, `unknown subcommand "frob"`},
		{[]string{"dead-letters", "-h"}, 0, "--dry-run"},
		{[]string{"--ack-wait", "soon"}, 2, "want a positive duration"},
		{[]string{"--ack-wait", "-5s"}, 2, "want a positive duration"},
		{[]string{"--reconcile-after", "later"}, 2, "--reconcile-after: want a positive duration such as 5m, or off"},
		{[]string{"--reconcile-after", "0s"}, 2, "--reconcile-after: want a positive duration"},
		{[]string{"--no-such-flag"}, 2, "flag provided but not defined: -no-such-flag"},
		{[]string{"stats", "--no-such-flag"}, 2, "flag provided but not defined: -no-such-flag"},
		{[]string{"stats", "extra"}, 2, "unexpected arguments"},
		{[]string{"inspect"}, 2, "want exactly one KEY"},
		{[]string{"healthcheck", "extra"}, 2, "unexpected arguments"},
		{[]string{"migrate", "--print", "--json"}, 2, "give one of --print and --json"},
		{[]string{"migrate", "--schema", "Bad-Name"}, 2, "lower-case identifier"},
		{[]string{"dead-letters", "replay"}, 2, "dead-letters replay: want"},
		{[]string{"--smtp-url", "smtp+insecure://u:pw@h:25"}, 2, "takes no credentials"},
		{[]string{"--smtp-url", "smtp://h:25", "--smtp-addr", "h:25"}, 2, "not both"},
		{[]string{"--smtp-ca", "/nonexistent"}, 2, "--smtp-ca (IDEM_SMTP_CA) needs --smtp-url"},
		{[]string{"--smtp-url", "smtp://h:587", "--smtp-ca", "/nonexistent/ca.pem"}, 1, "--smtp-ca"},
		{[]string{"--smtp-url", "ftp://u:hunter2@h"}, 2, "scheme must be smtp"},
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
	bin := workerBinary(t)
	const n = 5000
	ctx := context.Background()
	if err := refapp.Migrate(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	ob := tablesOnlyOutbox(t, db, "")
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
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

// Earlier versions kept the data dir in ./idem-data. A worker started where one
// is left, with no data dir named, refuses to start on the new default (an empty
// database and stream), naming both places and the ways out; naming one starts.
func TestRefusesToStartBesideTheDataDirOfAnEarlierVersion(t *testing.T) {
	state := t.TempDir()
	t.Setenv("XDG_STATE_HOME", state) // rules out t.Parallel
	t.Setenv("IDEM_DATA_DIR", "")
	cwd := t.TempDir()
	t.Chdir(cwd)
	if err := os.Mkdir("idem-data", 0o700); err != nil {
		t.Fatal(err)
	}
	old, def := filepath.Join(cwd, "idem-data"), filepath.Join(state, "idem")
	dead := "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable"
	var out, errb bytes.Buffer
	if code := run([]string{"--database-url", dead, "--http-addr", freeAddr(t)}, &out, &errb); code != exitError {
		t.Fatalf("exit %d, want %d", code, exitError)
	}
	mustContain(t, "stderr", errb.String(), "data dir of an earlier version", old, def, "--data-dir "+old, "IDEM_DATA_DIR", "mv "+old+" "+def)
	if strings.Contains(errb.String(), "no Postgres answers") {
		t.Errorf("went on to connect:\n%s", errb.String())
	}
	if _, err := os.Stat(def); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the default data dir was created (%v)", err)
	}

	for _, named := range [][]string{{"--data-dir", "idem-data"}, {"--data-dir", t.TempDir()}} {
		errb.Reset()
		run(append([]string{"--database-url", dead, "--http-addr", freeAddr(t)}, named...), &out, &errb)
		if strings.Contains(errb.String(), "earlier version") || !strings.Contains(errb.String(), "no Postgres answers") {
			t.Errorf("with %q: %s; want it to start (and fail on the database nobody runs)", named, errb.String())
		}
	}
	t.Setenv("IDEM_DATA_DIR", t.TempDir())
	errb.Reset()
	run([]string{"--database-url", dead, "--http-addr", freeAddr(t)}, &out, &errb)
	if strings.Contains(errb.String(), "earlier version") {
		t.Errorf("refused although IDEM_DATA_DIR was set:\n%s", errb.String())
	}
}

// A worker that loses a part exits non-zero, so that a supervisor with
// restart-on-failure restarts it (not 0). Here the charges consumer
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
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: refapp.StreamName, Subjects: []string{refapp.StreamSubjects}}); err != nil {
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

// noEnv is an empty environment.
func noEnv(string) string { return "" }

// envOf is an environment holding vars.
func envOf(vars map[string]string) func(string) string {
	return func(name string) string { return vars[name] }
}

// commandFlagSet builds the flags of the command at path, and no other's.
func commandFlagSet(t *testing.T, path string, getenv func(string) string) *flagSet {
	t.Helper()
	var r runner = rootCommand()
	for _, w := range strings.Fields(path) {
		g := r.(group)
		r = nil
		for _, s := range g.subs {
			if s.word() == w {
				r = s
			}
		}
		if r == nil {
			t.Fatalf("no command %q", path)
		}
	}
	if g, ok := r.(group); ok {
		r = g.dflt
	}
	cs := r.commands(getenv)
	if len(cs) != 1 || cs[0].path != path {
		t.Fatalf("command %q: found %v", path, cs)
	}
	return cs[0].fs
}

// splitCommand finds the subcommand among the flags: before, after or between
// them, skipping the values of the flags that take one, of whichever command.
func TestSplitCommand(t *testing.T) {
	t.Parallel()
	root := rootCommand()
	all := unionFlags(root.commands(noEnv))
	for _, tc := range []struct {
		args     []string
		cmd      string
		rest     []string
		wantNone bool
	}{
		{[]string{"stats"}, "stats", []string{}, false},
		{[]string{"stats", "--json"}, "stats", []string{"--json"}, false},
		{[]string{"--database-url", "postgres://x", "stats"}, "stats", []string{"--database-url", "postgres://x"}, false},
		{[]string{"--database-url=postgres://x", "stats", "--json"}, "stats", []string{"--database-url=postgres://x", "--json"}, false},
		{[]string{"--schema", "stats", "inspect", "k"}, "inspect", []string{"--schema", "stats", "k"}, false},
		{[]string{"--no-migrate", "migrate"}, "migrate", []string{"--no-migrate"}, false},
		{[]string{"--json", "stats"}, "stats", []string{"--json"}, false}, // a subcommand's bool flag before it
		{[]string{"--scope=acme", "inspect", "k"}, "inspect", []string{"--scope=acme", "k"}, false},
		{[]string{"--scope", "acme", "inspect", "k"}, "inspect", []string{"--scope", "acme", "k"}, false}, // a subcommand's flag with its value before it
		{[]string{"-database-url", "u", "dead-letters", "list"}, "dead-letters", []string{"-database-url", "u", "list"}, false},
		{[]string{"--http-addr", "h:1"}, "", nil, true},
		{[]string{"--", "stats"}, "", nil, true},
		{[]string{"--bogus", "value"}, "", nil, true}, // left to the flag parser: "flag provided but not defined"
		{[]string{"frob"}, "frob", []string{}, false},
	} {
		cmd, rest := splitCommand(tc.args, all, root.words())
		if tc.wantNone {
			if cmd != "" || !slices.Equal(rest, tc.args) {
				t.Errorf("splitCommand(%q) = %q, %q; want no subcommand and the args as they were", tc.args, cmd, rest)
			}
			continue
		}
		if cmd != tc.cmd || !slices.Equal(rest, tc.rest) {
			t.Errorf("splitCommand(%q) = %q, %q; want %q, %q", tc.args, cmd, rest, tc.cmd, tc.rest)
		}
	}
}

// Every flag of the service (but --version) names its environment variable in
// --help, and every flag with a variable, of any command, names it in that
// command's -h. Each command reads each of its variables, and reads it once:
// set, it becomes the flag's default.
func TestHelpNamesEveryEnvironmentVariable(t *testing.T) {
	t.Parallel()
	var out, errb bytes.Buffer
	if code := runEnv([]string{"--help"}, noEnv, &out, &errb); code != 0 {
		t.Fatalf("--help = %d", code)
	}
	help := errb.String()
	mustContain(t, "--help", help, "Exit status:", "0  success", "1  error", "2  usage error", "before or after the subcommand",
		"XDG_STATE_HOME", "dead-letters replay", "--dry-run", "--consumer C", "--reason PREFIX", "--since T", "takes only the flags it uses")
	envName := regexp.MustCompile(`\(env ([A-Z_]+)`)
	for _, c := range rootCommand().commands(noEnv) {
		var cmdHelp bytes.Buffer
		runEnv(append(strings.Fields(c.path), "-h"), noEnv, io.Discard, &cmdHelp)
		c.fs.VisitAll(func(f *flag.Flag) {
			env, ok := c.fs.envOf[f.Name]
			if !ok {
				if c.path == "" && f.Name != "version" {
					t.Errorf("the service's --%s has no environment variable", f.Name)
				}
				return
			}
			if m := envName.FindStringSubmatch(f.Usage); m == nil || m[1] != env {
				t.Errorf("%s --%s falls back to %s, but its usage says %q", commandName(c.path), f.Name, env, f.Usage)
			}
			if !strings.Contains(cmdHelp.String(), "(env "+env) {
				t.Errorf("%s -h lacks %s (of --%s)", commandName(c.path), env, f.Name)
			}
			value := map[string]string{"shutdown-timeout": "17s", "ack-wait": "7s", "no-migrate": "1", "console": "1", "console-allow-plain-http": "1", "atomic-publish": "1"}[f.Name]
			if value == "" {
				value = "from-env-" + f.Name
			}
			reads := map[string]int{}
			getenv := func(name string) string {
				reads[name]++
				if name == env {
					return value
				}
				return ""
			}
			fs := commandFlagSet(t, c.path, getenv)
			if got := fs.Lookup(f.Name).Value.String(); got == f.DefValue {
				t.Errorf("%s=%s left %s --%s at its default %q: the variable is not read", env, value, commandName(c.path), f.Name, got)
			}
			if reads[env] != 1 {
				t.Errorf("%s reads %s %d times building its flags, want once", commandName(c.path), env, reads[env])
			}
		})
	}
}

// Flags work before and after the subcommand, and every subcommand that prints
// prints JSON with --json: stats, migrate, dead-letters list and replay,
// healthcheck. --version works anywhere.
func TestFlagsAroundSubcommandAndJSON(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	parses := func(t *testing.T, name, out string, lines bool) {
		t.Helper()
		if lines {
			for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
				if l != "" && !json.Valid([]byte(l)) {
					t.Errorf("%s: line %q is not JSON", name, l)
				}
			}
			return
		}
		if !json.Valid([]byte(out)) {
			t.Errorf("%s: output is not one JSON document:\n%s", name, out)
		}
	}
	// migrate --json first (the other commands want the application's tables),
	// flags before it; again, with nothing left to apply.
	for _, args := range [][]string{{"--database-url", db.URL, "migrate", "--json"}, {"migrate", "--json", "--database-url", db.URL}} {
		out, errs, code := worker(t, args...)
		var applied struct{ Applied *[]string }
		if code != 0 || json.Unmarshal([]byte(out), &applied) != nil || applied.Applied == nil {
			t.Fatalf("%q: exit %d, stdout %q, stderr %s; want {\"applied\":[...]}", args, code, out, errs)
		}
	}
	if out, _, code := worker(t, "migrate", "--json", "--database-url", db.URL); code != 0 || strings.TrimSpace(out) != `{"applied":[]}` {
		t.Errorf("migrate --json on an up-to-date schema: exit %d, %q; want {\"applied\":[]}", code, out)
	}

	for _, tc := range []struct {
		name  string
		args  []string
		lines bool // JSON lines rather than one document
	}{
		{"stats, flags after", []string{"stats", "--json", "--database-url", db.URL, "--data-dir", t.TempDir()}, false},
		{"stats, flags before", []string{"--database-url", db.URL, "--data-dir", t.TempDir(), "stats", "--json"}, false},
		{"stats, --json before", []string{"--json", "--database-url", db.URL, "--data-dir", t.TempDir(), "stats"}, false},
		{"inspect, flags before", []string{"--database-url", db.URL, "inspect", "--json", "--scope", "t", "k-none"}, false},
		{"dead-letters list, flags before", []string{"--database-url", db.URL, "dead-letters", "list", "--json"}, true},
		{"dead-letters list, flags between", []string{"dead-letters", "--database-url", db.URL, "list", "--json"}, true},
		{"dead-letters replay dry run", []string{"--database-url", db.URL, "dead-letters", "replay", "--all", "--dry-run", "--json"}, true},
		{"dead-letters replay by filters", []string{"dead-letters", "replay", "--consumer", "charges", "--reason", "x", "--since", "1h", "--dry-run", "--json", "--database-url", db.URL}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, errs, code := worker(t, tc.args...)
			want := 0
			if strings.HasPrefix(tc.name, "inspect") {
				want = 1 // the key is unknown; the report is still printed
			}
			if code != want {
				t.Fatalf("%q: exit %d, stderr %s; want %d", tc.args, code, errs, want)
			}
			parses(t, tc.name, out, tc.lines)
		})
	}

	if out, _, code := worker(t, "stats", "--version"); code != 0 || !strings.HasPrefix(out, "idem ") {
		t.Errorf("stats --version: exit %d, %q; want the version", code, out)
	}
}

// healthcheck exits 0 when /readyz answers 200 and 1 otherwise; --json prints the
// status either way.
func TestHealthcheckJSON(t *testing.T) {
	t.Parallel()
	ready := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/readyz" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprintln(w, "ready")
	}))
	defer ready.Close()
	notReady := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "relay: not started", http.StatusServiceUnavailable)
	}))
	defer notReady.Close()
	host := func(s *httptest.Server) string { return strings.TrimPrefix(s.URL, "http://") }
	for _, tc := range []struct {
		name   string
		args   []string
		code   int
		ready  bool
		status int
		errSub string
	}{
		{"ready", []string{"healthcheck", "--json", "--http-addr", host(ready)}, 0, true, 200, ""},
		{"ready, flags before", []string{"--http-addr", host(ready), "healthcheck", "--json"}, 0, true, 200, ""},
		{"not ready", []string{"healthcheck", "--http-addr", host(notReady), "--json"}, 1, false, 503, "503"},
		{"unreachable", []string{"healthcheck", "--json", "--http-addr", freeAddr(t)}, 1, false, 0, "connect"},
	} {
		out, errs, code := worker(t, tc.args...)
		var st healthStatus
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Errorf("%s: stdout %q is not JSON: %v", tc.name, out, err)
			continue
		}
		if code != tc.code || st.Ready != tc.ready || st.HTTPStatus != tc.status || !strings.Contains(st.Error, tc.errSub) || !strings.HasSuffix(st.URL, "/readyz") {
			t.Errorf("%s: exit %d, %+v (stderr %s); want exit %d, ready %v, status %d, error with %q", tc.name, code, st, errs, tc.code, tc.ready, tc.status, tc.errSub)
		}
	}
	if out, _, code := worker(t, "healthcheck", "--http-addr", host(ready)); code != 0 || out != "" {
		t.Errorf("healthcheck without --json: exit %d, stdout %q; want 0 and nothing", code, out)
	}
}

// The SMTP flags: a password never reaches an error; --smtp-ca loads a PEM
// bundle, and refuses a file without one. (--smtp-addr's mapping onto
// smtp+insecure:// is in TestServiceConfig.)
func TestSMTPFlags(t *testing.T) {
	t.Parallel()
	for _, url := range []string{"smtp+insecure://u:hunter2@h:1", "ftp://u:hunter2@h", "smtp://u:hunter2@h:0", "smtp://u:hunter2@h\x01:1"} {
		_, errs, code := worker(t, "--smtp-url", url)
		if code != 2 || strings.Contains(errs, "hunter2") {
			t.Errorf("--smtp-url %q: exit %d, stderr %q; want 2 without the password", url, code, errs)
		}
	}
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := loadSMTPCA(ca); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Errorf("--smtp-ca with garbage: %v", err)
	}
}
