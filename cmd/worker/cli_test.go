package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// runIn runs the worker's command line in the environment env, and returns
// stdout, stderr and the exit code.
func runIn(env map[string]string, args ...string) (string, string, int) {
	var out, errb bytes.Buffer
	code := runEnv(args, envOf(env), &out, &errb)
	return out.String(), errb.String(), code
}

// deadEnv points every command that could connect somewhere at nothing, should
// one run with a flag it ought to have refused.
func deadEnv(t *testing.T) map[string]string {
	return map[string]string{
		"DATABASE_URL":   "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=1",
		"IDEM_DATA_DIR":  t.TempDir(),
		"IDEM_HTTP_ADDR": "127.0.0.1:1",
	}
}

// serviceOnNothing are the service's flags for a database and a broker that are
// not there: a test that runs the service expecting a refusal cannot start a
// real worker.
func serviceOnNothing(t *testing.T) []string {
	return []string{"--database-url", deadEnv(t)["DATABASE_URL"], "--nats-url", "nats://127.0.0.1:1", "--data-dir", t.TempDir(), "--http-addr", "127.0.0.1:0"}
}

// The flags each command takes: the database's, the NATS connection's, the HTTP
// address, where it uses them, and its own; nothing else.
func TestEachCommandTakesOnlyItsFlags(t *testing.T) {
	t.Parallel()
	db := []string{"data-dir", "database-url", "schema"}
	nats := []string{"nats-ca", "nats-cert", "nats-creds", "nats-key", "nats-nkey", "nats-password", "nats-password-file", "nats-url", "nats-user"}
	filters := []string{"consumer", "include-replayed", "limit", "reason", "since", "until"}
	want := map[string][]string{
		"migrate":             append([]string{"json", "print"}, db...),
		"partition":           append([]string{"convert", "json"}, db...),
		"dead-letters list":   slices.Concat([]string{"json"}, filters, db),
		"dead-letters replay": slices.Concat([]string{"all", "dry-run", "force", "json"}, filters, db),
		"inspect":             append([]string{"json", "scope"}, db...),
		"stats":               slices.Concat([]string{"json"}, db, nats),
		"healthcheck":         {"http-addr", "json"},
		"consumers rename":    slices.Concat([]string{"force"}, db, nats),
		"consumers forget":    db,
		"installation show":   append([]string{"json"}, db...),
		"installation adopt":  append([]string{"epoch"}, db...),
		"help":                nil,
	}
	service := map[string]bool{}
	for _, c := range rootCommand().commands(noEnv) {
		var got []string
		c.fs.VisitAll(func(f *flag.Flag) { got = append(got, f.Name) })
		if c.path == "" {
			for _, n := range got {
				service[n] = true
			}
			continue
		}
		w, ok := want[c.path]
		if !ok {
			t.Errorf("a command this test does not know: %q", c.path)
			continue
		}
		w = append(slices.Clone(w), "version")
		slices.Sort(w)
		if !slices.Equal(got, w) {
			t.Errorf("%s takes %q, want %q", commandName(c.path), got, w)
		}
		delete(want, c.path)
	}
	if len(want) > 0 {
		t.Errorf("commands missing: %v", want)
	}
	// The service takes every flag of old, the subcommands' own flags aside.
	for _, f := range slices.Concat(db, nats, []string{"http-addr", "smtp-url", "smtp-addr", "smtp-ca", "smtp-from", "console", "console-token",
		"console-token-file", "console-user", "console-password", "console-password-file", "console-allow-plain-http", "pay-page", "metrics-addr", "stream-replicas",
		"log-format", "log-level", "shutdown-timeout", "trace", "roles", "no-migrate", "ack-wait", "group-commit", "atomic-publish", "relay", "reconcile-after", "version"}) {
		if !service[f] {
			t.Errorf("the service lacks --%s", f)
		}
		delete(service, f)
	}
	if len(service) > 0 {
		t.Errorf("the service takes flags this test does not know: %v", service)
	}
}

