package auth

import (
	"crypto/x509"
	"fmt"
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// ParseSPIFFEID parses an Istio workload ID,
// spiffe://<trust domain>/ns/<namespace>/sa/<service account>, with
// go-spiffe's parser (which enforces the SPIFFE ID grammar). Another shape
// is a NoSPIFFEID error.
func ParseSPIFFEID(s string) (Identity, error) {
	id, err := spiffeid.FromString(s)
	if err != nil {
		return Identity{}, fail(NoSPIFFEID, "not a SPIFFE ID: %v", err)
	}
	return fromSPIFFE(id)
}

func fromSPIFFE(id spiffeid.ID) (Identity, error) {
	seg := strings.Split(strings.TrimPrefix(id.Path(), "/"), "/")
	if len(seg) != 4 || seg[0] != "ns" || seg[2] != "sa" || seg[1] == "" || seg[3] == "" {
		return Identity{}, fail(NoSPIFFEID, "SPIFFE ID %s is not of the form spiffe://<trust domain>/ns/<namespace>/sa/<service account>", id)
	}
	return Identity{TrustDomain: id.TrustDomain().Name(), Namespace: seg[1], ServiceAccount: seg[3]}, nil
}

// CertVerifier proves identities from client certificates: the chain must
// lead to one of Roots' certificates, and the leaf must carry exactly one
// URI SAN, an Istio workload ID of TrustDomain (go-spiffe's X509-SVID
// rules: not a CA, a digital signature key usage).
type CertVerifier struct {
	// TrustDomain is the mesh's trust domain, e.g. "cluster.local".
	TrustDomain string
	// Roots returns the current CA certificates (the mesh root); it is
	// called at every verification, so a rotated root file is used at once.
	Roots func() []*x509.Certificate
	// Now is the clock; nil: time.Now.
	Now func() time.Time
}

// Verify returns the identity chain proves. chain is the peer's
// certificates as the TLS handshake received them, leaf first; the
// handshake did not verify them.
func (v *CertVerifier) Verify(chain []*x509.Certificate) (Identity, error) {
	if len(chain) == 0 {
		return Identity{}, fail(NoCredentials, "no client certificate")
	}
	id, err := x509svid.IDFromCert(chain[0])
	if err != nil {
		return Identity{}, fail(NoSPIFFEID, "client certificate: %v", err)
	}
	td, err := spiffeid.TrustDomainFromString(v.TrustDomain)
	if err != nil {
		return Identity{}, fmt.Errorf("auth: trust domain %q: %w", v.TrustDomain, err)
	}
	if !id.MemberOf(td) {
		return Identity{}, fail(WrongTrustDomain, "client certificate names %s, not of trust domain %s", id, td.Name())
	}
	ident, err := fromSPIFFE(id)
	if err != nil {
		return Identity{}, err
	}
	now := time.Now
	if v.Now != nil {
		now = v.Now
	}
	bundle := x509bundle.FromX509Authorities(td, v.Roots())
	if _, _, err := x509svid.Verify(chain, bundle, x509svid.WithTime(now())); err != nil {
		return Identity{}, fail(UntrustedCert, "client certificate for %s: %v", id, err)
	}
	ident.Method, ident.Expires = MethodMTLS, chain[0].NotAfter
	return ident, nil
}
