package snapshot

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

// TestEmbeddedListensOnAPrivateSocketOnly: by default the embedded etcd
// has no TCP port (client or peer), its socket and data directory are
// this user's alone, and the socket serves.
func TestEmbeddedListensOnAPrivateSocketOnly(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "etcd")
	e, err := StartEmbedded(t.Context(), EmbeddedConfig{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	for _, l := range e.e.Clients {
		if l.Addr().Network() != "unix" {
			t.Errorf("client listener on %s %s, want the unix socket alone", l.Addr().Network(), l.Addr())
		}
	}
	if len(e.e.Peers) != 0 {
		t.Errorf("%d peer listeners, want none", len(e.e.Peers))
	}
	if e.TLSEndpoint() != "" {
		t.Errorf("TLSEndpoint() = %q, want none", e.TLSEndpoint())
	}
	for path, want := range map[string]os.FileMode{dir: 0o700, filepath.Join(dir, socketName): 0o600} {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != want {
			t.Errorf("%s has mode %o, want %o", path, got, want)
		}
	}
	if eps := e.Endpoints(); len(eps) != 1 || !strings.HasPrefix(eps[0], "unix:///") {
		t.Fatalf("Endpoints() = %v, want the socket's unix:/// URL", eps)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Put(t.Context(), "k", "v"); err != nil {
		t.Errorf("Put over the socket: %v", err)
	}
}

// TestEmbeddedTCPRequiresClientCertificates: a TCP client port is refused
// without what it takes to require client certificates, and, given them,
// answers a client that presents one and refuses one that does not.
func TestEmbeddedTCPRequiresClientCertificates(t *testing.T) {
	ca := authtest.NewCA(t, "etcd-ca")
	serverCert, serverKey := ca.Serving(t).Write(t, t.TempDir())
	caFile := ca.WriteRoot(t)

	for _, c := range []EmbeddedConfig{
		{ClientAddr: "127.0.0.1:0"},
		{ClientAddr: "127.0.0.1:0", CertFile: serverCert, KeyFile: serverKey},
		{ClientAddr: "0.0.0.0:0", ClientCAFile: caFile},
	} {
		c.Dir = t.TempDir()
		if e, err := StartEmbedded(t.Context(), c); !errors.Is(err, ErrClientCertsRequired) {
			if e != nil {
				e.Close()
			}
			t.Errorf("StartEmbedded(%+v) error = %v, want ErrClientCertsRequired", c, err)
		}
	}

	e, err := StartEmbedded(t.Context(), EmbeddedConfig{
		Dir: t.TempDir(), ClientAddr: "127.0.0.1:0",
		CertFile: serverCert, KeyFile: serverKey, ClientCAFile: caFile,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	addr := strings.TrimPrefix(e.TLSEndpoint(), "https://")
	if _, _, err := net.SplitHostPort(addr); err != nil {
		t.Fatalf("TLSEndpoint() = %q: %v", e.TLSEndpoint(), err)
	}
	roots := ca.Pool()
	try := func(cfg *tls.Config) error {
		cli, err := clientv3.New(clientv3.Config{Endpoints: []string{e.TLSEndpoint()}, TLS: cfg, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			return err
		}
		defer cli.Close()
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		_, err = cli.Put(ctx, "k", "v")
		return err
	}
	if err := try(&tls.Config{RootCAs: roots}); err == nil {
		t.Error("a client without a certificate was answered on the TCP port")
	}
	other := authtest.NewCA(t, "another-ca").Issue(t, authtest.Leaf{CommonName: "intruder"})
	if err := try(&tls.Config{RootCAs: roots, Certificates: []tls.Certificate{other.TLS}}); err == nil {
		t.Error("a client with a certificate from another CA was answered on the TCP port")
	}
	// A plaintext client is not answered either.
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"http://" + addr}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	_, err = cli.Put(ctx, "k", "v")
	cancel()
	cli.Close()
	if err == nil {
		t.Error("a plaintext client was answered on the TCP port")
	}
	client := ca.Issue(t, authtest.Leaf{CommonName: "meshrelay"})
	if err := try(&tls.Config{RootCAs: roots, Certificates: []tls.Certificate{client.TLS}}); err != nil {
		t.Errorf("a client with a certificate from the CA: %v", err)
	}
}

func TestEmbeddedSocketPathTooLong(t *testing.T) {
	dir := filepath.Join(t.TempDir(), strings.Repeat("d", 120))
	if _, err := StartEmbedded(t.Context(), EmbeddedConfig{Dir: dir}); err == nil || !strings.Contains(err.Error(), "shorter data directory") {
		t.Errorf("StartEmbedded(a data directory of %d bytes) error = %v, want one that asks for a shorter one", len(dir), err)
	}
}
