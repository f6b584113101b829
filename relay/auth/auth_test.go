package auth

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	jose "github.com/go-jose/go-jose/v4"
	"go.uber.org/goleak"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func node(id string, md map[string]any) *core.Node {
	s, err := structpb.NewStruct(md)
	if err != nil {
		panic(err)
	}
	return &core.Node{Id: id, Metadata: s}
}

func wantReason(t *testing.T, what string, err error, want Reason) {
	t.Helper()
	if want == "" {
		if err != nil {
			t.Fatalf("%s: %v, want success", what, err)
		}
		return
	}
	if err == nil {
		t.Fatalf("%s: success, want %s", what, want)
	}
	if got := ReasonOf(err); got != want {
		t.Fatalf("%s: reason %s (%v), want %s", what, got, err, want)
	}
}

func TestCheckNode(t *testing.T) {
	id := Identity{TrustDomain: "cluster.local", Namespace: "ns1", ServiceAccount: "app"}
	for _, tc := range []struct {
		name string
		node *core.Node
		want Reason
	}{
		{"same namespace and service account", node("sidecar~10.0.0.1~a.ns1~ns1.svc.cluster.local", map[string]any{"NAMESPACE": "ns1", "SERVICE_ACCOUNT": "app"}), ""},
		{"namespace from the node id", node("sidecar~10.0.0.1~a.ns1~ns1.svc.cluster.local", map[string]any{"SERVICE_ACCOUNT": "app"}), ""},
		{"no service account in the node", node("sidecar~10.0.0.1~a.ns1~ns1.svc.cluster.local", map[string]any{"NAMESPACE": "ns1"}), ""},
		{"no namespace anywhere", node("plain-node", nil), ""},
		{"other namespace", node("sidecar~10.0.0.1~a.ns2~ns2.svc.cluster.local", map[string]any{"NAMESPACE": "ns2", "SERVICE_ACCOUNT": "app"}), IdentityMismatch},
		{"other namespace in the id only", node("sidecar~10.0.0.1~a.ns2~ns2.svc.cluster.local", nil), IdentityMismatch},
		{"metadata namespace wins over the id", node("sidecar~10.0.0.1~a.ns1~ns1.svc.cluster.local", map[string]any{"NAMESPACE": "ns2"}), IdentityMismatch},
		{"other service account", node("sidecar~10.0.0.1~a.ns1~ns1.svc.cluster.local", map[string]any{"NAMESPACE": "ns1", "SERVICE_ACCOUNT": "db"}), IdentityMismatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantReason(t, "CheckNode", CheckNode(id, tc.node), tc.want)
		})
	}
}

func TestParseSPIFFEID(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Identity
		ok   bool
	}{
		{"spiffe://cluster.local/ns/default/sa/app", Identity{TrustDomain: "cluster.local", Namespace: "default", ServiceAccount: "app"}, true},
		{"spiffe://td.example/ns/a/sa/b", Identity{TrustDomain: "td.example", Namespace: "a", ServiceAccount: "b"}, true},
		{"spiffe://cluster.local/ns/default/sa/", Identity{}, false},
		{"spiffe://cluster.local/ns/default", Identity{}, false},
		{"spiffe://cluster.local/sa/x/ns/y", Identity{}, false},
		{"spiffe://cluster.local/ns/a/sa/b/extra", Identity{}, false},
		{"spiffe://Cluster.Local/ns/a/sa/b", Identity{}, false}, // SPIFFE trust domains are lower case
		{"https://cluster.local/ns/a/sa/b", Identity{}, false},
		{"", Identity{}, false},
	} {
		got, err := ParseSPIFFEID(tc.in)
		if tc.ok != (err == nil) || got != tc.want {
			t.Errorf("ParseSPIFFEID(%q) = %+v, %v; want %+v, ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
		if err != nil && ReasonOf(err) != NoSPIFFEID {
			t.Errorf("ParseSPIFFEID(%q): reason %s, want %s", tc.in, ReasonOf(err), NoSPIFFEID)
		}
	}
}

func TestBearerToken(t *testing.T) {
	for _, tc := range []struct {
		name string
		vals []string
		want string
		bad  bool
	}{
		{"none", nil, "", false},
		{"bearer", []string{"Bearer abc.def.ghi"}, "abc.def.ghi", false},
		{"lower case scheme", []string{"bearer abc"}, "abc", false},
		{"two headers", []string{"Bearer a", "Bearer b"}, "", true},
		{"basic", []string{"Basic dXNlcjpwYXNz"}, "", true},
		{"no scheme", []string{"abc"}, "", true},
		{"empty token", []string{"Bearer  "}, "", true},
		{"oversized", []string{"Bearer " + strings.Repeat("a", MaxTokenBytes)}, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			if tc.vals != nil {
				md := metadata.MD{"authorization": tc.vals}
				ctx = metadata.NewIncomingContext(ctx, md)
			}
			got, err := BearerToken(ctx)
			if (err != nil) != tc.bad || got != tc.want {
				t.Fatalf("BearerToken(%q) = %q, %v; want %q, error=%v", tc.vals, got, err, tc.want, tc.bad)
			}
			if err != nil && (ReasonOf(err) != BadToken || strings.Contains(err.Error(), "dXNlcjpwYXNz")) {
				t.Fatalf("BearerToken(%q): %v, want a BadToken error that does not repeat the header", tc.vals, err)
			}
		})
	}
}

