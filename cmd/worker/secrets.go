package main

// Credentials: given as a flag, an environment variable or a file. A flag's value
// is on the command line, which every user of the machine can read
// (/proc/<pid>/cmdline, ps); the worker says so at start.

import (
	"fmt"
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

// secretFileVar registers --<name>-file, the file a secret may be read from
// instead, falling back to <envVar>_FILE.
func secretFileVar(fs *flagSet, p *string, name, envVar string) {
	fs.stringVar(p, name+"-file", envVar+"_FILE", "",
		fmt.Sprintf("read --%s from this `file` (its content, without the final newline) instead (env %s_FILE)", name, envVar))
}

// readSecretFiles sets every secret given as a file from that file.
func readSecretFiles(secrets []*secret) error {
	for _, s := range secrets {
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

// secretWarnings are the warnings about each credential the service was given
// as a flag's value on the command line, saying where to give it instead.
func secretWarnings(o *serviceOptions) []warning {
	var ws []warning
	warn := func(flag, instead string) {
		ws = append(ws, warning{"a credential is on the command line, where every user of this machine can read it (ps, /proc/<pid>/cmdline)",
			[]any{"flag", "--" + flag, "instead", instead}})
	}
	for _, s := range o.secrets() {
		if o.src.onCommandLine(s.flag) && *s.value != "" {
			warn(s.flag, fmt.Sprintf("%s, or --%s-file", s.env, s.flag))
		}
	}
	if o.src.onCommandLine("database-url") && urlHasPassword(o.db.databaseURL) {
		warn("database-url", "DATABASE_URL, or a URL without its password and the password in PGPASSWORD or a password file (PGPASSFILE, ~/.pgpass)")
	}
	for _, f := range []struct{ flag, value, env string }{{"nats-url", o.nats.url, "NATS_URL"}, {"smtp-url", o.smtpURL, "IDEM_SMTP_URL"}} {
		if o.src.onCommandLine(f.flag) && urlHasPassword(f.value) {
			warn(f.flag, f.env)
		}
	}
	return ws
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
