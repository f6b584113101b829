package tlsfiles

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// issue returns a self-signed certificate for name, as PEM files' contents.
func issue(t *testing.T, name string) (certPEM, keyPEM []byte, cert *x509.Certificate) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		DNSNames: []string{name}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, IsCA: true, BasicConstraintsValid: true,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ = x509.ParseCertificate(der)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), cert
}

// pipe returns the two ends of a loopback TCP connection (buffered, unlike
// net.Pipe: a TLS peer may write an alert nobody reads).
func pipe(t *testing.T) (client, server net.Conn) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	client, err = net.Dial("tcp", lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if server, err = lis.Accept(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second) // a failing test must not hang
	client.SetDeadline(deadline)
	server.SetDeadline(deadline)
	return client, server
}

// served returns the name on the certificate a handshake with cfg gets.
func served(t *testing.T, cfg *tls.Config) string {
	t.Helper()
	c, s := pipe(t)
	defer c.Close()
	defer s.Close()
	done := make(chan error, 1)
	go func() { done <- tls.Server(s, cfg).Handshake() }()
	cl := tls.Client(c, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}})
	if err := cl.Handshake(); err != nil {
		t.Fatalf("handshake: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("server handshake: %v", err)
	}
	return cl.ConnectionState().PeerCertificates[0].Subject.CommonName
}

// writeAtomically replaces path's content the way rotation tools do: a new
// file renamed over the old one.
func writeAtomically(t *testing.T, path string, b []byte) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// TestKeyPairFollowsRotation: a handshake after the files changed gets
// the new certificate; a pair that does not load keeps the last good one
// in service and is reported.
func TestKeyPairFollowsRotation(t *testing.T) {
	dir := t.TempDir()
	cf, kf := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	c1, k1, _ := issue(t, "one")
	writeAtomically(t, cf, c1)
	writeAtomically(t, kf, k1)
	pair, err := LoadKeyPair(cf, kf)
	if err != nil {
		t.Fatal(err)
	}
	cfg := ServerConfig(pair, nil, tls.NoClientCert)
	if got := served(t, cfg); got != "one" {
		t.Fatalf("served %q, want one", got)
	}

	c2, k2, _ := issue(t, "two")
	writeAtomically(t, cf, c2) // the certificate first: the pair does not match yet
	if got := served(t, cfg); got != "one" {
		t.Fatalf("with a certificate that does not match its key, served %q, want the last good one", got)
	}
	if _, err := pair.Status(); err == nil {
		t.Error("a pair that does not load is not reported")
	}
	writeAtomically(t, kf, k2)
	if got := served(t, cfg); got != "two" {
		t.Fatalf("after rotation served %q, want two", got)
	}
	if _, err := pair.Status(); err != nil {
		t.Errorf("status after a good load: %v", err)
	}
}

// TestKeyPairFollowsSymlinkSwap: a Kubernetes Secret volume replaces its
// files by pointing the ..data symlink at a new directory.
func TestKeyPairFollowsSymlinkSwap(t *testing.T) {
	dir := t.TempDir()
	put := func(version, name string) {
		c, k, _ := issue(t, name)
		d := filepath.Join(dir, version)
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		writeAtomically(t, filepath.Join(d, "tls.crt"), c)
		writeAtomically(t, filepath.Join(d, "tls.key"), k)
		tmp := filepath.Join(dir, "..data_tmp")
		if err := os.Symlink(version, tmp); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
	}
	put("v1", "one")
	for _, f := range []string{"tls.crt", "tls.key"} {
		if err := os.Symlink(filepath.Join("..data", f), filepath.Join(dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	pair, err := LoadKeyPair(filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := ServerConfig(pair, nil, tls.NoClientCert)
	if got := served(t, cfg); got != "one" {
		t.Fatalf("served %q, want one", got)
	}
	put("v2", "two")
	if got := served(t, cfg); got != "two" {
		t.Fatalf("after the swap served %q, want two", got)
	}
}

// TestCAPoolFollowsRotation: client certificates are checked against the
// CA file as it is now.
func TestCAPoolFollowsRotation(t *testing.T) {
	dir := t.TempDir()
	cf, kf, caf := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "ca.crt")
	sc, sk, _ := issue(t, "server")
	writeAtomically(t, cf, sc)
	writeAtomically(t, kf, sk)
	oldCA, oldKey, _ := issue(t, "old-client")
	newCA, newKey, _ := issue(t, "new-client")
	writeAtomically(t, caf, oldCA)
	pair, err := LoadKeyPair(cf, kf)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := LoadCAPool(caf)
	if err != nil {
		t.Fatal(err)
	}
	cfg := ServerConfig(pair, pool, tls.RequireAndVerifyClientCert)
	accepts := func(certPEM, keyPEM []byte) bool {
		client, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		c, s := pipe(t)
		defer c.Close()
		defer s.Close()
		done := make(chan error, 1)
		go func() { done <- tls.Server(s, cfg).Handshake() }()
		cl := tls.Client(c, &tls.Config{InsecureSkipVerify: true, Certificates: []tls.Certificate{client}})
		_ = cl.Handshake() // TLS 1.3: the client learns of a refusal later
		err = <-done
		return err == nil
	}
	if !accepts(oldCA, oldKey) || accepts(newCA, newKey) {
		t.Fatal("before rotation: want the old client accepted and the new one refused")
	}
	writeAtomically(t, caf, newCA)
	if accepts(oldCA, oldKey) || !accepts(newCA, newKey) {
		t.Fatal("after rotation: want the new client accepted and the old one refused")
	}
	if _, err := LoadCAPool(filepath.Join(dir, "tls.key")); err == nil {
		t.Error("a CA file without a certificate was taken")
	}
}