func newLocal(t *testing.T, is *authtest.Issuer, now time.Time) *Local {
	t.Helper()
	cfg := DefaultLocalConfig()
	cfg.Issuer = is.URL
	cfg.Keys = KeysFromFile(is.WriteJWKS(t))
	cfg.Now = func() time.Time { return now }
	l, err := NewLocal(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// unsigned builds a token with alg "none".
func unsigned(t *testing.T, claims map[string]any) string {
	t.Helper()
	h := base64.RawURLEncoding.EncodeToString([]byte(`{"alg":"none","typ":"JWT"}`))
	b, err := json.Marshal(claims)
	if err != nil {
		t.Fatal(err)
	}
	return h + "." + base64.RawURLEncoding.EncodeToString(b) + "."
}

func TestLocalVerifier(t *testing.T) {
	is := authtest.NewIssuer(t)
	now := time.Now()
	l := newLocal(t, is, now)
	ok := authtest.Token{Namespace: "ns1", ServiceAccount: "app", IssuedAt: now.Add(-time.Minute)}
	other, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	with := func(f func(*authtest.Token)) authtest.Token { tok := ok; f(&tok); return tok }
	for _, tc := range []struct {
		name  string
		token string
		want  Reason
	}{
		{"valid", is.Sign(t, ok), ""},
		{"second audience", is.Sign(t, with(func(tk *authtest.Token) { tk.Audiences = []string{"other", "istio-ca"} })), ""},
		{"within the clock skew", is.Sign(t, with(func(tk *authtest.Token) { tk.IssuedAt = now.Add(30 * time.Second) })), ""},
		{"expired", is.Sign(t, with(func(tk *authtest.Token) { tk.IssuedAt, tk.TTL = now.Add(-2*time.Hour), time.Hour })), Expired},
		{"not yet valid", is.Sign(t, with(func(tk *authtest.Token) { tk.IssuedAt = now.Add(10 * time.Minute) })), NotYetValid},
		{"wrong issuer", is.Sign(t, with(func(tk *authtest.Token) { tk.Issuer = "https://evil.example" })), WrongIssuer},
		{"wrong audience", is.Sign(t, with(func(tk *authtest.Token) { tk.Audiences = []string{"kubernetes"} })), WrongAudience},
		{"subject of another account", is.Sign(t, with(func(tk *authtest.Token) { tk.Subject = "system:serviceaccount:ns1:admin" })), BadToken},
		{"no kubernetes.io claims", is.Sign(t, with(func(tk *authtest.Token) { tk.Namespace, tk.ServiceAccount = "", "" })), BadToken},
		{"alg none", unsigned(t, map[string]any{"iss": is.URL, "aud": "istio-ca", "sub": "system:serviceaccount:ns1:app", "exp": now.Add(time.Hour).Unix()}), BadToken},
		{"HS256 with the public key as secret", is.SignWith(t, jose.SigningKey{Algorithm: jose.HS256, Key: is.PublicKeyBytes()}, ok), BadToken},
		{"unknown kid", is.SignWith(t, jose.SigningKey{Algorithm: jose.RS256, Key: jose.JSONWebKey{Key: other, KeyID: "nobody"}}, ok), BadToken},
		{"right kid, other key", is.SignWith(t, jose.SigningKey{Algorithm: jose.RS256, Key: jose.JSONWebKey{Key: other, KeyID: is.KeyID}}, ok), BadToken},
		{"garbage", "not.a.jwt", BadToken},
		{"oversized", strings.Repeat("a", MaxTokenBytes+1), BadToken},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, err := l.VerifyToken(context.Background(), tc.token)
			wantReason(t, "VerifyToken", err, tc.want)
			if err != nil {
				if strings.Contains(err.Error(), tc.token) {
					t.Fatalf("error %q repeats the token", err)
				}
				return
			}
			want := Identity{TrustDomain: "cluster.local", Namespace: "ns1", ServiceAccount: "app", Method: MethodJWT}
			if got := (Identity{TrustDomain: id.TrustDomain, Namespace: id.Namespace, ServiceAccount: id.ServiceAccount, Method: id.Method}); got != want {
				t.Fatalf("VerifyToken = %+v, want %+v", id, want)
			}
			if id.Expires.IsZero() {
				t.Fatalf("VerifyToken = %+v, want the token's expiry", id)
			}
		})
	}
}

