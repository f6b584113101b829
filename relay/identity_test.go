package relay

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	jose "github.com/go-jose/go-jose/v4"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/xds"

	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
)

// secureEnv is a relay with a TLS port that authenticates by SPIFFE
// certificate or service-account JWT (--xds-auth=any), in front of a real
// go-control-plane upstream, with a mesh CA and a token issuer of the
// test's own.
type secureEnv struct {
	up     *testUpstream
	r      *Relay
	mesh   *authtest.CA
	issuer *authtest.Issuer
}

func newSecureEnv(t *testing.T, mode auth.Mode, mod func(*Config)) *secureEnv {
	t.Helper()
	return newSecureEnvWith(t, mode, authtest.NewIssuer(t), nil, mod)
}

// newSecureEnvWith is newSecureEnv with the token issuer given and the
// upstream's server options (an upstream that checks tokens as istiod).
func newSecureEnvWith(t *testing.T, mode auth.Mode, issuer *authtest.Issuer, upOpts []grpc.ServerOption, mod func(*Config)) *secureEnv {
	t.Helper()
	e := &secureEnv{up: newTestUpstreamWith(t, upOpts, "ns1", "ns2"), mesh: authtest.NewCA(t, "mesh root"), issuer: issuer}
	seed(e.up, "ns1", 3)
	seed(e.up, "ns2", 3)
	certFile, keyFile := e.mesh.Serving(t, "meshrelay.istio-system.svc").Write(t, "")
	pair, err := tlsfiles.LoadKeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	roots, err := tlsfiles.LoadCAPool(e.mesh.WriteRoot(t))
	if err != nil {
		t.Fatal(err)
	}
	lcfg := auth.DefaultLocalConfig()
	lcfg.Issuer, lcfg.Keys = e.issuer.URL, auth.KeysFromFile(e.issuer.WriteJWKS(t))
	local, err := auth.NewLocal(context.Background(), lcfg)
	if err != nil {
		t.Fatal(err)
	}
	authn, err := auth.NewAuthenticator(mode, &auth.CertVerifier{TrustDomain: "cluster.local", Roots: roots.Certificates}, local)
	if err != nil {
		t.Fatal(err)
	}
	e.r = startRelay(t, e.up, func(c *Config) {
		c.XDS.Listen = ""
		c.XDS.TLSListen = "127.0.0.1:0"
		c.XDS.TLS = tlsfiles.ServerConfig(pair, roots, tls.RequestClientCert)
		c.XDS.Authenticator = authn
		if mod != nil {
			mod(c)
		}
	})
	return e
}

// authFailures reads meshrelay_xds_auth_failures_total{reason}.
func authFailures(r *Relay, reason string) float64 {
	return testutil.ToFloat64(r.metrics.AuthFailures.WithLabelValues(reason))
}

// creds is what a test client presents.
type creds struct {
	cert  *authtest.Issued
	token string
	// perRPC sends token on every stream of the connection, as
	// istio-agent does (else the test adds it to one stream's context).
	perRPC bool
}

// bearerCreds sends a token as "authorization: Bearer" on every call.
type bearerCreds string

func (b bearerCreds) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

func (bearerCreds) RequireTransportSecurity() bool { return true }

