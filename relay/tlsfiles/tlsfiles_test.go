package tlsfiles

import (
	"bytes"
	"crypto/tls"
	"encoding/pem"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/shard/shardtest"
)

// issue returns a new certificate and key (a test PKI's client pair, which
// serves as well as any: the tests' clients skip verification), and its
// CA, as PEM files' contents; each call is another PKI.
func issue(t *testing.T) (certPEM, keyPEM, caPEM []byte) {
	t.Helper()
	c := shardtest.NewCerts(t)
	read := func(f string) []byte {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	return read(c.ClientCertFile), read(c.ClientKeyFile), read(c.CAFile)
}

// leaf returns the DER of the first certificate of certPEM.
func leaf(certPEM []byte) []byte {
	b, _ := pem.Decode(certPEM)
	return b.Bytes
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

// served returns the certificate (DER) a handshake with cfg gets.
func served(t *testing.T, cfg *tls.Config) []byte {
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
	return cl.ConnectionState().PeerCertificates[0].Raw
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

// pairFiles writes a freshly issued certificate and key to files and
// loads them: their paths, the certificate's PEM, and the pair.
func pairFiles(t *testing.T) (certFile, keyFile string, certPEM []byte, pair *KeyPair) {
	t.Helper()
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	certPEM, keyPEM, _ := issue(t)
	writeAtomically(t, certFile, certPEM)
	writeAtomically(t, keyFile, keyPEM)
	pair, err := LoadKeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile, certPEM, pair
}

// TestKeyPairFollowsRotation: a handshake after the files changed gets
// the new certificate; a pair that does not load keeps the last good one
// in service and is reported.
func TestKeyPairFollowsRotation(t *testing.T) {
	cf, kf, c1, pair := pairFiles(t)
	cfg := ServerConfig(pair, nil, tls.NoClientCert)
	if !bytes.Equal(served(t, cfg), leaf(c1)) {
		t.Fatal("did not serve the first certificate")
	}

	c2, k2, _ := issue(t)
	writeAtomically(t, cf, c2) // the certificate first: the pair does not match yet
	if !bytes.Equal(served(t, cfg), leaf(c1)) {
		t.Fatal("with a certificate that does not match its key, did not serve the last good one")
	}
	if _, err := pair.Status(); err == nil {
		t.Error("a pair that does not load is not reported")
	}
	writeAtomically(t, kf, k2)
	if !bytes.Equal(served(t, cfg), leaf(c2)) {
		t.Fatal("after rotation, did not serve the new certificate")
	}
	if _, err := pair.Status(); err != nil {
		t.Errorf("status after a good load: %v", err)
	}
}

// TestKeyPairFollowsSymlinkSwap: a Kubernetes Secret volume replaces its
// files by pointing the ..data symlink at a new directory.
func TestKeyPairFollowsSymlinkSwap(t *testing.T) {
	dir := t.TempDir()
	put := func(version string) []byte {
		c, k, _ := issue(t)
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
		return c
	}
	one := put("v1")
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
	if !bytes.Equal(served(t, cfg), leaf(one)) {
		t.Fatal("did not serve the first certificate")
	}
	two := put("v2")
	if !bytes.Equal(served(t, cfg), leaf(two)) {
		t.Fatal("after the swap, did not serve the new certificate")
	}
}

// TestCAPoolFollowsRotation: client certificates are checked against the
// CA file as it is now.
func TestCAPoolFollowsRotation(t *testing.T) {
	dir := t.TempDir()
	cf, kf, caf := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "ca.crt")
	sc, sk, _ := issue(t)
	writeAtomically(t, cf, sc)
	writeAtomically(t, kf, sk)
	oldCert, oldKey, oldCA := issue(t)
	newCert, newKey, newCA := issue(t)
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
	if !accepts(oldCert, oldKey) || accepts(newCert, newKey) {
		t.Fatal("before rotation: want the old client accepted and the new one refused")
	}
	writeAtomically(t, caf, newCA)
	if accepts(oldCert, oldKey) || !accepts(newCert, newKey) {
		t.Fatal("after rotation: want the new client accepted and the old one refused")
	}
	if _, err := LoadCAPool(filepath.Join(dir, "tls.key")); err == nil {
		t.Error("a CA file without a certificate was taken")
	}
}

// TestServerConfigModernOnly: TLS 1.0 and 1.1, and TLS 1.2 suites without
// forward secrecy or AEAD, are refused; TLS 1.2 with an AEAD suite is
// served.
func TestServerConfigModernOnly(t *testing.T) {
	_, _, _, pair := pairFiles(t)
	cfg := ServerConfig(pair, nil, tls.NoClientCert)
	for _, tc := range []struct {
		name   string
		client *tls.Config
		ok     bool
	}{
		{"TLS 1.3", &tls.Config{MinVersion: tls.VersionTLS13}, true},
		{"TLS 1.2 AES-GCM", &tls.Config{MaxVersion: tls.VersionTLS12, CipherSuites: []uint16{tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256}}, true},
		{"TLS 1.2 CBC", &tls.Config{MaxVersion: tls.VersionTLS12, CipherSuites: []uint16{tls.TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA}}, false},
		{"TLS 1.1", &tls.Config{MinVersion: tls.VersionTLS10, MaxVersion: tls.VersionTLS11}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, s := pipe(t)
			defer c.Close()
			defer s.Close()
			done := make(chan error, 1)
			go func() { done <- tls.Server(s, cfg).Handshake() }()
			tc.client.InsecureSkipVerify = true
			err := tls.Client(c, tc.client).Handshake()
			if serr := <-done; (err == nil && serr == nil) != tc.ok {
				t.Fatalf("handshake: client %v, server %v; want ok=%v", err, serr, tc.ok)
			}
		})
	}
}