// A flag the command does not take is a usage error, before or after the
// subcommand, naming the command, the commands that do take the flag, and the
// command's own flags (`worker stats --smtp-url x` is refused).
func TestCommandsRefuseFlagsTheyDoNotTake(t *testing.T) {
	t.Parallel()
	takes := regexp.MustCompile(` takes: (.*) \(see `)
	for _, tc := range []struct {
		args       []string
		path, flag string
		whose      string // the commands that take it
	}{
		{[]string{"stats", "--smtp-url", "smtp://h"}, "stats", "smtp-url", "worker (the service)"},
		{[]string{"--smtp-url", "smtp://h", "stats"}, "stats", "smtp-url", "worker (the service)"},
		{[]string{"inspect", "--console", "k"}, "inspect", "console", "worker (the service)"},
		{[]string{"--console", "inspect", "k"}, "inspect", "console", "worker (the service)"},
		{[]string{"migrate", "--nats-url", "nats://h"}, "migrate", "nats-url", "worker (the service), worker stats, worker consumers rename"},
		{[]string{"migrate", "--print", "--ack-wait", "5s"}, "migrate", "ack-wait", "worker (the service)"},
		{[]string{"partition", "--http-addr", "h:1"}, "partition", "http-addr", "worker (the service), worker healthcheck"},
		{[]string{"dead-letters", "list", "--all"}, "dead-letters list", "all", "worker dead-letters replay"},
		{[]string{"--force", "dead-letters", "list"}, "dead-letters list", "force", "worker dead-letters replay, worker consumers rename"},
		{[]string{"dead-letters", "replay", "--all", "--scope", "s"}, "dead-letters replay", "scope", "worker inspect"},
		{[]string{"healthcheck", "--database-url", "postgres://h/db"}, "healthcheck", "database-url", "worker (the service), worker migrate"},
		{[]string{"--schema", "s", "healthcheck"}, "healthcheck", "schema", "worker (the service), worker migrate"},
		{[]string{"consumers", "rename", "a", "b", "--json"}, "consumers rename", "json", "worker migrate, worker partition"},
		{[]string{"help", "--json"}, "help", "json", "worker migrate"},
		{[]string{"--json"}, "", "json", "worker migrate"},
		{[]string{"--scope", "acme"}, "", "scope", "worker inspect"},
		{[]string{"--no-such-flag"}, "", "no-such-flag", ""},
		{[]string{"stats", "--no-such-flag"}, "stats", "no-such-flag", ""},
	} {
		args := tc.args
		if tc.path == "" {
			args = append(slices.Clone(args), serviceOnNothing(t)...)
		}
		out, errs, code := runIn(deadEnv(t), args...)
		prefix := ""
		if tc.path != "" {
			prefix = tc.path + ": "
		}
		if code != exitUsage || out != "" {
			t.Errorf("%q: exit %d, stdout %q; want %d and nothing", tc.args, code, out, exitUsage)
		}
		mustContain(t, fmt.Sprintf("stderr of %q", tc.args), errs,
			"worker: "+prefix+"flag provided but not defined: -"+tc.flag, commandName(tc.path)+" takes: --", "(see "+commandName(tc.path)+" -h)")
		if tc.whose != "" {
			mustContain(t, fmt.Sprintf("stderr of %q", tc.args), errs, "--"+tc.flag+" is a flag of: "+tc.whose)
		}
		// The list is the command's flags.
		var own []string
		commandFlagSet(t, tc.path, noEnv).VisitAll(func(f *flag.Flag) { own = append(own, "--"+f.Name) })
		if m := takes.FindStringSubmatch(errs); m == nil || m[1] != strings.Join(own, " ") {
			t.Errorf("%q: the refusal lists %q, want %q", tc.args, m, own)
		}
	}
}

