// Package shardtest holds the fakes of tests of the shard package and its
// callers: a throwaway PKI for the admin listener.
package shardtest

import (
	"crypto/tls"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

// Certs is a throwaway PKI for tests of the admin listener's TLS: a CA, a
// server certificate for 127.0.0.1 and localhost, and a client certificate,
// as tls.Configs and as PEM files in a test's temporary directory. It is
// authtest's mesh CA, shaped for the admin listener.
type Certs struct {
	// Server serves TLS and requires a client certificate the CA signed.
	Server *tls.Config
	// Client trusts the CA and presents the client certificate.
	Client *tls.Config
	// Files, in PEM: the CA's certificate, the client's certificate and
	// key.
	CAFile, ClientCertFile, ClientKeyFile string
}

// NewCerts makes a Certs valid for an hour.
func NewCerts(t testing.TB) *Certs {
	t.Helper()
	ca := authtest.NewCA(t, "meshrelay test CA")
	hour := authtest.Leaf{NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour)}
	serverLeaf := hour
	serverLeaf.DNSNames, serverLeaf.IPs = []string{"localhost"}, []net.IP{net.IPv4(127, 0, 0, 1)}
	server, client := ca.Issue(t, serverLeaf), ca.Issue(t, hour)
	dir := t.TempDir()
	c := &Certs{
		Server: &tls.Config{Certificates: []tls.Certificate{server.TLS}, ClientCAs: ca.Pool(), ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12},
		Client: &tls.Config{Certificates: []tls.Certificate{client.TLS}, RootCAs: ca.Pool(), MinVersion: tls.VersionTLS12},
		CAFile: filepath.Join(dir, "ca.pem"),
	}
	c.ClientCertFile, c.ClientKeyFile = client.Write(t, dir)
	if err := os.WriteFile(c.CAFile, ca.RootPEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	return c
}
