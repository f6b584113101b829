package auth

import (
	"container/list"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// TokenReviewConfig configures a TokenReview verifier. Start from
// DefaultTokenReviewConfig.
type TokenReviewConfig struct {
	// Client is the Kubernetes clientset the reviews are sent with
	// (in-cluster: kubernetes.NewForConfig(rest.InClusterConfig())); its
	// service account needs RBAC to create tokenreviews.authentication.k8s.io.
	// Mind its rate limiter: a rest.Config with QPS 0 gets client-go's
	// default of 5 requests a second (burst 10), which then bounds reviews.
	// Required.
	Client kubernetes.Interface
	// Audiences the token must be bound to: sent as the review's
	// spec.audiences, and the returned status.audiences must hold one of
	// them (an empty status.audiences means the token is bound to the API
	// server only, and is refused). Default ["istio-ca"]. Must not be empty.
	Audiences []string
	// TrustDomain of the identities returned. Default "cluster.local".
	TrustDomain string
	// CacheSize bounds the cached verdicts, in entries (a few hundred
	// bytes each: a hash, an identity, times). When full, expired entries go first (a sweep at most once a
	// second), then the least recently used. Default 100,000. Must be
	// positive.
	CacheSize int
	// MaxTTL bounds how long a positive verdict is cached. It is also
	// capped at the token's exp, read from the JWT payload without
	// verifying it: it can only shorten the cache, never lengthen it, and a
	// token whose exp cannot be read is cached for MaxTTL. So a token the
	// API server would now refuse (deleted pod or service account) is
	// still believed for up to MaxTTL. Default 5m. Must be positive.
	MaxTTL time.Duration
	// NegativeTTL is how long a refusal by the API server is cached
	// (authenticated=false, wrong audience, not a service account), so that
	// a flood of one bad token costs one review. Errors talking to the API
	// server are never cached. Default 10s; 0: refusals are not cached.
	NegativeTTL time.Duration
	// MaxInFlight bounds concurrent reviews; callers beyond it wait for a
	// slot, or for their context. Default 16. Must be positive.
	MaxInFlight int
	// Timeout bounds one review call to the API server. Default 5s. Must
	// be positive.
	Timeout time.Duration
	// Now is the clock that token expiry and cache lifetimes are read
	// against (tests move it). Default time.Now; nil: time.Now.
	Now func() time.Time
}

// DefaultTokenReviewConfig returns a TokenReviewConfig with every default
// filled in but Client.
func DefaultTokenReviewConfig() TokenReviewConfig {
	return TokenReviewConfig{
		Audiences:   []string{"istio-ca"},
		TrustDomain: "cluster.local",
		CacheSize:   100_000,
		MaxTTL:      5 * time.Minute,
		NegativeTTL: 10 * time.Second,
		MaxInFlight: 16,
		Timeout:     5 * time.Second,
		Now:         time.Now,
	}
}

// sweepInterval is the least time between two sweeps of expired verdicts
// from a full cache (a sweep walks every entry under the lock).
const sweepInterval = time.Second

// TokenReview verifies service-account tokens by asking the Kubernetes
// TokenReview API (authentication.k8s.io/v1), as istiod's
// KubeJWTAuthenticator does, and caches the verdicts.
//
// The cache is keyed by the SHA-256 of the token; the token itself is held
// only while its review is in flight. Concurrent callers with the same token
// share one review, so N streams carrying K distinct tokens cost at most K
// reviews. A token that is not a three-part base64url JWT, or whose exp
// (read without verifying it) has passed, is refused without a review.
//
// Safe for concurrent use. It has nothing to stop: a review runs on a
// goroutine of its own, which ends when the review does (within Timeout)
// or as soon as no caller waits for it.
type TokenReview struct {
	cfg TokenReviewConfig
	sem chan struct{} // one token per review in flight

	mu        sync.Mutex
	cache     map[tokenKey]*list.Element // of *verdict
	lru       list.List                  // of *verdict, most recently used first
	flights   map[tokenKey]*flight
	nextSweep time.Time

	reviews, hits, shared atomic.Uint64
}

// TokenReviewStats counts a TokenReview's work since it was made.
type TokenReviewStats struct {
	// Reviews is the TokenReview API calls made (failed ones included).
	Reviews uint64
	// Hits is the calls answered from the verdict cache.
	Hits uint64
	// Shared is the calls that waited for another caller's review of the
	// same token.
	Shared uint64
	// Cached is the verdicts in the cache now (expired ones not yet
	// dropped included).
	Cached int
}

// tokenKey is the SHA-256 of a token.
type tokenKey [sha256.Size]byte

// verdict is a cached answer: an identity, or a refusal.
type verdict struct {
	key   tokenKey
	id    Identity
	err   *Error // nil: id is the answer
	until time.Time
}

func (v *verdict) result() (Identity, error) {
	if v.err != nil {
		return Identity{}, v.err
	}
	return v.id, nil
}

// flight is a review in progress; its callers wait for done.
type flight struct {
	done    chan struct{}
	cancel  context.CancelFunc
	waiters int // guarded by TokenReview.mu

	// Set before done is closed.
	id  Identity
	err error
}

// NewTokenReview returns a TokenReview verifier.
func NewTokenReview(cfg TokenReviewConfig) (*TokenReview, error) {
	var errs []error
	bad := func(field, why string) { errs = append(errs, fmt.Errorf("auth: field %s %s", field, why)) }
	if cfg.Client == nil {
		bad("Client", "is nil: TokenReview needs a Kubernetes clientset")
	}
	if len(cfg.Audiences) == 0 || slices.Contains(cfg.Audiences, "") {
		bad("Audiences", "is empty or holds an empty audience")
	}
	if cfg.TrustDomain == "" {
		bad("TrustDomain", "is empty")
	}
	if cfg.CacheSize <= 0 {
		bad("CacheSize", "must be positive")
	}
	if cfg.MaxTTL <= 0 {
		bad("MaxTTL", "must be positive")
	}
	if cfg.NegativeTTL < 0 {
		bad("NegativeTTL", "is negative")
	}
	if cfg.MaxInFlight <= 0 {
		bad("MaxInFlight", "must be positive")
	}
	if cfg.Timeout <= 0 {
		bad("Timeout", "must be positive")
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	cfg.Audiences = slices.Clone(cfg.Audiences)
	return &TokenReview{
		cfg:     cfg,
		sem:     make(chan struct{}, cfg.MaxInFlight),
		cache:   make(map[tokenKey]*list.Element),
		flights: make(map[tokenKey]*flight),
	}, nil
}

// Stats returns the counters.
func (t *TokenReview) Stats() TokenReviewStats {
	t.mu.Lock()
	n := len(t.cache)
	t.mu.Unlock()
	return TokenReviewStats{Reviews: t.reviews.Load(), Hits: t.hits.Load(), Shared: t.shared.Load(), Cached: n}
}

// VerifyToken implements TokenVerifier. It answers from the cache, or
// joins the review of the same token in flight, or starts one; it waits
// for the answer or for ctx. Refusals are *Error: BadToken, Expired,
// ReviewDenied, WrongAudience, and ReviewFailed when the API server could
// not be asked or ctx ended first.
func (t *TokenReview) VerifyToken(ctx context.Context, token string) (Identity, error) {
	if len(token) > MaxTokenBytes {
		return Identity{}, fail(BadToken, "token of %d bytes exceeds %d", len(token), MaxTokenBytes)
	}
	// A cached verdict first: it never outlives the token's exp, so a hit
	// needs no parse (which would cost about what a local verification
	// does).
	now := t.cfg.Now()
	key := tokenKey(sha256.Sum256([]byte(token)))
	t.mu.Lock()
	v := t.lookupLocked(key, now)
	t.mu.Unlock()
	if v != nil {
		t.hits.Add(1)
		return v.result()
	}
	exp, err := unverifiedExpiry(token)
	if err != nil {
		return Identity{}, err
	}
	if !exp.IsZero() && !now.Before(exp) {
		return Identity{}, fail(Expired, "token expired at %s", exp.UTC().Format(time.RFC3339))
	}

	t.mu.Lock()
	if v := t.lookupLocked(key, now); v != nil {
		t.mu.Unlock()
		t.hits.Add(1)
		return v.result()
	}
	f, ok := t.flights[key]
	if ok {
		t.shared.Add(1)
	} else {
		// The review outlives a caller that gives up while others wait:
		// it runs on a context of its own, cancelled when the last
		// waiter leaves. WithoutCancel keeps the first caller's values.
		fctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		f = &flight{done: make(chan struct{}), cancel: cancel}
		t.flights[key] = f
		go t.fly(fctx, f, key, token, exp)
	}
	f.waiters++
	t.mu.Unlock()

	select {
	case <-f.done:
		return f.id, f.err
	case <-ctx.Done():
		t.mu.Lock()
		f.waiters--
		if f.waiters == 0 {
			// Nobody waits any more: stop the review, and let the next
			// caller start a fresh one rather than join a cancelled one.
			if t.flights[key] == f {
				delete(t.flights, key)
			}
			f.cancel()
		}
		t.mu.Unlock()
		return Identity{}, fail(ReviewFailed, "token review: %w", context.Cause(ctx))
	}
}

// fly runs f's review and publishes its answer: to the cache, then to f's
// waiters.
func (t *TokenReview) fly(ctx context.Context, f *flight, key tokenKey, token string, exp time.Time) {
	defer f.cancel()
	v, err := t.review(ctx, token, exp)
	now := t.cfg.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case err != nil:
		f.err = err // never cached
	case v.err != nil:
		f.err = v.err
	default:
		f.id = v.id
	}
	if v != nil && v.until.After(now) {
		v.key = key
		t.storeLocked(v, now)
	}
	if t.flights[key] == f {
		delete(t.flights, key)
	}
	close(f.done)
}

// review asks the API server about token once a slot is free. It returns
// a verdict to cache, or the error of a review that could not be made.
func (t *TokenReview) review(ctx context.Context, token string, exp time.Time) (*verdict, error) {
	select {
	case t.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, fail(ReviewFailed, "token review: waiting for a free review slot: %w", context.Cause(ctx))
	}
	defer func() { <-t.sem }()

	start := t.cfg.Now()
	rctx, cancel := context.WithTimeout(ctx, t.cfg.Timeout)
	defer cancel()
	t.reviews.Add(1)
	res, err := t.cfg.Client.AuthenticationV1().TokenReviews().Create(rctx, &authenticationv1.TokenReview{
		Spec: authenticationv1.TokenReviewSpec{Token: token, Audiences: slices.Clone(t.cfg.Audiences)},
	}, metav1.CreateOptions{})
	if err != nil {
		return nil, fail(ReviewFailed, "token review: %w", redact(err, token))
	}
	id, refusal := t.judge(res.Status, token)
	if refusal != nil {
		return &verdict{err: refusal, until: start.Add(t.cfg.NegativeTTL)}, nil
	}
	id.Expires = exp
	until := start.Add(t.cfg.MaxTTL)
	if !exp.IsZero() && exp.Before(until) {
		until = exp
	}
	return &verdict{id: id, until: until}, nil
}

// judge reads a TokenReview's status as istiod's tokenreview package does,
// and also requires one of the configured audiences.
func (t *TokenReview) judge(st authenticationv1.TokenReviewStatus, token string) (Identity, *Error) {
	switch {
	case st.Error != "":
		return Identity{}, fail(ReviewDenied, "token review: the API server did not authenticate the token: %q", clean(st.Error, token))
	case !st.Authenticated:
		return Identity{}, fail(ReviewDenied, "token review: the API server did not authenticate the token")
	}
	if !slices.ContainsFunc(st.Audiences, func(a string) bool { return slices.Contains(t.cfg.Audiences, a) }) {
		return Identity{}, fail(WrongAudience, "token review: token is bound to audiences %q, want one of %q", cleanAll(st.Audiences, token), t.cfg.Audiences)
	}
	user := clean(st.User.Username, token)
	ns, sa, ok := serviceAccountUser(st.User.Username)
	if !ok {
		return Identity{}, fail(ReviewDenied, "token review: user %q is not a service account", user)
	}
	if !slices.Contains(st.User.Groups, "system:serviceaccounts") {
		return Identity{}, fail(ReviewDenied, "token review: user %q is not in group system:serviceaccounts", user)
	}
	return Identity{TrustDomain: t.cfg.TrustDomain, Namespace: ns, ServiceAccount: sa, Method: MethodJWT}, nil
}

// lookupLocked returns key's verdict if it is still valid at now,
// dropping it if it is not.
func (t *TokenReview) lookupLocked(key tokenKey, now time.Time) *verdict {
	el, ok := t.cache[key]
	if !ok {
		return nil
	}
	v := el.Value.(*verdict)
	if !now.Before(v.until) {
		t.lru.Remove(el)
		delete(t.cache, key)
		return nil
	}
	t.lru.MoveToFront(el)
	return v
}

// storeLocked caches v, making room if the cache is full: expired entries
// first (if no sweep ran within sweepInterval), then the least recently
// used.
func (t *TokenReview) storeLocked(v *verdict, now time.Time) {
	if el, ok := t.cache[v.key]; ok {
		el.Value = v
		t.lru.MoveToFront(el)
		return
	}
	if len(t.cache) >= t.cfg.CacheSize {
		if !now.Before(t.nextSweep) {
			t.nextSweep = now.Add(sweepInterval)
			for el := t.lru.Back(); el != nil; {
				prev := el.Prev()
				if old := el.Value.(*verdict); !now.Before(old.until) {
					t.lru.Remove(el)
					delete(t.cache, old.key)
				}
				el = prev
			}
		}
		for len(t.cache) >= t.cfg.CacheSize {
			el := t.lru.Back()
			t.lru.Remove(el)
			delete(t.cache, el.Value.(*verdict).key)
		}
	}
	t.cache[v.key] = t.lru.PushFront(v)
}

// reviewAlgs are the "alg" values unverifiedExpiry reads a payload under:
// every signing algorithm go-jose knows, since the API server, not this
// parse, decides which are acceptable.
var reviewAlgs = []jose.SignatureAlgorithm{
	jose.RS256, jose.RS384, jose.RS512, jose.PS256, jose.PS384, jose.PS512,
	jose.ES256, jose.ES384, jose.ES512, jose.EdDSA, jose.HS256, jose.HS384, jose.HS512,
}

// unverifiedExpiry returns the exp claim of token, read without verifying
// anything: it may only shorten how long a verdict is cached, or refuse a
// token whose time is past. It is a BadToken error for a token that is not
// three non-empty base64url parts (no service-account token is), and the
// zero time for one whose exp cannot be read (the API server decides).
func unverifiedExpiry(token string) (time.Time, error) {
	if strings.Count(token, ".") != 2 {
		return time.Time{}, fail(BadToken, "not a JWT: want three dot-separated parts")
	}
	for i, part := range strings.SplitN(token, ".", 3) {
		if !isBase64URL(part) {
			return time.Time{}, fail(BadToken, "not a JWT: part %d is not base64url", i+1)
		}
	}
	tok, err := jwt.ParseSigned(token, reviewAlgs)
	if err != nil {
		return time.Time{}, nil
	}
	var claims struct {
		Expiry *jwt.NumericDate `json:"exp"`
	}
	if err := tok.UnsafeClaimsWithoutVerification(&claims); err != nil || claims.Expiry == nil {
		return time.Time{}, nil
	}
	return claims.Expiry.Time(), nil
}

// isBase64URL reports whether s is non-empty unpadded base64url
// (RFC 4648 §5), as every part of a compact JWS is.
func isBase64URL(s string) bool {
	if s == "" || len(s)%4 == 1 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// maxEchoBytes bounds a string from the API server quoted in an error.
const maxEchoBytes = 256

// clean makes s, from the API server, fit for an error message: without
// token (should the server ever echo it) and at most maxEchoBytes long.
func clean(s, token string) string {
	if token != "" {
		s = strings.ReplaceAll(s, token, "[token]")
	}
	if len(s) > maxEchoBytes {
		s = strings.ToValidUTF8(s[:maxEchoBytes], "") + "..."
	}
	return s
}

func cleanAll(ss []string, token string) []string {
	const maxItems = 8
	out := make([]string, 0, min(len(ss), maxItems))
	for _, s := range ss[:min(len(ss), maxItems)] {
		out = append(out, clean(s, token))
	}
	return out
}

// redactedError is an error whose message is cleaned of a token; it
// unwraps to the original, so errors.Is still sees context errors and
// client-go's status errors.
type redactedError struct {
	msg string
	err error
}

func (e *redactedError) Error() string { return e.msg }

func (e *redactedError) Unwrap() error { return e.err }

func redact(err error, token string) error {
	return &redactedError{msg: clean(err.Error(), token), err: err}
}