func (e *secureEnv) dial(t *testing.T, c creds) *grpc.ClientConn {
	t.Helper()
	tc := &tls.Config{RootCAs: e.mesh.Pool(), ServerName: "meshrelay.istio-system.svc", MinVersion: tls.VersionTLS12}
	if c.cert != nil {
		// As istio-agent: present the workload certificate whatever CAs
		// the server names (Go would otherwise send a foreign one not at all).
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &c.cert.TLS, nil }
	}
	// Each connection from an address of its own, as each pod has: the
	// relay throttles an address whose authentications keep failing.
	n := podAddrs.Add(1)
	src := &net.TCPAddr{IP: net.IPv4(127, 1, byte(n>>8), byte(n))}
	d := &net.Dialer{LocalAddr: src}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(tc)),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) })}
	if c.perRPC {
		opts = append(opts, grpc.WithPerRPCCredentials(bearerCreds(c.token)))
	}
	conn, err := grpc.NewClient(e.r.TLSAddr().String(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// podAddrs numbers the loopback addresses test clients connect from.
var podAddrs atomic.Uint32

// saNode is an Istio sidecar's node with namespace and service account.
func saNode(ns, sa string, i int) *core.Node {
	n := node(ns, sa, i)
	n.Metadata.Fields["SERVICE_ACCOUNT"] = structpb.NewStringValue(sa)
	return n
}

// firstAnswer opens a Delta stream presenting n and returns the first
// response or the stream's error.
func firstAnswer(t *testing.T, conn *grpc.ClientConn, token string, n *core.Node) (*discovery.DeltaDiscoveryResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		return nil, err
	}
	if err := st.Send(&discovery.DeltaDiscoveryRequest{Node: n, TypeUrl: xds.TypeCluster}); err != nil {
		// The refusal comes back on Recv.
		_ = err
	}
	return st.Recv()
}

// The TLS port's access rule, as istiod's 15012: each credential × node
// gets exactly its gRPC code, and a refused stream gets no response at all.
func TestTLSPortIdentityTable(t *testing.T) {
	e := newSecureEnv(t, auth.ModeAny, nil)
	foreign := authtest.NewCA(t, "another root")
	now := time.Now()
	tok := func(f func(*authtest.Token)) string {
		tk := authtest.Token{Namespace: "ns1", ServiceAccount: "app", IssuedAt: now.Add(-time.Minute)}
		if f != nil {
			f(&tk)
		}
		return e.issuer.Sign(t, tk)
	}
	other, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	okTok := authtest.Token{Namespace: "ns1", ServiceAccount: "app", IssuedAt: now.Add(-time.Minute)}
	ns1 := saNode("ns1", "app", 1)
	for _, tc := range []struct {
		name   string
		creds  creds
		node   *core.Node
		want   codes.Code
		reason string // meshrelay_xds_auth_failures_total label counted
	}{
		{"right JWT", creds{token: tok(nil)}, ns1, codes.OK, ""},
		{"right SPIFFE certificate", creds{cert: e.mesh.Workload(t, "cluster.local", "ns1", "app")}, ns1, codes.OK, ""},
		{"certificate and token, certificate of another root", creds{cert: foreign.Workload(t, "cluster.local", "ns1", "app"), token: tok(nil)}, ns1, codes.OK, ""},
		{"JWT of another namespace", creds{token: tok(func(tk *authtest.Token) { tk.Namespace = "ns2" })}, ns1, codes.PermissionDenied, "identity_mismatch"},
		{"JWT of another service account", creds{token: tok(func(tk *authtest.Token) { tk.ServiceAccount = "db" })}, ns1, codes.PermissionDenied, "identity_mismatch"},
		{"certificate of another namespace", creds{cert: e.mesh.Workload(t, "cluster.local", "ns2", "app")}, ns1, codes.PermissionDenied, "identity_mismatch"},
		{"expired JWT", creds{token: tok(func(tk *authtest.Token) { tk.IssuedAt, tk.TTL = now.Add(-3*time.Hour), time.Hour })}, ns1, codes.Unauthenticated, "expired"},
		{"JWT not yet valid", creds{token: tok(func(tk *authtest.Token) { tk.IssuedAt = now.Add(time.Hour) })}, ns1, codes.Unauthenticated, "not_yet_valid"},
		{"JWT of another issuer", creds{token: tok(func(tk *authtest.Token) { tk.Issuer = "https://evil.example" })}, ns1, codes.Unauthenticated, "wrong_issuer"},
		{"JWT for another audience", creds{token: tok(func(tk *authtest.Token) { tk.Audiences = []string{"kubernetes"} })}, ns1, codes.Unauthenticated, "wrong_audience"},
		{"JWT with alg none", creds{token: strings.Join(strings.Split(tok(nil), ".")[:2], ".") + "."}, ns1, codes.Unauthenticated, "bad_token"},
		{"HS256 with the public key as secret", creds{token: e.issuer.SignWith(t, jose.SigningKey{Algorithm: jose.HS256, Key: e.issuer.PublicKeyBytes()}, okTok)}, ns1, codes.Unauthenticated, "bad_token"},
		{"JWT of an unknown kid", creds{token: e.issuer.SignWith(t, jose.SigningKey{Algorithm: jose.RS256, Key: jose.JSONWebKey{Key: other, KeyID: "nobody"}}, okTok)}, ns1, codes.Unauthenticated, "bad_token"},
		{"certificate of another root", creds{cert: foreign.Workload(t, "cluster.local", "ns1", "app")}, ns1, codes.Unauthenticated, "untrusted_cert"},
		{"certificate without a SPIFFE SAN", creds{cert: e.mesh.Serving(t, "app.ns1.svc")}, ns1, codes.Unauthenticated, "no_spiffe_id"},
		{"certificate of another trust domain", creds{cert: e.mesh.Workload(t, "evil.domain", "ns1", "app")}, ns1, codes.Unauthenticated, "wrong_trust_domain"},
		{"no credentials", creds{}, ns1, codes.Unauthenticated, "no_credentials"},
	} {
		for _, delta := range []bool{true, false} {
			t.Run(tc.name+"/"+protocolName(delta), func(t *testing.T) {
				before := authFailures(e.r, tc.reason)
				var resp interface{ GetResources() []*anypb.Any }
				var err error
				if delta {
					var r *discovery.DeltaDiscoveryResponse
					r, err = firstAnswer(t, e.dial(t, tc.creds), tc.creds.token, tc.node)
					resp = deltaResources{r}
				} else {
					var r *discovery.DiscoveryResponse
					r, err = firstAnswerSotW(t, e.dial(t, tc.creds), tc.creds.token, tc.node)
					resp = r
				}
				if tc.want == codes.OK {
					if err != nil {
						t.Fatalf("stream: %v, want a response", err)
					}
					if len(resp.GetResources()) == 0 {
						t.Fatalf("response %v: want the namespace's clusters", resp)
					}
					return
				}
				if err == nil || len(resp.GetResources()) > 0 {
					t.Fatalf("stream answered %v, want nothing served", resp)
				}
				if got := status.Code(err); got != tc.want {
					t.Fatalf("stream: %v (%s), want %s", err, got, tc.want)
				}
				if tc.creds.token != "" && strings.Contains(err.Error(), tc.creds.token) {
					t.Fatalf("the error %q repeats the token", err)
				}
				if got := authFailures(e.r, tc.reason); got != before+1 {
					t.Fatalf("auth failures{reason=%q} = %v, want %v", tc.reason, got, before+1)
				}
			})
		}
	}
}

// deltaResources reads a Delta response's resources as Anys (nil-safe).
type deltaResources struct {
	r *discovery.DeltaDiscoveryResponse
}

func (d deltaResources) GetResources() []*anypb.Any {
	var out []*anypb.Any
	for _, r := range d.r.GetResources() {
		out = append(out, r.GetResource())
	}
	return out
}

// firstAnswerSotW is firstAnswer over SotW.
func firstAnswerSotW(t *testing.T, conn *grpc.ClientConn, token string, n *core.Node) (*discovery.DiscoveryResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		return nil, err
	}
	_ = st.Send(&discovery.DiscoveryRequest{Node: n, TypeUrl: xds.TypeCluster}) // a refusal comes back on Recv
	return st.Recv()
}