// countingKeys counts fetches of a key set.
type countingKeys struct {
	set   jose.JSONWebKeySet
	calls int
}

func (c *countingKeys) fetch(context.Context) (jose.JSONWebKeySet, error) {
	c.calls++
	return c.set, nil
}

// A flood of tokens naming unknown key ids fetches the key set at most
// once a RefreshInterval; a rotation to a new key is picked up by it.
func TestLocalRefreshesKeysAtMostOncePerInterval(t *testing.T) {
	old, rotated := authtest.NewIssuer(t), authtest.NewIssuer(t)
	rotated.KeyID = "test-key-2"
	keys := &countingKeys{set: old.JWKS()}
	now := time.Now()
	cfg := DefaultLocalConfig()
	cfg.Issuer, cfg.Keys, cfg.Now = old.URL, keys.fetch, func() time.Time { return now }
	l, err := NewLocal(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	tok := rotated.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app", IssuedAt: now})
	for range 100 {
		if _, err := l.VerifyToken(context.Background(), tok); ReasonOf(err) != BadToken {
			t.Fatalf("token of an unknown key: %v, want %s", err, BadToken)
		}
	}
	if keys.calls != 1 {
		t.Fatalf("key set fetched %d times for 100 tokens within one interval, want 1 (at start)", keys.calls)
	}
	keys.set = jose.JSONWebKeySet{Keys: append(old.JWKS().Keys, rotated.JWKS().Keys...)}
	now = now.Add(cfg.RefreshInterval)
	if _, err := l.VerifyToken(context.Background(), tok); err != nil {
		t.Fatalf("token of the rotated key after the interval: %v", err)
	}
	if keys.calls != 2 {
		t.Fatalf("key set fetched %d times, want 2", keys.calls)
	}
}

func TestCertVerifier(t *testing.T) {
	mesh, foreign := authtest.NewCA(t, "mesh root"), authtest.NewCA(t, "another root")
	v := &CertVerifier{TrustDomain: "cluster.local", Roots: func() []*x509.Certificate { return []*x509.Certificate{mesh.Cert} }}
	for _, tc := range []struct {
		name string
		cert *authtest.Issued
		want Reason
	}{
		{"workload certificate", mesh.Workload(t, "cluster.local", "ns1", "app"), ""},
		{"another root", foreign.Workload(t, "cluster.local", "ns1", "app"), UntrustedCert},
		{"no SPIFFE SAN", mesh.Serving(t, "app.ns1.svc"), NoSPIFFEID},
		{"another trust domain", mesh.Workload(t, "other.domain", "ns1", "app"), WrongTrustDomain},
		{"not an Istio workload ID", mesh.Issue(t, authtest.Leaf{URIs: []string{"spiffe://cluster.local/app"}}), NoSPIFFEID},
		{"two URI SANs", mesh.Issue(t, authtest.Leaf{URIs: []string{"spiffe://cluster.local/ns/a/sa/b", "spiffe://cluster.local/ns/c/sa/d"}}), NoSPIFFEID},
		{"expired", mesh.Issue(t, authtest.Leaf{URIs: []string{"spiffe://cluster.local/ns/ns1/sa/app"}, NotBefore: time.Now().Add(-3 * time.Hour), NotAfter: time.Now().Add(-time.Hour)}), UntrustedCert},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, err := v.Verify([]*x509.Certificate{tc.cert.Leaf()})
			wantReason(t, "Verify", err, tc.want)
			if err == nil && (id.Namespace != "ns1" || id.ServiceAccount != "app" || id.Method != MethodMTLS) {
				t.Fatalf("Verify = %+v, want ns1/app by mtls", id)
			}
		})
	}
	if _, err := v.Verify(nil); ReasonOf(err) != NoCredentials {
		t.Fatalf("Verify(no certificate) = %v, want %s", err, NoCredentials)
	}
}

