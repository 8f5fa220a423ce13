package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/client"
)

// fakeIngress stands in for cmd/worker's HTTP ingress: first request per (scope,
// key) executes and stores its response; repeats replay it with
// Idempotent-Replayed: true. While down is set it answers 503; reject makes it
// answer 422 to everything.
type fakeIngress struct {
	srv    *httptest.Server
	down   atomic.Bool
	reject atomic.Bool

	mu       sync.Mutex
	stored   map[string][]byte
	executed []execution
	requests int
	keys     []string // Idempotency-Key of every request, in order
}

type execution struct {
	path, key, scope string
	body             map[string]any
}

func newFakeIngress(t *testing.T) *fakeIngress {
	f := &fakeIngress{stored: map[string][]byte{}}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		defer f.mu.Unlock()
		f.requests++
		f.keys = append(f.keys, r.Header.Get(idem.HeaderKey))
		w.Header().Set("Content-Type", "application/json")
		switch {
		case f.down.Load():
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		case f.reject.Load():
			w.WriteHeader(http.StatusUnprocessableEntity)
			_, _ = w.Write([]byte(`{"error":"rejected"}`))
			return
		}
		key, scope := r.Header.Get(idem.HeaderKey), r.Header.Get(idem.HeaderScope)
		scoped := idem.ScopedKey(scope, idem.Key(key))
		if resp, ok := f.stored[scoped]; ok {
			w.Header().Set(idem.HeaderReplayed, "true")
			w.WriteHeader(http.StatusAccepted)
			_, _ = w.Write(resp)
			return
		}
		var body map[string]any
		_ = json.Unmarshal(raw, &body)
		f.executed = append(f.executed, execution{path: r.URL.Path, key: key, scope: scope, body: body})
		resp := fmt.Appendf(nil, `{"key":%q,"id":"id_%d"}`, key, len(f.executed))
		f.stored[scoped] = resp
		w.WriteHeader(http.StatusAccepted)
		_, _ = w.Write(resp)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeIngress) executions() []execution {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.executed)
}

func (f *fakeIngress) sentKeys() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.keys)
}

// runResult is what one invocation of the CLI produced.
type runResult struct {
	code   int
	lines  []map[string]json.RawMessage
	stderr string
}

// runT runs the CLI with IDEM_API and IDEM_JOURNAL pointing at the fake and a
// temporary journal, as a user's shell would.
func runT(t *testing.T, env map[string]string, args ...string) runResult {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(t.Context(), args, func(k string) string { return env[k] }, &stdout, &stderr)
	var lines []map[string]json.RawMessage
	sc := bufio.NewScanner(&stdout)
	for sc.Scan() {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("stdout line %q is not JSON: %v", sc.Text(), err)
		}
		lines = append(lines, m)
	}
	return runResult{code: code, lines: lines, stderr: stderr.String()}
}

func testEnv(t *testing.T, f *fakeIngress) map[string]string {
	return map[string]string{
		"IDEM_API":     f.srv.URL,
		"IDEM_JOURNAL": filepath.Join(t.TempDir(), "enqueue.journal"),
	}
}

func str(t *testing.T, raw json.RawMessage) string {
	t.Helper()
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		t.Fatalf("%s is not a string: %v", raw, err)
	}
	return s
}

func num(t *testing.T, raw json.RawMessage) int {
	t.Helper()
	var n int
	if err := json.Unmarshal(raw, &n); err != nil {
		t.Fatalf("%s is not a number: %v", raw, err)
	}
	return n
}