// -h (and worker help COMMAND) prints a command's help with its flags, and no
// other command's.
func TestHelpListsOnlyTheCommandsFlags(t *testing.T) {
	t.Parallel()
	listed := regexp.MustCompile(`(?m)^  -([a-z-]+)`)
	for _, c := range rootCommand().commands(noEnv) {
		args := append(strings.Fields(c.path), "-h")
		out, help, code := runIn(nil, args...)
		if code != exitOK || out != "" {
			t.Errorf("%q: exit %d, stdout %q; want 0 and the help on stderr", args, code, out)
		}
		var got, want []string
		for _, m := range listed.FindAllStringSubmatch(help, -1) {
			got = append(got, m[1])
		}
		c.fs.VisitAll(func(f *flag.Flag) { want = append(want, f.Name) })
		if !slices.Equal(got, want) {
			t.Errorf("%q lists %q, want %q", args, got, want)
		}
		_, viaHelp, code := runIn(nil, append([]string{"help"}, strings.Fields(c.path)...)...)
		if code != exitOK || viaHelp != help {
			t.Errorf("worker help %s: exit %d, and not what %q prints:\n%s", c.path, code, args, viaHelp)
		}
	}
	// The reported cases: no console flags for inspect, no SMTP for stats.
	_, inspect, _ := runIn(nil, "inspect", "-h")
	_, stats, _ := runIn(nil, "stats", "--help")
	if strings.Contains(inspect, "-console") || strings.Contains(stats, "-smtp") {
		t.Errorf("the service's flags in a subcommand's help:\n%s\n%s", inspect, stats)
	}
	// A group lists each subcommand's flags.
	_, dl, code := runIn(nil, "dead-letters", "-h")
	if code != exitOK {
		t.Errorf("dead-letters -h: exit %d", code)
	}
	mustContain(t, "dead-letters -h", dl, "flags of worker dead-letters list:", "flags of worker dead-letters replay:", "  -dry-run")
	if _, errs, code := runIn(nil, "help", "frob"); code != exitUsage || !strings.Contains(errs, `unknown subcommand "frob"`) {
		t.Errorf("help frob: exit %d, %s", code, errs)
	}
}

// A flag is of the same kind (a switch or not) in every command that takes it,
// which splitCommand relies on; one with an environment variable (the database's,
// NATS', --http-addr) also has the same variable, usage and default.
func TestFlagsAgreeAcrossCommands(t *testing.T) {
	t.Parallel()
	type meaning struct {
		usage, env, def string
		isBool          bool
		path            string
	}
	seen := map[string]meaning{}
	for _, c := range rootCommand().commands(noEnv) {
		c.fs.VisitAll(func(f *flag.Flag) {
			m := meaning{f.Usage, c.fs.envOf[f.Name], f.DefValue, isBoolFlag(f), c.path}
			first, ok := seen[f.Name]
			if !ok {
				seen[f.Name] = m
				return
			}
			m.path = first.path
			if m.env == "" && first.env == "" { // a command's own, such as --json
				m.usage, m.def = first.usage, first.def
			}
			if m != first {
				t.Errorf("--%s of %s is %+v, but of %s %+v", f.Name, commandName(c.path), m, commandName(first.path), first)
			}
		})
	}
}

