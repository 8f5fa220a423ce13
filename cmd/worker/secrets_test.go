package main

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Every credential flag has a -file twin (and its _FILE variable): the file's
// content, without the final newline, is the value. A value from two places, or
// an empty file, is refused.
func TestSecretsFromFiles(t *testing.T) {
	t.Setenv("IDEM_CONSOLE_TOKEN", "") // rules out t.Parallel
	t.Setenv("IDEM_CONSOLE_PASSWORD", "")
	t.Setenv("IDEM_NATS_PASSWORD", "")
	dir := t.TempDir()
	file := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	tok, pw, nats, empty := file("token", "tok-1\n"), file("password", "pw 2\r\n"), file("nats", "n3"), file("empty", "\n")

	o, err := newCommand("", usage, runService).parse([]string{"--console-token-file", tok, "--console-password-file", pw, "--nats-password-file", nats}, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.consoleToken != "tok-1" || o.consolePassword != "pw 2" || o.nats.auth.Password != "n3" {
		t.Errorf("from files: token %q, password %q, NATS password %q", o.consoleToken, o.consolePassword, o.nats.auth.Password)
	}
	// From the variable, for the subcommands that take the secret; the variable
	// of a secret they do not take (a file that is not there) is no concern of
	// theirs.
	env := envOf(map[string]string{"IDEM_NATS_PASSWORD_FILE": nats, "IDEM_CONSOLE_TOKEN_FILE": filepath.Join(dir, "missing")})
	if o, err := newCommand("stats", statsUsage, runStats).parse(nil, env, io.Discard); err != nil || o.nats.auth.Password != "n3" {
		t.Errorf("stats, from IDEM_NATS_PASSWORD_FILE: %v; want the password from the file", err)
	}
	if o, err := newCommand("consumers rename", consumersUsage, runConsumersRename).parse([]string{"a", "b"}, env, io.Discard); err != nil || o.nats.auth.Password != "n3" {
		t.Errorf("consumers rename, from IDEM_NATS_PASSWORD_FILE: %v; want the password from the file", err)
	}

	for _, args := range [][]string{
		{"--console-token", "x", "--console-token-file", tok},
		{"--nats-password-file", empty},
		{"--console-password-file", filepath.Join(dir, "missing")},
	} {
		var out, errb bytes.Buffer
		// Nothing that answers, should the worker go on to start.
		args = append(args, "--database-url", "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable", "--data-dir", t.TempDir(), "--http-addr", freeAddr(t))
		if code := run(args, &out, &errb); code == exitOK || !strings.Contains(errb.String(), "-file") {
			t.Errorf("run(%q) = %d, %q; want an error naming the -file flag", args, code, errb.String())
		}
	}
}

// A credential given as a flag's value is on the command line, which every user
// of the machine can read: the worker warns, naming the flag and where to put it
// instead. From the environment or a file it says nothing.
func TestWarnsAboutSecretsOnTheCommandLine(t *testing.T) {
	t.Setenv("IDEM_CONSOLE_PASSWORD", "") // rules out t.Parallel
	t.Setenv("DATABASE_URL", "")
	start := func(args ...string) string {
		var out, errb bytes.Buffer
		run(append(args, "--data-dir", t.TempDir(), "--http-addr", freeAddr(t)), &out, &errb)
		return errb.String()
	}
	const dead = "postgres://postgres:hunter2@127.0.0.1:1/postgres?sslmode=disable"
	logs := start("--console-password", "pw", "--console-token", "tok", "--database-url", dead,
		"--nats-url", "nats://s3cret@127.0.0.1:1")
	for _, flag := range []string{"--console-password", "--console-token", "--database-url", "--nats-url"} {
		if !strings.Contains(logs, "credential is on the command line") || !strings.Contains(logs, "flag="+flag) {
			t.Errorf("no warning for %s:\n%s", flag, logs)
		}
	}
	mustContain(t, "the warnings", logs, "IDEM_CONSOLE_PASSWORD", "--console-password-file", "PGPASSWORD")

	t.Setenv("IDEM_CONSOLE_PASSWORD", "pw")
	t.Setenv("DATABASE_URL", dead)
	if logs := start("--database-url", "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable"); strings.Contains(logs, "on the command line") {
		t.Errorf("warned about credentials given in the environment, or a URL without a password:\n%s", logs)
	}
}
