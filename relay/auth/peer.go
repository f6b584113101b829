package auth

import (
	"crypto/tls"
	"errors"
	"fmt"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"github.com/meshrelay/meshrelay/relay/tlsfiles"
)

// PeerTLS returns the TLS configs of relay-to-relay traffic: each side
// presents pair (the tier's certificate) and accepts the other only if its
// certificate chains to roots and carries exactly the SPIFFE ID id (the
// tier's, e.g. spiffe://cluster.local/ns/istio-system/sa/meshrelay). Relays
// dial each other by pod IP, so no host name is checked: the SPIFFE ID is
// the name. Both files are read again when they change.
func PeerTLS(pair *tlsfiles.KeyPair, roots *tlsfiles.CAPool, id string) (server, client *tls.Config, err error) {
	want, err := spiffeid.FromString(id)
	if err != nil {
		return nil, nil, fmt.Errorf("auth: peer identity %q: %w", id, err)
	}
	verify := func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return errors.New("auth: the peer presented no certificate")
		}
		bundle := x509bundle.FromX509Authorities(want.TrustDomain(), roots.Certificates())
		got, _, err := x509svid.Verify(cs.PeerCertificates, bundle)
		if err != nil {
			return fmt.Errorf("auth: peer certificate: %w", err)
		}
		if got != want {
			return fmt.Errorf("auth: peer certificate names %s, not the tier's %s", got, want)
		}
		return nil
	}
	server = tlsfiles.ServerConfig(pair, roots, tls.RequireAnyClientCert)
	server.VerifyConnection = verify
	client = &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return pair.Certificate(), nil
		},
		// The chain and the SPIFFE ID are verified in VerifyConnection,
		// against the tier's roots, instead of a host name.
		InsecureSkipVerify: true, //nolint:gosec // verified below
		VerifyConnection:   verify,
	}
	return server, client, nil
}