func TestCharge(t *testing.T) {
	f := newFakeIngress(t)
	r := runT(t, testEnv(t, f), "charge", "--account", "acct_1", "--amount-cents", "1250", "--scope", "tenant-a")
	if r.code != exitDone || len(r.lines) != 1 {
		t.Fatalf("exit %d, %d lines, stderr %q; want exit 0 and one line", r.code, len(r.lines), r.stderr)
	}
	l := r.lines[0]
	var fields []string
	for k := range l {
		fields = append(fields, k)
	}
	slices.Sort(fields)
	if want := []string{"attempts", "http_status", "key", "response", "status"}; !reflect.DeepEqual(fields, want) {
		t.Fatalf("line fields = %v, want exactly %v", fields, want)
	}
	key := str(t, l["key"])
	if str(t, l["status"]) != "done" || num(t, l["attempts"]) != 1 || num(t, l["http_status"]) != 202 {
		t.Fatalf("line = %v", l)
	}
	var resp struct{ Key, ID string }
	if err := json.Unmarshal(l["response"], &resp); err != nil || resp.Key != key {
		t.Fatalf("response %s is not the server's JSON for key %s (%v)", l["response"], key, err)
	}
	ex := f.executions()
	want := execution{path: "/v1/payments", key: key, scope: "tenant-a", body: map[string]any{"account": "acct_1", "amount_cents": 1250.0}}
	if len(ex) != 1 || !reflect.DeepEqual(ex[0], want) {
		t.Fatalf("executions = %+v, want [%+v]", ex, want)
	}
}

