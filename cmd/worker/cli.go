package main

// The command line's conventions, shared by every subcommand: where a subcommand
// may stand among the flags, exit codes, and the email flags.

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"

	"github.com/idemkit/idem/internal/app/refapp"
)

// Exit codes, part of the CLI's contract (see usage).
const (
	exitOK    = 0 // done; for healthcheck: the worker is ready
	exitError = 1 // an error; inspect: the key is unknown; replay: a dead letter was refused; healthcheck: not ready
	exitUsage = 2 // the command line is wrong: unknown subcommand or flag, a bad flag value, wrong arguments
)

// usageError is an error in the command line: exit status 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// exitCode is the exit status of run's error.
func exitCode(err error) int {
	var u usageError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return exitOK
	case errors.As(err, &u):
		return exitUsage
	}
	return exitError
}

// commands are the worker's subcommands.
var commands = []string{"migrate", "partition", "dead-letters", "inspect", "stats", "healthcheck", "consumers", "help"}

// splitCommand finds the subcommand among args, which flags may precede and
// follow: `worker --database-url X stats` is `worker stats --database-url X`. fs
// says which flags take a value (`--schema stats` is a flag and its value, not
// the subcommand); a flag fs does not know is a subcommand's own and is taken to
// have none (write `--scope=acme` before the subcommand, or put it after). The
// first word that is not a flag or a flag's value is the subcommand, unless it is
// no known one and an unknown flag came before it: then there is none, and the
// flag parser reports that flag. "--" ends the search.
func splitCommand(args []string, fs *flag.FlagSet, known []string) (cmd string, rest []string) {
	sawUnknown := false
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			break
		}
		if len(a) > 1 && a[0] == '-' {
			name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
			switch f := fs.Lookup(name); {
			case f == nil:
				sawUnknown = true
			case !hasValue && !isBoolFlag(f):
				i++ // its value
			}
			continue
		}
		if slices.Contains(known, a) || !sawUnknown {
			return a, append(slices.Clone(args[:i]), args[i+1:]...)
		}
		break
	}
	return "", args
}

func isBoolFlag(f *flag.Flag) bool {
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// wantsVersion reports whether args ask for the version (before any "--").
func wantsVersion(args []string) bool {
	for _, a := range args {
		switch a {
		case "--":
			return false
		case "--version", "-version", "--version=true", "-version=true":
			return true
		}
	}
	return false
}

// emailConfig is the email consumer's configuration from the flags: the SMTP
// server from --smtp-url, or from the deprecated --smtp-addr (which means
// smtp+insecure://ADDR: plaintext, no AUTH, as before --smtp-url existed), and
// the CA file of --smtp-ca. Without either the worker runs no email consumer.
func (o *options) emailConfig(log *slog.Logger) (refapp.EmailConfig, error) {
	cfg := refapp.EmailConfig{URL: o.smtpURL, From: o.smtpFrom}
	switch {
	case o.smtpURL != "" && o.smtpAddr != "":
		return cfg, usagef("--smtp-addr (IDEM_SMTP_ADDR) is a deprecated form of --smtp-url (IDEM_SMTP_URL): give one, not both")
	case o.smtpAddr != "":
		cfg.URL = "smtp+insecure://" + o.smtpAddr
		if log != nil {
			log.Warn("--smtp-addr (IDEM_SMTP_ADDR) is deprecated: it means --smtp-url smtp+insecure://ADDR (plaintext, no AUTH); use --smtp-url",
				"smtp_url", cfg.URL)
		}
	}
	if o.smtpCA != "" {
		if cfg.URL == "" {
			return cfg, usagef("--smtp-ca (IDEM_SMTP_CA) needs --smtp-url")
		}
		pem, err := os.ReadFile(o.smtpCA)
		if err != nil {
			return cfg, fmt.Errorf("--smtp-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return cfg, fmt.Errorf("--smtp-ca: %s holds no PEM certificate", o.smtpCA)
		}
		cfg.TLSConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	if o.smtpFrom != "" && cfg.URL == "" {
		return cfg, usagef("--smtp-from (IDEM_SMTP_FROM) needs --smtp-url")
	}
	if cfg.URL != "" {
		// Validate now, for a message at start rather than a failed consumer.
		if _, err := refapp.NewEmailHandler(cfg); err != nil {
			return cfg, usageError{fmt.Errorf("--smtp-url: %w", err)}
		}
	}
	return cfg, nil
}
