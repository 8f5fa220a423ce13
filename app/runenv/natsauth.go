package runenv

import (
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
)

// NATSAuth is how the worker authenticates to a NATS server it is given (not the
// embedded one, which makes its own token), and how it trusts the server's TLS
// certificate. The zero value is none of it: a plain, anonymous connection.
type NATSAuth struct {
	// CredsFile is a user credentials file (JWT and nkey seed), as nsc and NGS
	// issue them.
	CredsFile string
	// NKeyFile is a file holding an nkey seed ("SU..."), for a server that lists
	// the user's public nkey.
	NKeyFile string
	// User and Password, for a server with user/password authorization.
	User, Password string
	// CAFile is a PEM file of the CAs that sign the server's certificate (default:
	// the system's roots, when the URL is tls://).
	CAFile string
	// CertFile and KeyFile are the client's certificate and key, for a server that
	// verifies clients (mutual TLS).
	CertFile, KeyFile string
}

// validate refuses combinations that cannot mean anything: two identities, half a
// client certificate.
func (a NATSAuth) validate() error {
	ids := 0
	for _, set := range []bool{a.CredsFile != "", a.NKeyFile != "", a.User != ""} {
		if set {
			ids++
		}
	}
	switch {
	case ids > 1:
		return errors.New("NATS: give one of a credentials file, an nkey seed file, or a user and password")
	case a.Password != "" && a.User == "":
		return errors.New("NATS: a password needs a user")
	case (a.CertFile == "") != (a.KeyFile == ""):
		return errors.New("NATS: a client certificate needs both its certificate and its key file")
	}
	return nil
}

// Options are the nats.Options that carry a: add them to nats.Connect.
func (a NATSAuth) Options() ([]nats.Option, error) {
	if err := a.validate(); err != nil {
		return nil, err
	}
	var opts []nats.Option
	switch {
	case a.CredsFile != "":
		opts = append(opts, nats.UserCredentials(a.CredsFile))
	case a.NKeyFile != "":
		opt, err := nats.NkeyOptionFromSeed(a.NKeyFile)
		if err != nil {
			return nil, fmt.Errorf("NATS: nkey seed file: %w", err)
		}
		opts = append(opts, opt)
	case a.User != "":
		opts = append(opts, nats.UserInfo(a.User, a.Password))
	}
	if a.CAFile != "" {
		opts = append(opts, nats.RootCAs(a.CAFile))
	}
	if a.CertFile != "" {
		opts = append(opts, nats.ClientCert(a.CertFile, a.KeyFile))
	}
	return opts, nil
}

// Empty reports whether a sets nothing.
func (a NATSAuth) Empty() bool { return a == NATSAuth{} }