func TestEmailFlagsBeforeAndAfterCommand(t *testing.T) {
	f := newFakeIngress(t)
	env := testEnv(t, f)
	api := env["IDEM_API"]
	delete(env, "IDEM_API") // the flag, not the environment, must carry the URL
	r := runT(t, env, "--api", api, "email", "--to", "a@example.com", "--subject", "hi", "--body", "hello", "--timeout", "5s")
	if r.code != exitDone {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
	ex := f.executions()
	want := map[string]any{"to": "a@example.com", "subject": "hi", "body": "hello"}
	if len(ex) != 1 || ex[0].path != "/v1/emails" || !reflect.DeepEqual(ex[0].body, want) {
		t.Fatalf("executions = %+v", ex)
	}
}

// --drop-response: two attempts with one key, one effect.
func TestDropResponse(t *testing.T) {
	f := newFakeIngress(t)
	r := runT(t, testEnv(t, f), "charge", "--account", "a", "--amount-cents", "1", "--drop-response")
	if r.code != exitDone || num(t, r.lines[0]["attempts"]) != 2 || str(t, r.lines[0]["status"]) != "done" {
		t.Fatalf("exit %d, lines %v, stderr %q", r.code, r.lines, r.stderr)
	}
	if ex := f.executions(); len(ex) != 1 || ex[0].key != str(t, r.lines[0]["key"]) {
		t.Fatalf("executions = %+v, want one with the printed key", ex)
	}
}

// --forget-key: the negative control produces a second effect under a second key.
func TestForgetKey(t *testing.T) {
	f := newFakeIngress(t)
	env := testEnv(t, f)
	r := runT(t, env, "charge", "--account", "a", "--amount-cents", "1", "--forget-key")
	if r.code != exitDone || len(r.lines) != 1 {
		t.Fatalf("exit %d, lines %v, stderr %q", r.code, r.lines, r.stderr)
	}
	ex := f.executions()
	if len(ex) != 2 || ex[0].key == ex[1].key || ex[1].key != str(t, r.lines[0]["key"]) {
		t.Fatalf("executions = %+v, want two with different keys, the second printed", ex)
	}
	if !strings.Contains(r.stderr, ex[0].key) {
		t.Fatalf("stderr does not name the forgotten key %s: %q", ex[0].key, r.stderr)
	}
	if l := runT(t, env, "list"); len(l.lines) != 1 {
		t.Fatalf("list after forget-key shows %d intents, want 1", len(l.lines))
	}
}

// An outage leaves the intent pending (exit 2); resume sends it with the same key
// once the service is back, and list agrees.
func TestPendingThenResume(t *testing.T) {
	f := newFakeIngress(t)
	env := testEnv(t, f)
	f.down.Store(true)
	r := runT(t, env, "charge", "--account", "a", "--amount-cents", "5", "--max-attempts", "2")
	if r.code != exitIncomplete || str(t, r.lines[0]["status"]) != "pending" || num(t, r.lines[0]["attempts"]) != 2 {
		t.Fatalf("exit %d, lines %v; want exit 2, pending after 2 attempts", r.code, r.lines)
	}
	if !strings.Contains(r.stderr, "enqueue resume") {
		t.Fatalf("stderr does not point at resume: %q", r.stderr)
	}
	key := str(t, r.lines[0]["key"])
	if l := runT(t, env, "list"); l.code != exitIncomplete || str(t, l.lines[0]["status"]) != "pending" {
		t.Fatalf("list: exit %d, lines %v", l.code, l.lines)
	}

	f.down.Store(false)
	r = runT(t, env, "resume")
	if r.code != exitDone || len(r.lines) != 1 || str(t, r.lines[0]["key"]) != key ||
		str(t, r.lines[0]["status"]) != "done" || num(t, r.lines[0]["attempts"]) != 3 {
		t.Fatalf("resume: exit %d, lines %v, stderr %q; want key %s done after 3 attempts", r.code, r.lines, r.stderr, key)
	}
	if ex := f.executions(); len(ex) != 1 || ex[0].key != key {
		t.Fatalf("executions = %+v", ex)
	}
	if l := runT(t, env, "list"); l.code != exitDone || str(t, l.lines[0]["status"]) != "done" {
		t.Fatalf("list after resume: exit %d, lines %v", l.code, l.lines)
	}
	// Nothing left to resume.
	if r := runT(t, env, "resume"); r.code != exitDone || len(r.lines) != 0 {
		t.Fatalf("second resume: exit %d, lines %v", r.code, r.lines)
	}
}

func TestRejected(t *testing.T) {
	f := newFakeIngress(t)
	f.reject.Store(true)
	r := runT(t, testEnv(t, f), "charge", "--account", "a", "--amount-cents", "5")
	if r.code != exitIncomplete || str(t, r.lines[0]["status"]) != "rejected" || num(t, r.lines[0]["http_status"]) != 422 {
		t.Fatalf("exit %d, lines %v", r.code, r.lines)
	}
}

// Many pending intents: resume streams one line each, reports progress and a summary
// on stderr, and names the expired intents it skipped.
func TestResumeManyWithExpired(t *testing.T) {
	f := newFakeIngress(t)
	env := testEnv(t, f)
	j, err := client.OpenJournal(env["IDEM_JOURNAL"])
	if err != nil {
		t.Fatal(err)
	}
	old := idem.NewKey()
	intents := []client.Intent{{Key: old, Method: "POST", Path: "/v1/payments", Payload: []byte(`{"account":"old","amount_cents":1}`), CreatedAt: time.Now().Add(-48 * time.Hour)}}
	for i := range 24 {
		intents = append(intents, client.Intent{Key: idem.NewKey(), Method: "POST", Path: "/v1/payments",
			Payload: fmt.Appendf(nil, `{"account":"a%d","amount_cents":1}`, i)})
	}
	for _, in := range intents {
		if err := j.Append(t.Context(), in); err != nil {
			t.Fatal(err)
		}
	}
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}

	r := runT(t, env, "resume")
	if r.code != exitIncomplete || len(r.lines) != 25 {
		t.Fatalf("exit %d, %d lines; want exit 2 (one expired) and 25 lines\nstderr: %s", r.code, len(r.lines), r.stderr)
	}
	if str(t, r.lines[0]["status"]) != "expired" || str(t, r.lines[0]["key"]) != string(old) {
		t.Fatalf("first line = %v, want the old intent expired", r.lines[0])
	}
	for _, want := range []string{"resume: 10/25", "resume: 25/25", "skipped 1 expired", string(old), "25 intents: 24 done, 0 pending, 0 rejected, 1 expired"} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("stderr lacks %q:\n%s", want, r.stderr)
		}
	}
	if n := len(f.executions()); n != 24 {
		t.Fatalf("%d executions, want 24 (the expired intent is never sent)", n)
	}
	l := runT(t, env, "list")
	if l.code != exitIncomplete || len(l.lines) != 25 || !strings.Contains(l.stderr, "list: 25 intents: 24 done, 0 pending, 0 rejected, 1 expired") {
		t.Fatalf("list: exit %d, %d lines, stderr %q", l.code, len(l.lines), l.stderr)
	}
}

