package main

// Credentials: given as a flag, an environment variable or a file. A flag's value
// is on the command line, which every user of the machine can read
// (/proc/<pid>/cmdline, ps); the worker says so at start.

import (
	"flag"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"regexp"
	"strings"
)

// secret is a flag whose value is a credential, and the flag that names a file
// holding it instead.
type secret struct {
	flag, env string  // the flag and its environment variable
	value     *string // where the flag's value goes
	file      string  // the value of the -file flag
}

func (o *options) secrets() []*secret {
	return []*secret{
		{flag: "console-token", env: "IDEM_CONSOLE_TOKEN", value: &o.consoleToken, file: o.consoleTokenFile},
		{flag: "console-password", env: "IDEM_CONSOLE_PASSWORD", value: &o.consolePassword, file: o.consolePasswordFile},
		{flag: "nats-password", env: "IDEM_NATS_PASSWORD", value: &o.natsAuth.Password, file: o.natsPasswordFile},
	}
}

// registerSecretFiles adds a --<flag>-file flag for every secret.
func registerSecretFiles(fs *flag.FlagSet, o *options) {
	for _, f := range []struct {
		name, env string
		into      *string
	}{
		{"console-token", "IDEM_CONSOLE_TOKEN", &o.consoleTokenFile},
		{"console-password", "IDEM_CONSOLE_PASSWORD", &o.consolePasswordFile},
		{"nats-password", "IDEM_NATS_PASSWORD", &o.natsPasswordFile},
	} {
		fs.StringVar(f.into, f.name+"-file", env(f.env+"_FILE", ""),
			fmt.Sprintf("read --%s from this `file` (its content, without the final newline) instead (env %s_FILE)", f.name, f.env))
	}
}

// readSecretFiles sets every secret given as a file from that file.
func (o *options) readSecretFiles() error {
	for _, s := range o.secrets() {
		if s.file == "" {
			continue
		}
		if *s.value != "" {
			return usagef("--%s (or %s) and --%s-file (or %s_FILE) are both given: give one", s.flag, s.env, s.flag, s.env)
		}
		b, err := os.ReadFile(s.file)
		if err != nil {
			return fmt.Errorf("--%s-file: %w", s.flag, err)
		}
		v := strings.TrimRight(string(b), "\r\n")
		if v == "" {
			return fmt.Errorf("--%s-file: %s is empty", s.flag, s.file)
		}
		*s.value = v
	}
	return nil
}

// dsnPassword finds a password in a key=value connection string.
var dsnPassword = regexp.MustCompile(`(^|\s)password\s*=`)

// warnSecretsOnCommandLine warns about each credential given as a flag's value
// on the command line, and says where to give it instead.
func warnSecretsOnCommandLine(fs *flag.FlagSet, o *options, log *slog.Logger) {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	warn := func(flag, instead string) {
		log.Warn("a credential is on the command line, where every user of this machine can read it (ps, /proc/<pid>/cmdline)",
			"flag", "--"+flag, "instead", instead)
	}
	for _, s := range o.secrets() {
		if given[s.flag] && *s.value != "" {
			warn(s.flag, fmt.Sprintf("%s, or --%s-file", s.env, s.flag))
		}
	}
	if given["database-url"] && urlHasPassword(o.databaseURL) {
		warn("database-url", "DATABASE_URL, or a URL without its password and the password in PGPASSWORD or a password file (PGPASSFILE, ~/.pgpass)")
	}
	for _, f := range []struct{ flag, value, env string }{{"nats-url", o.natsURL, "NATS_URL"}, {"smtp-url", o.smtpURL, "IDEM_SMTP_URL"}} {
		if given[f.flag] && urlHasPassword(f.value) {
			warn(f.flag, f.env)
		}
	}
}

// urlHasPassword reports whether a URL (or a comma-separated list of them, or a
// Postgres key=value string) carries a password: in its user info (a NATS URL's
// user name may be a token) or as a password parameter.
func urlHasPassword(v string) bool {
	if dsnPassword.MatchString(v) {
		return true
	}
	for _, one := range strings.Split(v, ",") {
		u, err := url.Parse(strings.TrimSpace(one))
		if err != nil {
			continue
		}
		if u.Query().Get("password") != "" {
			return true
		}
		if u.User == nil {
			continue
		}
		if _, ok := u.User.Password(); ok || u.Scheme == "nats" || u.Scheme == "tls" {
			return true // nats://TOKEN@host: the user name is the token
		}
	}
	return false
}
