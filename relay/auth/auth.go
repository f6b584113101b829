// Package auth names the workload behind an xDS stream and applies istiod's
// access rule to it. A stream proves who it is with a SPIFFE X.509
// certificate (mTLS) or a Kubernetes service-account JWT sent as
// "authorization: Bearer …" (verified locally against the cluster's keys,
// or by the Kubernetes TokenReview API with a verdict cache); CheckNode then
// requires the node it presents to be of the identity's namespace and
// service account, as istiod's checkConnectionIdentity does, so that no
// workload is served another namespace's config.
//
// Everything here is safe for concurrent use. Tokens are kept only as long
// as a verdict needs them, never logged and never persisted; errors name
// what was wrong with a credential, never the credential.
package auth

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc/metadata"
)

// Method says how an Identity was proven.
type Method string

// The ways a stream proves its identity.
const (
	MethodMTLS Method = "mtls"
	MethodJWT  Method = "jwt"
)

// Identity is a workload proven by a stream's credentials.
type Identity struct {
	// TrustDomain is the SPIFFE trust domain (cluster.local by default).
	TrustDomain string
	// Namespace and ServiceAccount name the Kubernetes service account.
	Namespace, ServiceAccount string
	// Method is how it was proven.
	Method Method
	// Expires is when the credential stops being valid (the certificate's
	// NotAfter, the token's exp); zero if it does not say.
	Expires time.Time
}

// SPIFFEID returns the identity's SPIFFE ID,
// spiffe://<trust domain>/ns/<namespace>/sa/<service account>.
func (id Identity) SPIFFEID() string {
	return "spiffe://" + id.TrustDomain + "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount
}

// String implements fmt.Stringer: the SPIFFE ID and the method.
func (id Identity) String() string { return id.SPIFFEID() + " (" + string(id.Method) + ")" }

// Reason classifies why a stream was refused: the label of
// meshrelay_xds_auth_failures_total.
type Reason string

// Reasons a credential is refused.
const (
	NoCredentials    Reason = "no_credentials"
	BadToken         Reason = "bad_token"
	Expired          Reason = "expired"
	NotYetValid      Reason = "not_yet_valid"
	WrongIssuer      Reason = "wrong_issuer"
	WrongAudience    Reason = "wrong_audience"
	UntrustedCert    Reason = "untrusted_cert"
	NoSPIFFEID       Reason = "no_spiffe_id"
	WrongTrustDomain Reason = "wrong_trust_domain"
	ReviewFailed     Reason = "review_failed"
	ReviewDenied     Reason = "review_denied"
	IdentityMismatch Reason = "identity_mismatch"
)

// Error is a refused credential or identity. Its message is safe to log
// and to send to the client: it never holds the credential.
type Error struct {
	Reason Reason
	Err    error
}

func (e *Error) Error() string { return fmt.Sprintf("%s: %v", e.Reason, e.Err) }

func (e *Error) Unwrap() error { return e.Err }

// ReasonOf returns err's Reason, or ReviewFailed for an error that is not
// an *Error (a verifier that could not reach what it asks).
func ReasonOf(err error) Reason {
	if e, ok := errors.AsType[*Error](err); ok {
		return e.Reason
	}
	return ReviewFailed
}

func fail(r Reason, format string, args ...any) *Error {
	return &Error{Reason: r, Err: fmt.Errorf(format, args...)}
}

// MaxTokenBytes bounds an authorization header's value. Kubernetes tokens
// are 1–2 KiB; anything past this is refused before it is parsed.
const MaxTokenBytes = 16 << 10

// BearerToken returns the token of the single "authorization: Bearer …"
// header in ctx's incoming metadata, or "" if there is none. More than one,
// another scheme, or a value over MaxTokenBytes is a BadToken error.
func BearerToken(ctx context.Context) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	return bearer(md.Get("authorization"))
}

func bearer(vals []string) (string, error) {
	switch {
	case len(vals) == 0:
		return "", nil
	case len(vals) > 1:
		return "", fail(BadToken, "%d authorization headers, want one", len(vals))
	case len(vals[0]) > MaxTokenBytes:
		return "", fail(BadToken, "authorization header of %d bytes exceeds %d", len(vals[0]), MaxTokenBytes)
	}
	scheme, tok, ok := strings.Cut(vals[0], " ")
	if !ok || !strings.EqualFold(scheme, "bearer") {
		return "", fail(BadToken, "authorization header is not a bearer token")
	}
	tok = strings.TrimSpace(tok)
	if tok == "" {
		return "", fail(BadToken, "empty bearer token")
	}
	return tok, nil
}

// ConfigNamespace is the namespace istiod configures node for: metadata
// NAMESPACE, else the namespace part of the node id's DNS domain
// ("sidecar~ip~pod.ns~ns.svc.cluster.local"), else "".
func ConfigNamespace(node *core.Node) string {
	if ns := node.GetMetadata().GetFields()["NAMESPACE"].GetStringValue(); ns != "" {
		return ns
	}
	parts := strings.Split(node.GetId(), "~")
	if len(parts) != 4 {
		return ""
	}
	if ns, _, ok := strings.Cut(parts[3], "."); ok {
		return ns
	}
	return ""
}

// CheckNode applies istiod's rule (checkConnectionIdentity): the node's
// config namespace, if it names one, must be the identity's, and its
// metadata SERVICE_ACCOUNT, if set, must be the identity's service account.
// A mismatch is an IdentityMismatch error.
func CheckNode(id Identity, node *core.Node) error {
	if ns := ConfigNamespace(node); ns != "" && ns != id.Namespace {
		return fail(IdentityMismatch, "identity %s may not present a node of namespace %q", id.SPIFFEID(), ns)
	}
	sa := node.GetMetadata().GetFields()["SERVICE_ACCOUNT"].GetStringValue()
	if sa != "" && sa != id.ServiceAccount {
		return fail(IdentityMismatch, "identity %s may not present a node of service account %q", id.SPIFFEID(), sa)
	}
	return nil
}

// TokenVerifier turns a bearer token into an identity: Local verifies it
// with the cluster's keys, TokenReview asks the Kubernetes API.
type TokenVerifier interface {
	VerifyToken(ctx context.Context, token string) (Identity, error)
}

// serviceAccountUser parses a Kubernetes username,
// "system:serviceaccount:<namespace>:<name>".
func serviceAccountUser(user string) (ns, sa string, ok bool) {
	rest, found := strings.CutPrefix(user, "system:serviceaccount:")
	if !found {
		return "", "", false
	}
	ns, sa, found = strings.Cut(rest, ":")
	if !found || ns == "" || sa == "" || strings.Contains(sa, ":") {
		return "", "", false
	}
	return ns, sa, true
}

// UnverifiedExpiry reads a JWT's exp claim without verifying anything:
// only to schedule (when to stop presenting a token the relay keeps),
// never to trust. Zero if the token has none or is not a JWT.
func UnverifiedExpiry(token string) time.Time {
	exp, _ := unverifiedExpiry(token)
	return exp
}