// A client proven as namespace ns1 presenting a node of ns2 is refused,
// and the key of ns2 is never created nor joined: no upstream stream, no
// cache, nothing another ns2 client could be served from.
func TestTLSPortSpoofedNodeCreatesNoKey(t *testing.T) {
	e := newSecureEnv(t, auth.ModeJWT, nil)
	ns1Tok := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"})
	for i, n := range []*core.Node{saNode("ns2", "app", 1), node("ns2", "app", 2)} {
		_, err := firstAnswer(t, e.dial(t, creds{token: ns1Tok}), ns1Tok, n)
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("spoof %d: %v, want PermissionDenied", i, err)
		}
	}
	for _, k := range e.r.cache.heldKeys() {
		if strings.Contains(string(k.key), "/ns2/") {
			t.Fatalf("key %s exists after spoofed streams only", k.key)
		}
	}
	if open, opened := e.up.streams(); opened != 0 || open != 0 {
		t.Fatalf("upstream streams open=%d opened=%d after spoofed streams only, want none", open, opened)
	}
	// The genuine ns2 workload is served, from a key of its own.
	ns2Tok := e.issuer.Sign(t, authtest.Token{Namespace: "ns2", ServiceAccount: "app"})
	if _, err := firstAnswer(t, e.dial(t, creds{token: ns2Tok}), ns2Tok, saNode("ns2", "app", 3)); err != nil {
		t.Fatalf("genuine ns2 stream: %v", err)
	}
	ns2Key := func() *keyState {
		for _, k := range e.r.cache.heldKeys() {
			if strings.Contains(string(k.key), "/ns2/") {
				return k
			}
		}
		t.Fatal("no key of ns2 after the genuine stream")
		return nil
	}
	k := ns2Key()
	_, openedBefore := e.up.streams()
	// Now that the key of ns2 exists, a spoofed stream does not join it.
	for i, n := range []*core.Node{saNode("ns2", "app", 4), saNode("ns2", "app", 3)} {
		_, err := firstAnswer(t, e.dial(t, creds{token: ns1Tok}), ns1Tok, n)
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("spoof %d of an existing key: %v, want PermissionDenied", i, err)
		}
	}
	if got := ns2Key(); got != k || k.memberCount() != 1 {
		t.Fatalf("the key of ns2 has %d members after spoofed streams, want its 1 genuine one", k.memberCount())
	}
	if _, opened := e.up.streams(); opened != openedBefore {
		t.Fatalf("upstream streams opened went from %d to %d on spoofed streams", openedBefore, opened)
	}
}

