package auth

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
)

// signingAlgs are the algorithms a service-account token may be signed
// with: the asymmetric ones Kubernetes uses (RS256 by default, ES256 with
// an EC key). "none" and the HMAC family are refused before any key is
// looked at: with them a public key would be a shared secret.
var signingAlgs = []jose.SignatureAlgorithm{
	jose.RS256, jose.RS384, jose.RS512, jose.PS256, jose.PS384, jose.PS512,
	jose.ES256, jose.ES384, jose.ES512, jose.EdDSA,
}

// LocalConfig configures a Local verifier. Start from DefaultLocalConfig.
type LocalConfig struct {
	// Issuer is the token issuer the cluster's API server signs as (its
	// --service-account-issuer, e.g. "https://kubernetes.default.svc.cluster.local").
	// Required.
	Issuer string
	// Audiences: the token must be bound to one of them. Default
	// ["istio-ca"] (what istio-agent asks its tokens for).
	Audiences []string
	// TrustDomain of the identities returned. Default "cluster.local".
	TrustDomain string
	// Keys fetches the issuer's JSON Web Key Set (KeysFromFile,
	// KeysFromURL). Required.
	Keys func(ctx context.Context) (jose.JSONWebKeySet, error)
	// RefreshInterval is the least time between two fetches of Keys when a
	// token names a key id the set does not hold (the issuer rotated its
	// keys): a flood of tokens with made-up key ids costs one fetch a
	// RefreshInterval. Default 1m.
	RefreshInterval time.Duration
	// Leeway is the clock skew allowed on exp, nbf and iat. Default 1m.
	Leeway time.Duration
	// Now is the clock. Default time.Now.
	Now func() time.Time
}

// DefaultLocalConfig returns a LocalConfig with every default but Issuer
// and Keys.
func DefaultLocalConfig() LocalConfig {
	return LocalConfig{
		Audiences:       []string{"istio-ca"},
		TrustDomain:     "cluster.local",
		RefreshInterval: time.Minute,
		Leeway:          time.Minute,
		Now:             time.Now,
	}
}

// Local verifies Kubernetes service-account tokens itself: the signature
// against the issuer's keys, then iss, aud, exp, nbf, and the identity from
// the projected token's "kubernetes.io" claims. It costs one signature
// check a token and no call to the API server. Safe for concurrent use.
type Local struct {
	cfg LocalConfig

	mu      sync.Mutex
	keys    jose.JSONWebKeySet
	fetched time.Time // last fetch attempt
	fetchMu sync.Mutex
}

