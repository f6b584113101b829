package auth

import (
	"context"
	"crypto/x509"
	"fmt"
	"time"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// Mode says which credentials a stream may prove itself with
// (--xds-auth).
type Mode string

// The authentication modes.
const (
	// ModeNone serves every stream: TLS then only hides the traffic.
	ModeNone Mode = "none"
	// ModeJWT wants a service-account token.
	ModeJWT Mode = "jwt"
	// ModeMTLS wants a SPIFFE client certificate.
	ModeMTLS Mode = "mtls"
	// ModeAny takes a client certificate if one proves an identity, else a
	// token, as istiod does.
	ModeAny Mode = "any"
)

// ParseMode parses an --xds-auth value.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case ModeNone, ModeJWT, ModeMTLS, ModeAny:
		return m, nil
	}
	return "", fmt.Errorf("auth: unknown mode %q (want none, jwt, mtls or any)", s)
}

// Authenticator proves the identity of a gRPC stream from its TLS state and
// metadata. Safe for concurrent use.
type Authenticator struct {
	mode   Mode
	certs  *CertVerifier
	tokens TokenVerifier
}

// NewAuthenticator returns an Authenticator for mode. certs is required for
// mtls and any, tokens for jwt and any; a mode of none needs neither (and
// Authenticate then fails: the caller does not authenticate at all).
func NewAuthenticator(mode Mode, certs *CertVerifier, tokens TokenVerifier) (*Authenticator, error) {
	if _, err := ParseMode(string(mode)); err != nil {
		return nil, err
	}
	if (mode == ModeMTLS || mode == ModeAny) && certs == nil {
		return nil, fmt.Errorf("auth: mode %s needs a client CA (the mesh root) to verify certificates", mode)
	}
	if (mode == ModeJWT || mode == ModeAny) && tokens == nil {
		return nil, fmt.Errorf("auth: mode %s needs a token verifier", mode)
	}
	return &Authenticator{mode: mode, certs: certs, tokens: tokens}, nil
}

// Mode returns the authenticator's mode.
func (a *Authenticator) Mode() Mode { return a.mode }

// Authenticate returns the identity ctx's stream proves: its client
// certificate's, if the mode takes certificates and it proves one, else
// its bearer token's, if the mode takes tokens. The error is an *Error
// (but for a TokenVerifier that could not reach what it asks).
func (a *Authenticator) Authenticate(ctx context.Context) (Identity, error) {
	var certErr error
	if a.certs != nil && a.mode != ModeJWT {
		if chain := peerCertificates(ctx); len(chain) > 0 {
			id, err := a.certs.Verify(chain)
			if err == nil {
				return id, nil
			}
			certErr = err
		}
	}
	if a.tokens != nil && a.mode != ModeMTLS {
		tok, err := BearerToken(ctx)
		if err != nil {
			return Identity{}, err
		}
		if tok != "" {
			return a.tokens.VerifyToken(ctx, tok)
		}
	}
	if certErr != nil {
		return Identity{}, certErr
	}
	switch a.mode {
	case ModeMTLS:
		return Identity{}, fail(NoCredentials, "no client certificate")
	case ModeJWT:
		return Identity{}, fail(NoCredentials, "no authorization: Bearer token")
	}
	return Identity{}, fail(NoCredentials, "neither a client certificate nor an authorization: Bearer token")
}

// Token returns the bearer token ctx's stream carries when it proves id's
// namespace and service account, and when the token expires (zero if it
// does not say): what a relay in forward mode presents upstream for the
// stream's workload. A token that proved id itself is not verified again;
// beside a certificate that proved id, the token is verified as
// Authenticate verifies one (istio-agent on a VM sends both). ok is false
// when the stream has no token, the mode takes none, or the token does not
// prove id: the stream is still admitted by its certificate, it just has
// nothing to forward.
func (a *Authenticator) Token(ctx context.Context, id Identity) (token string, expires time.Time, ok bool) {
	if a.tokens == nil || a.mode == ModeMTLS {
		return "", time.Time{}, false
	}
	tok, err := BearerToken(ctx)
	if err != nil || tok == "" {
		return "", time.Time{}, false
	}
	if id.Method == MethodJWT {
		return tok, id.Expires, true
	}
	tid, err := a.tokens.VerifyToken(ctx, tok)
	if err != nil || tid.Namespace != id.Namespace || tid.ServiceAccount != id.ServiceAccount || tid.TrustDomain != id.TrustDomain {
		return "", time.Time{}, false
	}
	return tok, tid.Expires, true
}

func peerCertificates(ctx context.Context) []*x509.Certificate {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return nil
	}
	return ti.State.PeerCertificates
}
