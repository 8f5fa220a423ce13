package main

// The groups of flags several commands take: the database (with the data dir
// and the schema), the NATS connection, the HTTP address. Each flag has one
// usage text and one environment variable, whichever command takes it.

import (
	"os"
	"path/filepath"
	"strings"

	"github.com/idemkit/idem/app/runenv"
)

// dbOptions are the flags of a command that opens the database: which one, the
// data dir (where an operator command finds the database a zero-setup worker
// runs on, see openOpsPool) and the schema of idem's tables.
type dbOptions struct {
	databaseURL string
	dataDir     string
	schema      string
	src         sources // of the command's flags: whether a database was named
}

func (d *dbOptions) flags(fs *flagSet) {
	fs.stringVar(&d.databaseURL, "database-url", "DATABASE_URL", runenv.DefaultDatabaseURL, "Postgres URL (env DATABASE_URL)")
	fs.stringVar(&d.dataDir, "data-dir", "IDEM_DATA_DIR", defaultDataDir(), "directory for the embedded JetStream store, the private Postgres, the worker's lock and its database record; "+
		"the operator commands find a running worker's files there (env IDEM_DATA_DIR; default $XDG_STATE_HOME/idem, else ~/.local/state/idem, /var/lib/idem for root)")
	fs.stringVar(&d.schema, "schema", "IDEM_SCHEMA", "", "Postgres schema of the idem_* tables; empty is public (env IDEM_SCHEMA)")
	d.src = fs.src
}

// databaseNamed reports whether the user named a database (--database-url or
// DATABASE_URL), rather than leaving it to the default.
func (d *dbOptions) databaseNamed() bool { return d.src.given("database-url") }

// defaultDataDir is runenv.DefaultDataDir, or empty when there is none (no home
// directory): runenv.Open then says to set --data-dir.
func defaultDataDir() string {
	d, err := runenv.DefaultDataDir()
	if err != nil {
		return ""
	}
	return d
}

// natsOptions are the flags of a command that talks to NATS: the server and how
// to authenticate to it.
type natsOptions struct {
	url          string
	auth         runenv.NATSAuth
	passwordFile string
}

func (n *natsOptions) flags(fs *flagSet) {
	fs.stringVar(&n.url, "nats-url", "NATS_URL", "", "NATS server URL, or a comma-separated list of a cluster's; empty starts an embedded JetStream server (env NATS_URL)")
	fs.stringVar(&n.auth.CredsFile, "nats-creds", "IDEM_NATS_CREDS", "", "NATS user credentials file (JWT and seed) (env IDEM_NATS_CREDS)")
	fs.stringVar(&n.auth.NKeyFile, "nats-nkey", "IDEM_NATS_NKEY", "", "file holding the NATS user's nkey seed (env IDEM_NATS_NKEY)")
	fs.stringVar(&n.auth.User, "nats-user", "IDEM_NATS_USER", "", "NATS user, with --nats-password (env IDEM_NATS_USER)")
	fs.stringVar(&n.auth.Password, "nats-password", "IDEM_NATS_PASSWORD", "", "NATS password; as a flag every user of the machine can read it: prefer the env var or --nats-password-file (env IDEM_NATS_PASSWORD)")
	secretFileVar(fs, &n.passwordFile, "nats-password", "IDEM_NATS_PASSWORD")
	fs.stringVar(&n.auth.CAFile, "nats-ca", "IDEM_NATS_CA", "", "PEM file of the CAs that sign the NATS server's certificate (env IDEM_NATS_CA)")
	fs.stringVar(&n.auth.CertFile, "nats-cert", "IDEM_NATS_CERT", "", "client certificate for NATS mutual TLS, with --nats-key (env IDEM_NATS_CERT)")
	fs.stringVar(&n.auth.KeyFile, "nats-key", "IDEM_NATS_KEY", "", "client key for NATS mutual TLS (env IDEM_NATS_KEY)")
}

func (n *natsOptions) secrets() []*secret {
	return []*secret{{flag: "nats-password", env: "IDEM_NATS_PASSWORD", value: &n.auth.Password, file: n.passwordFile}}
}

// target is the NATS server an operator command talks to: --nats-url with its
// credentials when given, else the embedded server a zero-setup worker recorded
// in dataDir (its URL carries its own token, so no credentials). source says
// where the URL came from; url is empty when neither has one.
func (n *natsOptions) target(dataDir string) (url, source string, auth runenv.NATSAuth) {
	if n.url != "" {
		return n.url, "--nats-url / NATS_URL", n.auth
	}
	file := filepath.Join(dataDir, runenv.NATSURLFile)
	b, err := os.ReadFile(file)
	if err != nil {
		return "", "", runenv.NATSAuth{}
	}
	return strings.TrimSpace(string(b)), file, runenv.NATSAuth{}
}

// httpAddrVar registers --http-addr: where the service listens, and where
// healthcheck asks it.
func httpAddrVar(fs *flagSet, p *string) {
	fs.stringVar(p, "http-addr", "IDEM_HTTP_ADDR", "127.0.0.1:8080", "HTTP listen address (env IDEM_HTTP_ADDR)")
}