// NewLocal returns a Local verifier; it fetches the keys once now, so that
// a wrong file or URL fails at start.
func NewLocal(ctx context.Context, cfg LocalConfig) (*Local, error) {
	var errs []error
	bad := func(field, why string) { errs = append(errs, fmt.Errorf("auth: field %s %s", field, why)) }
	if cfg.Issuer == "" {
		bad("Issuer", "is empty")
	}
	if len(cfg.Audiences) == 0 || slices.Contains(cfg.Audiences, "") {
		bad("Audiences", "is empty or holds an empty audience")
	}
	if cfg.TrustDomain == "" {
		bad("TrustDomain", "is empty")
	}
	if cfg.Keys == nil {
		bad("Keys", "is nil")
	}
	if cfg.RefreshInterval <= 0 {
		bad("RefreshInterval", "must be positive")
	}
	if cfg.Leeway < 0 {
		bad("Leeway", "is negative")
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	l := &Local{cfg: cfg}
	keys, err := cfg.Keys(ctx)
	if err != nil {
		return nil, fmt.Errorf("auth: fetch the issuer's keys: %w", err)
	}
	if len(keys.Keys) == 0 {
		return nil, errors.New("auth: the issuer's key set is empty")
	}
	l.keys, l.fetched = keys, cfg.Now()
	return l, nil
}

// k8sClaims are the claims of a projected service-account token.
type k8sClaims struct {
	jwt.Claims
	K8s struct {
		Namespace      string `json:"namespace"`
		ServiceAccount struct {
			Name string `json:"name"`
		} `json:"serviceaccount"`
	} `json:"kubernetes.io"`
}

// VerifyToken implements TokenVerifier.
func (l *Local) VerifyToken(ctx context.Context, token string) (Identity, error) {
	if len(token) > MaxTokenBytes {
		return Identity{}, fail(BadToken, "token of %d bytes exceeds %d", len(token), MaxTokenBytes)
	}
	jws, err := jose.ParseSigned(token, signingAlgs)
	if err != nil {
		return Identity{}, fail(BadToken, "not a JWT signed with an allowed algorithm: %v", err)
	}
	if len(jws.Signatures) != 1 {
		return Identity{}, fail(BadToken, "%d signatures, want one", len(jws.Signatures))
	}
	payload, err := l.verifySignature(ctx, jws)
	if err != nil {
		return Identity{}, err
	}
	var c k8sClaims
	if err := json.Unmarshal(payload, &c); err != nil {
		return Identity{}, fail(BadToken, "claims: %v", err)
	}
	if c.Expiry == nil {
		return Identity{}, fail(BadToken, "no exp claim: not a projected service-account token")
	}
	err = c.ValidateWithLeeway(jwt.Expected{Issuer: l.cfg.Issuer, Time: l.cfg.Now()}, l.cfg.Leeway)
	switch {
	case errors.Is(err, jwt.ErrExpired):
		return Identity{}, fail(Expired, "token expired at %s", c.Expiry.Time().UTC().Format(time.RFC3339))
	case errors.Is(err, jwt.ErrNotValidYet), errors.Is(err, jwt.ErrIssuedInTheFuture):
		return Identity{}, fail(NotYetValid, "token not valid yet")
	case errors.Is(err, jwt.ErrInvalidIssuer):
		return Identity{}, fail(WrongIssuer, "token issued by %q, want %q", c.Issuer, l.cfg.Issuer)
	case err != nil:
		return Identity{}, fail(BadToken, "claims: %v", err)
	}
	if !slices.ContainsFunc(l.cfg.Audiences, c.Audience.Contains) {
		return Identity{}, fail(WrongAudience, "token audiences %q do not include one of %q", []string(c.Audience), l.cfg.Audiences)
	}
	ns, sa := c.K8s.Namespace, c.K8s.ServiceAccount.Name
	if ns == "" || sa == "" {
		return Identity{}, fail(BadToken, "no kubernetes.io namespace and service account claims")
	}
	if sns, ssa, ok := serviceAccountUser(c.Subject); !ok || sns != ns || ssa != sa {
		return Identity{}, fail(BadToken, "subject %q does not name service account %s/%s", c.Subject, ns, sa)
	}
	return Identity{TrustDomain: l.cfg.TrustDomain, Namespace: ns, ServiceAccount: sa, Method: MethodJWT, Expires: c.Expiry.Time()}, nil
}

// verifySignature checks jws against the key its header names (every key
// of a compatible type if it names none), fetching the keys again, at
// most once a RefreshInterval, when the key id is unknown.
func (l *Local) verifySignature(ctx context.Context, jws *jose.JSONWebSignature) ([]byte, error) {
	kid := jws.Signatures[0].Header.KeyID
	keys := l.candidates(kid)
	if len(keys) == 0 && kid != "" && l.refresh(ctx) {
		keys = l.candidates(kid)
	}
	if len(keys) == 0 {
		return nil, fail(BadToken, "no key of the issuer has key id %q", kid)
	}
	for _, k := range keys {
		if payload, err := jws.Verify(k); err == nil {
			return payload, nil
		}
	}
	return nil, fail(BadToken, "signature does not verify")
}

func (l *Local) candidates(kid string) []jose.JSONWebKey {
	l.mu.Lock()
	defer l.mu.Unlock()
	if kid == "" {
		return slices.DeleteFunc(slices.Clone(l.keys.Keys), func(k jose.JSONWebKey) bool { return !k.Valid() || !k.IsPublic() })
	}
	return l.keys.Key(kid)
}

// refresh fetches the keys again unless that was tried within
// RefreshInterval; it reports whether the set changed.
func (l *Local) refresh(ctx context.Context) bool {
	l.fetchMu.Lock()
	defer l.fetchMu.Unlock()
	l.mu.Lock()
	due := l.cfg.Now().Sub(l.fetched) >= l.cfg.RefreshInterval
	if due {
		l.fetched = l.cfg.Now()
	}
	l.mu.Unlock()
	if !due {
		return false
	}
	keys, err := l.cfg.Keys(ctx)
	if err != nil || len(keys.Keys) == 0 {
		return false // keep the keys we have
	}
	l.mu.Lock()
	l.keys = keys
	l.mu.Unlock()
	return true
}

// maxJWKSBytes bounds a fetched key set.
const maxJWKSBytes = 1 << 20

// KeysFromFile reads a JSON Web Key Set from path (what
// `kubectl get --raw /openid/v1/jwks` prints) at every fetch.
func KeysFromFile(path string) func(context.Context) (jose.JSONWebKeySet, error) {
	return func(context.Context) (jose.JSONWebKeySet, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return jose.JSONWebKeySet{}, err
		}
		return parseJWKS(b)
	}
}