// prune forgets finished intents and keeps pending ones.
func TestPrune(t *testing.T) {
	f := newFakeIngress(t)
	env := testEnv(t, f)
	for range 2 {
		if r := runT(t, env, "charge", "--account", "a", "--amount-cents", "5"); r.code != exitDone {
			t.Fatalf("charge: exit %d, stderr %s", r.code, r.stderr)
		}
	}
	j, err := client.OpenJournal(env["IDEM_JOURNAL"])
	if err != nil {
		t.Fatal(err)
	}
	pending := client.Intent{Key: idem.NewKey(), Method: "POST", Path: "/v1/payments", Payload: []byte(`{"account":"p","amount_cents":1}`)}
	if err := j.Append(t.Context(), pending); err != nil {
		t.Fatal(err)
	}
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}

	if r := runT(t, env, "prune"); r.code != exitDone || !strings.Contains(r.stderr, "removed 0 finished") {
		t.Fatalf("prune (default: a week): exit %d, stderr %q; want nothing removed", r.code, r.stderr)
	}
	if r := runT(t, env, "prune", "--older-than", "0s"); r.code != exitDone || !strings.Contains(r.stderr, "removed 2 finished") || len(r.lines) != 0 {
		t.Fatalf("prune --older-than 0s: exit %d, %d lines, stderr %q", r.code, len(r.lines), r.stderr)
	}
	l := runT(t, env, "list")
	if len(l.lines) != 1 || str(t, l.lines[0]["key"]) != string(pending.Key) || str(t, l.lines[0]["status"]) != "pending" {
		t.Fatalf("list after prune = %v, want only the pending intent", l.lines)
	}
	if r := runT(t, env, "prune", "--older-than", "-1h"); r.code != exitError {
		t.Fatalf("negative --older-than: exit %d, want %d", r.code, exitError)
	}
}

func TestUsageErrors(t *testing.T) {
	f := newFakeIngress(t)
	env := testEnv(t, f)
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{nil, exitError, "missing command"},
		{[]string{"refund"}, exitError, `unknown command "refund"`},
		{[]string{"charge", "--amount-cents", "5"}, exitError, "--account A --amount-cents N"},
		{[]string{"charge", "--account", "a", "--amount-cents", "-5"}, exitError, "positive amount"},
		{[]string{"charge", "--account", "a", "--amount-cents", "five"}, exitError, "invalid value"},
		{[]string{"email", "--to", "x@example.com"}, exitError, "--to T --subject S"},
		{[]string{"list", "extra"}, exitError, `unexpected argument "extra"`},
		{[]string{"resume", "--forget-key"}, exitError, "apply to new intents"},
		{[]string{"charge", "--account", "a", "--amount-cents", "1", "--max-attempts", "0"}, exitError, "--max-attempts"},
		{[]string{"charge", "--account", "a", "--amount-cents", "1", "--scope", "bad\tscope"}, exitError, "scope"},
		{[]string{"-h"}, exitDone, "Exit status:"},
		{[]string{"charge", "-h"}, exitDone, "Exit status:"},
	} {
		r := runT(t, env, tc.args...)
		if r.code != tc.code || !strings.Contains(r.stderr, tc.msg) {
			t.Errorf("enqueue %q: exit %d, stderr %q; want exit %d mentioning %q", tc.args, r.code, r.stderr, tc.code, tc.msg)
		}
	}
	if ex := f.executions(); len(ex) != 0 {
		t.Fatalf("usage errors sent requests: %+v", ex)
	}
}