// Each command falls back to the environment for its flags, and only for those:
// a variable of a flag it does not take, however wrong, is not its concern.
func TestEnvironmentFallbacksPerCommand(t *testing.T) {
	t.Parallel()
	ready := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ready") }))
	defer ready.Close()
	readyAddr := strings.TrimPrefix(ready.URL, "http://")
	// The service's variables, each refused by the service.
	foreign := map[string]string{"IDEM_SMTP_URL": "ftp://nowhere", "IDEM_SHUTDOWN_TIMEOUT": "soon", "IDEM_ACK_WAIT": "-1s",
		"IDEM_LOG_FORMAT": "xml", "IDEM_ROLES": "cook", "IDEM_GROUP_COMMIT": "8", "IDEM_CONSOLE_TOKEN_FILE": "/nonexistent"}
	with := func(env map[string]string, more map[string]string) map[string]string {
		m := map[string]string{}
		for k, v := range env {
			m[k] = v
		}
		for k, v := range more {
			m[k] = v
		}
		return m
	}
	dead := deadEnv(t)
	for _, tc := range []struct {
		args []string
		env  map[string]string
		code int
		want string // in stdout, or else stderr
	}{
		// IDEM_SCHEMA reaches each command that reads the database. (Named on
		// the command line, the database is not there: should the variable not
		// be read, nothing is touched.)
		{[]string{"migrate", "--print"}, with(foreign, map[string]string{"IDEM_SCHEMA": "billing"}), exitOK, `CREATE SCHEMA IF NOT EXISTS "billing"`},
		{[]string{"partition", "--database-url", dead["DATABASE_URL"]}, with(foreign, map[string]string{"IDEM_SCHEMA": "Bad-Name"}), exitUsage, `partition: --schema: schema "Bad-Name"`},
		{[]string{"inspect", "k", "--database-url", dead["DATABASE_URL"]}, with(foreign, map[string]string{"IDEM_SCHEMA": "Bad-Name"}), exitUsage, `inspect: --schema: schema "Bad-Name"`},
		{[]string{"stats", "--database-url", dead["DATABASE_URL"]}, with(foreign, map[string]string{"IDEM_SCHEMA": "Bad-Name"}), exitUsage, `stats: --schema: schema "Bad-Name"`},
		// DATABASE_URL names the database: it is used, not replaced by the data
		// dir's guess. (Read-only commands: should the variable not be read, they
		// would only read the default database.)
		{[]string{"dead-letters", "list"}, with(foreign, dead), exitError, "127.0.0.1:1"},
		{[]string{"stats"}, with(foreign, dead), exitError, "127.0.0.1:1"},
		// IDEM_HTTP_ADDR is where healthcheck asks.
		{[]string{"healthcheck", "--json"}, with(foreign, map[string]string{"IDEM_HTTP_ADDR": readyAddr}), exitOK, `"url":"http://` + readyAddr + `/readyz"`},
		// The NATS password's file, for the commands that take it.
		{[]string{"stats", "--database-url", dead["DATABASE_URL"]}, with(foreign, map[string]string{"IDEM_NATS_PASSWORD_FILE": "/nonexistent/pw"}), exitError, "--nats-password-file"},
		{[]string{"consumers", "rename", "a", "b", "--database-url", dead["DATABASE_URL"]}, with(foreign, map[string]string{"IDEM_NATS_PASSWORD_FILE": "/nonexistent/pw"}), exitError, "--nats-password-file"},
		// The service reads its own. (Its database and data dir are flags here:
		// should the variable not be read, it would start on nothing.)
		{serviceOnNothing(t), map[string]string{"IDEM_SHUTDOWN_TIMEOUT": "soon"}, exitUsage, "IDEM_SHUTDOWN_TIMEOUT: want a positive duration"},
		{serviceOnNothing(t), map[string]string{"IDEM_ACK_WAIT": "-1s"}, exitUsage, "IDEM_ACK_WAIT: want a positive duration"},
		{serviceOnNothing(t), map[string]string{"IDEM_CONSOLE_TOKEN_FILE": "/nonexistent"}, exitError, "--console-token-file"},
	} {
		out, errs, code := runIn(tc.env, tc.args...)
		if code != tc.code || !strings.Contains(out+errs, tc.want) {
			t.Errorf("%q with %v: exit %d, stdout %q, stderr %q; want %d and %q", tc.args, tc.env, code, out, errs, tc.code, tc.want)
		}
		if tc.args[0] != "--database-url" && strings.Contains(errs, "IDEM_") && !strings.Contains(tc.want, "IDEM_") {
			t.Errorf("%q: a variable of a flag it does not take was read:\n%s", tc.args, errs)
		}
	}
	// A healthcheck JSON document, with the address from the environment.
	out, _, _ := runIn(map[string]string{"IDEM_HTTP_ADDR": readyAddr}, "healthcheck", "--json")
	var st healthStatus
	if err := json.Unmarshal([]byte(out), &st); err != nil || !st.Ready {
		t.Errorf("healthcheck with IDEM_HTTP_ADDR: %q, %v", out, err)
	}
}

// -h shows each flag's default, never the value its environment variable holds:
// a token or a password must not reach a terminal or a log through help.
func TestHelpShowsNoEnvironmentValue(t *testing.T) {
	t.Parallel()
	env := deadEnv(t)
	env["IDEM_CONSOLE_TOKEN"] = "s3cret-console-token"
	env["IDEM_NATS_PASSWORD"] = "s3cret-nats-password"
	for _, args := range [][]string{{"-h"}, {"stats", "-h"}, {"consumers", "rename", "-h"}} {
		out, errs, _ := runIn(env, args...)
		for _, secret := range []string{"s3cret-console-token", "s3cret-nats-password"} {
			if strings.Contains(out+errs, secret) {
				t.Errorf("worker %s prints %q from the environment", strings.Join(args, " "), secret)
			}
		}
	}
}