// KeysFromURL fetches a JSON Web Key Set from url with client (the API
// server's /openid/v1/jwks, or the jwks_uri of its OIDC discovery
// document); nil client: http.DefaultClient.
func KeysFromURL(url string, client *http.Client) func(context.Context) (jose.JSONWebKeySet, error) {
	if client == nil {
		client = http.DefaultClient
	}
	return func(ctx context.Context) (jose.JSONWebKeySet, error) {
		b, err := fetchJSON(ctx, client, url)
		if err != nil {
			return jose.JSONWebKeySet{}, err
		}
		return parseJWKS(b)
	}
}

// fetchJSON GETs url (at most maxJWKSBytes, within 10 s).
func fetchJSON(ctx context.Context, client *http.Client, url string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxJWKSBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxJWKSBytes {
		return nil, fmt.Errorf("GET %s: over %d bytes", url, maxJWKSBytes)
	}
	return b, nil
}

// parseJWKS decodes a key set, keeping only valid public signing keys.
func parseJWKS(b []byte) (jose.JSONWebKeySet, error) {
	var set jose.JSONWebKeySet
	if err := json.Unmarshal(b, &set); err != nil {
		return set, fmt.Errorf("key set: %w", err)
	}
	set.Keys = slices.DeleteFunc(set.Keys, func(k jose.JSONWebKey) bool {
		return !k.Valid() || !k.IsPublic() || (k.Use != "" && !strings.EqualFold(k.Use, "sig"))
	})
	if len(set.Keys) == 0 {
		return set, errors.New("key set holds no public signing key")
	}
	return set, nil
}

// KeysFromDiscovery finds the issuer's key set through its OpenID Connect
// discovery document (<issuer>/.well-known/openid-configuration, which
// the Kubernetes API server serves), at every fetch: the document's issuer
// must be issuer, and its jwks_uri is fetched as KeysFromURL does. nil
// client: http.DefaultClient.
func KeysFromDiscovery(issuer string, client *http.Client) func(context.Context) (jose.JSONWebKeySet, error) {
	if client == nil {
		client = http.DefaultClient
	}
	return func(ctx context.Context) (jose.JSONWebKeySet, error) {
		doc, err := fetchJSON(ctx, client, strings.TrimSuffix(issuer, "/")+"/.well-known/openid-configuration")
		if err != nil {
			return jose.JSONWebKeySet{}, err
		}
		var d struct {
			Issuer  string `json:"issuer"`
			JWKSURI string `json:"jwks_uri"`
		}
		if err := json.Unmarshal(doc, &d); err != nil {
			return jose.JSONWebKeySet{}, fmt.Errorf("discovery document: %w", err)
		}
		if d.Issuer != issuer {
			return jose.JSONWebKeySet{}, fmt.Errorf("discovery document names issuer %q, want %q", d.Issuer, issuer)
		}
		if d.JWKSURI == "" {
			return jose.JSONWebKeySet{}, errors.New("discovery document has no jwks_uri")
		}
		return KeysFromURL(d.JWKSURI, client)(ctx)
	}
}