// Two invocations at once: the second waits for the journal lock and gives up with a
// clear message after --lock-wait.
func TestJournalInUse(t *testing.T) {
	f := newFakeIngress(t)
	env := testEnv(t, f)
	j, err := client.OpenJournal(env["IDEM_JOURNAL"])
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	r := runT(t, env, "list", "--lock-wait", "30ms")
	if r.code != exitError || !strings.Contains(r.stderr, "in use by another enqueue") {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
}

func TestDefaultJournalPath(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"XDG_STATE_HOME": "/state", "HOME": "/home/u"}, "/state/idem/enqueue.journal"},
		{map[string]string{"HOME": "/home/u"}, "/home/u/.local/state/idem/enqueue.journal"},
	} {
		if got := defaultJournalPath(func(k string) string { return tc.env[k] }); got != filepath.FromSlash(tc.want) {
			t.Errorf("env %v: got %s, want %s", tc.env, got, tc.want)
		}
	}
	// The default directory is created on first use.
	f := newFakeIngress(t)
	state := t.TempDir()
	r := runT(t, map[string]string{"IDEM_API": f.srv.URL, "XDG_STATE_HOME": state}, "charge", "--account", "a", "--amount-cents", "1")
	if r.code != exitDone {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
	j, err := client.OpenJournal(filepath.Join(state, "idem", "enqueue.journal"))
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	if all, err := j.All(t.Context()); err != nil || len(all) != 1 {
		t.Fatalf("default journal holds %d intents (%v), want 1", len(all), err)
	}
}

// A redirect is not the service's answer: enqueue does not follow it (net/http would
// turn the POST into a GET of the Location and report the intent done). The intent
// stays pending (exit 2) for a resume once --api is fixed, and the line says why.
func TestRedirectNotFollowed(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.Path)
		mu.Unlock()
		if r.Method == http.MethodPost {
			w.Header().Set("Location", "/v1/payments/pay_1")
			w.WriteHeader(http.StatusSeeOther)
			return
		}
		_, _ = w.Write([]byte(`{"ok":true}`))
	}))
	t.Cleanup(srv.Close)
	env := map[string]string{"IDEM_API": srv.URL, "IDEM_JOURNAL": filepath.Join(t.TempDir(), "enqueue.journal")}

	r := runT(t, env, "charge", "--account", "a", "--amount-cents", "5")
	if r.code != exitIncomplete || len(r.lines) != 1 || str(t, r.lines[0]["status"]) != "pending" {
		t.Fatalf("exit %d, lines %v, stderr %q; want exit 2 and the intent pending", r.code, r.lines, r.stderr)
	}
	if msg := str(t, r.lines[0]["error"]); !strings.Contains(msg, "303") || !strings.Contains(msg, "/v1/payments/pay_1") {
		t.Fatalf("error field %q does not name the redirect", msg)
	}
	if !strings.Contains(r.stderr, "fix --api") || !strings.Contains(r.stderr, "enqueue resume") {
		t.Fatalf("stderr does not say to fix --api and resume: %q", r.stderr)
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []string{"POST /v1/payments"}; !reflect.DeepEqual(seen, want) {
		t.Fatalf("server saw %q, want only %q", seen, want)
	}
}

// --version prints the build and exits 0, whatever else is on the line.
func TestVersion(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	code := run(t.Context(), []string{"--version"}, func(string) string { return "" }, &stdout, &stderr)
	if code != exitDone || !strings.HasPrefix(stdout.String(), "idem ") {
		t.Fatalf("--version = %d, %q (stderr %q), want 0 and \"idem <version> ...\"", code, stdout.String(), stderr.String())
	}
}