func TestReasonOfForeignError(t *testing.T) {
	if got := ReasonOf(errors.New("connection refused")); got != ReviewFailed {
		t.Fatalf("ReasonOf(plain error) = %s, want %s", got, ReviewFailed)
	}
}

// The key set found through the issuer's discovery document, as the
// Kubernetes API server serves it, verifies its tokens; a document naming
// another issuer is refused.
func TestKeysFromDiscovery(t *testing.T) {
	is := authtest.NewIssuer(t)
	var docIssuer string
	mux := http.NewServeMux()
	srv := httptest.NewServer(mux)
	defer srv.Close()
	mux.HandleFunc("/.well-known/openid-configuration", func(w http.ResponseWriter, _ *http.Request) {
		json.NewEncoder(w).Encode(map[string]any{"issuer": docIssuer, "jwks_uri": srv.URL + "/openid/v1/jwks"})
	})
	mux.HandleFunc("/openid/v1/jwks", func(w http.ResponseWriter, _ *http.Request) { json.NewEncoder(w).Encode(is.JWKS()) })
	is.URL, docIssuer = srv.URL, srv.URL
	cfg := DefaultLocalConfig()
	cfg.Issuer, cfg.Keys = is.URL, KeysFromDiscovery(is.URL, srv.Client())
	l, err := NewLocal(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.VerifyToken(context.Background(), is.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"})); err != nil {
		t.Fatalf("token of the discovered keys: %v", err)
	}
	docIssuer = "https://elsewhere.example"
	if _, err := KeysFromDiscovery(is.URL, srv.Client())(context.Background()); err == nil || !strings.Contains(err.Error(), "elsewhere") {
		t.Fatalf("discovery document of another issuer: %v, want it refused", err)
	}
}

// Token gives a forwarding relay the token of a stream when it proves the
// stream's identity: the token that proved it, or, beside a certificate
// that proved it, a token of the same workload (verified); nothing else.
func TestAuthenticatorToken(t *testing.T) {
	mesh, is := authtest.NewCA(t, "mesh root"), authtest.NewIssuer(t)
	now := time.Now()
	certs := &CertVerifier{TrustDomain: "cluster.local", Roots: func() []*x509.Certificate { return []*x509.Certificate{mesh.Cert} }}
	local := newLocal(t, is, now)
	app := is.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app", IssuedAt: now.Add(-time.Minute), TTL: time.Hour})
	db := is.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "db", IssuedAt: now.Add(-time.Minute), TTL: time.Hour})
	byCert := Identity{TrustDomain: "cluster.local", Namespace: "ns1", ServiceAccount: "app", Method: MethodMTLS, Expires: now.Add(24 * time.Hour)}
	exp := now.Add(-time.Minute).Add(time.Hour).Truncate(time.Second) // app's exp
	byToken := Identity{TrustDomain: "cluster.local", Namespace: "ns1", ServiceAccount: "app", Method: MethodJWT, Expires: exp}
	for _, tc := range []struct {
		name  string
		mode  Mode
		id    Identity
		token string // sent as authorization: Bearer
		want  string // the token Token gives, "" for none
	}{
		{"the token that proved the stream", ModeAny, byToken, app, app},
		{"a certificate and the same workload's token", ModeAny, byCert, app, app},
		{"a certificate and another workload's token", ModeAny, byCert, db, ""},
		{"a certificate and a forged token", ModeAny, byCert, unsigned(t, map[string]any{"sub": "system:serviceaccount:ns1:app"}), ""},
		{"a certificate alone", ModeAny, byCert, "", ""},
		{"mtls mode verifies no token", ModeMTLS, byCert, app, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, err := NewAuthenticator(tc.mode, certs, local)
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			if tc.token != "" {
				ctx = metadata.NewIncomingContext(ctx, metadata.MD{"authorization": {"Bearer " + tc.token}})
			}
			tok, expires, ok := a.Token(ctx, tc.id)
			if ok != (tc.want != "") || tok != tc.want {
				t.Fatalf("Token = %q, %v, want %q", tok, ok, tc.want)
			}
			if got := expires; ok && !got.Equal(exp) {
				t.Fatalf("Token expires %v, want the token's exp %v", got, exp)
			}
		})
	}
}
