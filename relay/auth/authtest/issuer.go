// Package authtest holds test doubles for relay/auth: a service-account
// token issuer, a mesh CA that issues SPIFFE workload certificates, and a
// Kubernetes API endpoint that answers TokenReviews. They produce real
// credentials (real signatures, real X.509 chains) so the code under test
// verifies them exactly as it would in a cluster.
package authtest

import (
	"crypto/rand"
	"crypto/rsa"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
)

// DefaultIssuer is the issuer Kubernetes API servers sign as by default.
const DefaultIssuer = "https://kubernetes.default.svc.cluster.local"

// Issuer signs service-account tokens the way the Kubernetes API server
// does for projected volumes (RS256, a key id, iss, sub, aud, exp, nbf,
// iat, and the kubernetes.io claims).
type Issuer struct {
	// URL is the iss claim of the tokens.
	URL string
	// KeyID is the kid of the signing key.
	KeyID string
	key   *rsa.PrivateKey
}

// NewIssuer returns an Issuer with a fresh 2048-bit RSA key.
func NewIssuer(t testing.TB) *Issuer {
	t.Helper()
	is, err := MakeIssuer()
	if err != nil {
		t.Fatal(err)
	}
	return is
}

// MakeIssuer is NewIssuer for a caller that is not a test.
func MakeIssuer() (*Issuer, error) {
	k, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	return &Issuer{URL: DefaultIssuer, KeyID: "test-key-1", key: k}, nil
}

// Token is what a token says; zero fields get Issuer's defaults.
type Token struct {
	Namespace, ServiceAccount string
	// Audiences; nil: ["istio-ca"].
	Audiences []string
	// Issuer; "": the Issuer's URL.
	Issuer string
	// IssuedAt; zero: now. NotBefore is IssuedAt, Expiry IssuedAt+TTL.
	IssuedAt time.Time
	// TTL; zero: an hour.
	TTL time.Duration
	// Subject; "": system:serviceaccount:<ns>:<sa>.
	Subject string
}

// Sign returns the signed, compact-serialised token.
func (is *Issuer) Sign(t testing.TB, tok Token) string {
	t.Helper()
	s, err := is.Make(tok)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Make is Sign for a caller that is not a test.
func (is *Issuer) Make(tok Token) (string, error) {
	return is.sign(jose.SigningKey{Algorithm: jose.RS256, Key: jose.JSONWebKey{Key: is.key, KeyID: is.KeyID}}, tok)
}

// SignWith signs tok with another key or algorithm (forgeries).
func (is *Issuer) SignWith(t testing.TB, key jose.SigningKey, tok Token) string {
	t.Helper()
	s, err := is.sign(key, tok)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func (is *Issuer) sign(key jose.SigningKey, tok Token) (string, error) {
	sig, err := jose.NewSigner(key, (&jose.SignerOptions{}).WithType("JWT"))
	if err != nil {
		return "", err
	}
	return jwt.Signed(sig).Claims(is.claims(tok)).Serialize()
}

// claims returns the claims Sign puts in tok, as a JSON object.
func (is *Issuer) claims(tok Token) map[string]any {
	if tok.Audiences == nil {
		tok.Audiences = []string{"istio-ca"}
	}
	if tok.Issuer == "" {
		tok.Issuer = is.URL
	}
	if tok.IssuedAt.IsZero() {
		tok.IssuedAt = time.Now()
	}
	if tok.TTL == 0 {
		tok.TTL = time.Hour
	}
	if tok.Subject == "" {
		tok.Subject = "system:serviceaccount:" + tok.Namespace + ":" + tok.ServiceAccount
	}
	jti := make([]byte, 16)
	rand.Read(jti)
	return map[string]any{
		// A random jti, as Kubernetes (1.29 on) writes: two tokens of one
		// service account signed in the same second still differ.
		"jti": hex.EncodeToString(jti),
		"iss": tok.Issuer, "sub": tok.Subject, "aud": tok.Audiences,
		"iat": tok.IssuedAt.Unix(), "nbf": tok.IssuedAt.Unix(), "exp": tok.IssuedAt.Add(tok.TTL).Unix(),
		"kubernetes.io": map[string]any{
			"namespace":      tok.Namespace,
			"serviceaccount": map[string]any{"name": tok.ServiceAccount, "uid": "00000000-0000-0000-0000-000000000001"},
			"pod":            map[string]any{"name": tok.ServiceAccount + "-pod", "uid": "00000000-0000-0000-0000-000000000002"},
		},
	}
}

// JWKS returns the issuer's public key set, as /openid/v1/jwks serves it.
func (is *Issuer) JWKS() jose.JSONWebKeySet {
	return jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &is.key.PublicKey, KeyID: is.KeyID, Algorithm: string(jose.RS256), Use: "sig"}}}
}

// PublicKeyBytes is the public key as the bytes a naive verifier might
// use as an HMAC secret (for the HS256 forgery).
func (is *Issuer) PublicKeyBytes() []byte {
	b, _ := json.Marshal(is.JWKS())
	return b
}

// WriteJWKS writes the key set to a file in t's temporary directory and
// returns its path.
func (is *Issuer) WriteJWKS(t testing.TB) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "jwks.json")
	if err := is.WriteJWKSFile(p); err != nil {
		t.Fatal(err)
	}
	return p
}

// WriteJWKSFile writes the key set to path.
func (is *Issuer) WriteJWKSFile(path string) error {
	b, err := json.Marshal(is.JWKS())
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o600)
}

// WriteToken writes a token to a file (istio-agent's
// ./var/run/secrets/tokens/istio-token) and returns its path.
func WriteToken(t testing.TB, token string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "istio-token")
	if err := os.WriteFile(p, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
