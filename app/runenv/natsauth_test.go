package runenv_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/app/runenv"
)

// pki is a throwaway CA with a server certificate for 127.0.0.1 and a client
// certificate, written as PEM files.
type pki struct{ ca, serverCert, serverKey, clientCert, clientKey string }

func newPKI(t *testing.T) pki {
	t.Helper()
	dir := t.TempDir()
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	key := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	caKey := key()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "idem test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	leaf := func(serial int64, usage x509.ExtKeyUsage, name string) (cert, keyFile string) {
		k := key()
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &k.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		kder, err := x509.MarshalECPrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		return write(name+".pem", "CERTIFICATE", der), write(name+"-key.pem", "EC PRIVATE KEY", kder)
	}
	p := pki{ca: write("ca.pem", "CERTIFICATE", caDER)}
	p.serverCert, p.serverKey = leaf(2, x509.ExtKeyUsageServerAuth, "server")
	p.clientCert, p.clientKey = leaf(3, x509.ExtKeyUsageClientAuth, "client")
	return p
}

// startTLSServer runs a real nats-server that requires TLS, a client certificate
// signed by the CA, and a user and password.
func startTLSServer(t *testing.T, p pki) string {
	t.Helper()
	tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: p.serverCert, KeyFile: p.serverKey, CaFile: p.ca, Verify: true})
	if err != nil {
		t.Fatal(err)
	}
	opts := &server.Options{Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true,
		TLSConfig: tc, TLS: true, TLSVerify: true, TLSTimeout: 2,
		Users: []*server.User{{Username: "billing", Password: "s3cret"}}}
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server not ready")
	}
	t.Cleanup(s.Shutdown)
	return s.ClientURL()
}

// The worker's NATS flags reach a server that demands TLS with a client
// certificate and a password: the right ones connect, each wrong or missing one
// is refused by the server.
func TestNATSAuthAgainstARealServer(t *testing.T) {
	t.Parallel()
	p := newPKI(t)
	url := strings.Replace(startTLSServer(t, p), "nats://", "tls://", 1)
	good := runenv.NATSAuth{User: "billing", Password: "s3cret", CAFile: p.ca, CertFile: p.clientCert, KeyFile: p.clientKey}
	for _, tc := range []struct {
		name    string
		auth    func(a runenv.NATSAuth) runenv.NATSAuth
		connect bool
	}{
		{"all given", func(a runenv.NATSAuth) runenv.NATSAuth { return a }, true},
		{"wrong password", func(a runenv.NATSAuth) runenv.NATSAuth { a.Password = "guess"; return a }, false},
		{"no client certificate", func(a runenv.NATSAuth) runenv.NATSAuth { a.CertFile, a.KeyFile = "", ""; return a }, false},
		{"the server's CA not trusted", func(a runenv.NATSAuth) runenv.NATSAuth { a.CAFile = ""; return a }, false},
	} {
		opts, err := tc.auth(good).Options()
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		nc, err := nats.Connect(url, append(opts, nats.Timeout(5*time.Second), nats.MaxReconnects(0))...)
		if nc != nil {
			nc.Close()
		}
		if (err == nil) != tc.connect {
			t.Errorf("%s: connect error %v, want connected=%v", tc.name, err, tc.connect)
		}
	}
}

func TestNATSAuthRefusesNonsense(t *testing.T) {
	t.Parallel()
	for name, a := range map[string]runenv.NATSAuth{
		"two identities":     {CredsFile: "u.creds", User: "u"},
		"password, no user":  {Password: "p"},
		"half a client cert": {CertFile: "c.pem"},
	} {
		if _, err := a.Options(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := (runenv.NATSAuth{NKeyFile: filepath.Join(t.TempDir(), "missing.nk")}).Options(); err == nil {
		t.Error("a missing nkey seed file: accepted")
	}
}
