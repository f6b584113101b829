package authtest

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
	"net/url"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// CA is a throwaway mesh CA (Istio's root, in a test): it issues SPIFFE
// workload certificates and serving certificates.
type CA struct {
	Cert *x509.Certificate
	key  *ecdsa.PrivateKey
	next atomic.Int64
}

// NewCA returns a CA valid for a day.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	ca, err := MakeCA(name)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// MakeCA is NewCA for a caller that is not a test (a benchmark run).
func MakeCA(name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	ca := &CA{Cert: cert, key: key}
	ca.next.Store(1)
	return ca, nil
}

// Pool returns a pool of the CA alone.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// RootPEM is the CA's certificate in PEM.
func (ca *CA) RootPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Cert.Raw})
}

// KeyPEM returns the CA's private key (a CA a test hands to another
// signer: istiod's plugged-in CA).
func (ca *CA) KeyPEM() []byte {
	der, err := x509.MarshalECPrivateKey(ca.key)
	if err != nil {
		panic(err) // a P-256 key always marshals
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
}

// WriteRoot writes the CA's certificate to a file and returns its path.
func (ca *CA) WriteRoot(t testing.TB) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "root-cert.pem")
	if err := os.WriteFile(p, ca.RootPEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// Leaf describes a certificate to issue.
type Leaf struct {
	// URIs are URI SANs (a SPIFFE ID for a workload).
	URIs []string
	// DNSNames and IPs are name SANs (a serving certificate's).
	DNSNames []string
	IPs      []net.IP
	// Validity; zero NotBefore: an hour ago; zero NotAfter: a day later.
	NotBefore, NotAfter time.Time
	// Subject's common name and organizations (a Kubernetes client
	// certificate's user and groups).
	CommonName   string
	Organization []string
}

// Issue signs leaf, for client and server use.
func (ca *CA) Issue(t testing.TB, leaf Leaf) *Issued {
	t.Helper()
	is, err := ca.Make(leaf)
	if err != nil {
		t.Fatal(err)
	}
	return is
}

// Make is Issue for a caller that is not a test.
func (ca *CA) Make(leaf Leaf) (*Issued, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	if leaf.NotBefore.IsZero() {
		leaf.NotBefore = time.Now().Add(-time.Hour)
	}
	if leaf.NotAfter.IsZero() {
		leaf.NotAfter = leaf.NotBefore.Add(24 * time.Hour)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(ca.next.Add(1)),
		NotBefore:    leaf.NotBefore, NotAfter: leaf.NotAfter,
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:    leaf.DNSNames, IPAddresses: leaf.IPs,
		Subject: pkix.Name{CommonName: leaf.CommonName, Organization: leaf.Organization},
	}
	for _, u := range leaf.URIs {
		pu, err := url.Parse(u)
		if err != nil {
			return nil, err
		}
		tmpl.URIs = append(tmpl.URIs, pu)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	is := &Issued{
		CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		KeyPEM:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}),
	}
	if is.TLS, err = tls.X509KeyPair(is.CertPEM, is.KeyPEM); err != nil {
		return nil, err
	}
	return is, nil
}

// Workload issues a workload certificate for spiffe://<td>/ns/<ns>/sa/<sa>.
func (ca *CA) Workload(t testing.TB, td, ns, sa string) *Issued {
	t.Helper()
	return ca.Issue(t, Leaf{URIs: []string{"spiffe://" + td + "/ns/" + ns + "/sa/" + sa}})
}

// Serving issues a serving certificate for localhost and 127.0.0.1 and
// the given DNS names.
func (ca *CA) Serving(t testing.TB, dnsNames ...string) *Issued {
	t.Helper()
	return ca.Issue(t, Leaf{DNSNames: append([]string{"localhost"}, dnsNames...), IPs: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}})
}

// Issued is an issued certificate and its key.
type Issued struct {
	TLS             tls.Certificate
	CertPEM, KeyPEM []byte
}

// Write writes the certificate and key to files in dir (a new temporary
// directory if ""), replacing them if they exist, and returns their paths.
func (is *Issued) Write(t testing.TB, dir string) (certFile, keyFile string) {
	t.Helper()
	if dir == "" {
		dir = t.TempDir()
	}
	certFile, keyFile = filepath.Join(dir, "cert-chain.pem"), filepath.Join(dir, "key.pem")
	// The key first, as a rotation does: a reader that sees the new key
	// with the old certificate fails and keeps the last good pair.
	for _, f := range []struct {
		path string
		b    []byte
	}{{keyFile, is.KeyPEM}, {certFile, is.CertPEM}} {
		tmp := f.path + ".tmp"
		if err := os.WriteFile(tmp, f.b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, f.path); err != nil {
			t.Fatal(err)
		}
	}
	return certFile, keyFile
}

// Leaf returns the parsed certificate.
func (is *Issued) Leaf() *x509.Certificate {
	c, _ := x509.ParseCertificate(is.TLS.Certificate[0])
	return c
}