// Two workloads whose nodes look alike (no SERVICE_ACCOUNT in the
// metadata, which istiod's rule then does not check) but proven by
// different service accounts get different keys.
func TestIdentityIsPartOfTheKey(t *testing.T) {
	e := newSecureEnv(t, auth.ModeJWT, nil)
	for _, sa := range []string{"app", "other"} {
		tok := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: sa})
		if _, err := firstAnswer(t, e.dial(t, creds{token: tok}), tok, node("ns1", "app", 1)); err != nil {
			t.Fatalf("%s: %v", sa, err)
		}
	}
	if n := len(e.r.cache.heldKeys()); n != 2 {
		t.Fatalf("keys = %d, want 2: one per proven service account", n)
	}
}

// Streams that name themselves relays are not believed on the TLS port
// without a peer secret: that would skip authentication.
func TestTLSPortRefusesUnprovenPeers(t *testing.T) {
	e := newSecureEnv(t, auth.ModeJWT, nil)
	conn := e.dial(t, creds{})
	ctx := metadata.AppendToOutgoingContext(context.Background(), peers.MDRelay, "relay-x", peers.MDKey, "sidecar/ns2/app#x")
	_, err := firstAnswer(t, conn, "", saNode("ns2", "app", 1))
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("plain stream: %v, want Unauthenticated", err)
	}
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err == nil {
		st.Send(&discovery.DeltaDiscoveryRequest{Node: saNode("ns2", "app", 1), TypeUrl: xds.TypeCluster})
		_, err = st.Recv()
	}
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("unproven peer stream: %v, want Unauthenticated", err)
	}
}