// The conventions shared with worker: flags before or after every command, JSON
// lines on stdout (--json accepted), the environment variables and the exit codes
// in --help, --version anywhere.
func TestCLIConventions(t *testing.T) {
	f := newFakeIngress(t)
	env := testEnv(t, f)
	api, journal := env["IDEM_API"], env["IDEM_JOURNAL"]

	r := runT(t, env, "--help")
	for _, want := range []string{"IDEM_API", "IDEM_JOURNAL", "XDG_STATE_HOME", "HOME", "Exit status:", "0  every intent is done",
		"1  usage error", "2  some intent ended rejected", "Flags (before or after the command)", "(env IDEM_API)", "(env IDEM_JOURNAL"} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("--help lacks %q", want)
		}
	}

	noEnv := map[string]string{} // flags alone must carry the API and the journal
	for _, tc := range []struct {
		env   map[string]string
		args  []string
		code  int
		lines int
	}{
		{env, []string{"--json", "charge", "--account", "a", "--amount-cents", "1"}, exitDone, 1},
		{env, []string{"charge", "--account", "a", "--json", "--amount-cents", "2", "--timeout", "5s"}, exitDone, 1},
		{noEnv, []string{"--api", api, "--journal", journal, "email", "--to", "a@example.com", "--subject", "s"}, exitDone, 1},
		{noEnv, []string{"email", "--to", "b@example.com", "--subject", "s", "--api", api, "--journal", journal}, exitDone, 1},
		{noEnv, []string{"--journal", journal, "list", "--json"}, exitDone, 4},
		{noEnv, []string{"list", "--journal", journal}, exitDone, 4},
		{noEnv, []string{"--api", api, "resume", "--journal", journal, "--json"}, exitDone, 0},
		{noEnv, []string{"prune", "--journal", journal, "--older-than", "1h"}, exitDone, 0},
		{noEnv, []string{"--journal", journal, "list", "--no-such-flag"}, exitError, 0},
		{noEnv, []string{"--no-such-flag", "list"}, exitError, 0},
	} {
		r := runT(t, tc.env, tc.args...) // fails the test on a stdout line that is not JSON
		if r.code != tc.code || len(r.lines) != tc.lines {
			t.Errorf("enqueue %q: exit %d, %d lines (stderr %q); want exit %d and %d lines", tc.args, r.code, len(r.lines), r.stderr, tc.code, tc.lines)
		}
	}
	if n := len(f.executions()); n != 4 {
		t.Errorf("executions = %d, want 4", n)
	}

	for _, args := range [][]string{{"--version"}, {"list", "--version"}, {"charge", "--version"}} {
		var stdout, stderr bytes.Buffer
		if code := run(t.Context(), args, func(string) string { return "" }, &stdout, &stderr); code != exitDone || !strings.HasPrefix(stdout.String(), "idem ") {
			t.Errorf("enqueue %q = %d, %q; want 0 and the version", args, code, stdout.String())
		}
	}
}

// Each environment variable --help names is read: it becomes the default.
func TestEnvironmentDefaults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env          map[string]string
		api, journal string
	}{
		{map[string]string{"IDEM_API": "http://api.example", "IDEM_JOURNAL": "/j/x"}, "http://api.example", "/j/x"},
		{map[string]string{"XDG_STATE_HOME": "/state", "HOME": "/home/u"}, client.DefaultBaseURL, "/state/idem/enqueue.journal"},
		{map[string]string{"HOME": "/home/u"}, client.DefaultBaseURL, "/home/u/.local/state/idem/enqueue.journal"},
	} {
		o := defaultOptions(func(k string) string { return tc.env[k] })
		if o.api != tc.api || o.journal != tc.journal {
			t.Errorf("environment %v: api %q, journal %q; want %q, %q", tc.env, o.api, o.journal, tc.api, tc.journal)
		}
	}
}
