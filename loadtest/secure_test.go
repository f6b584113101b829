package loadtest

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/shard"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/xds" // the xds:/// resolver

	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
)

// callCredsEnv turns on grpc-go's call_creds in xDS bootstraps. grpc-go
// reads it once, when its package starts, so the test runs itself again
// in a child process with it set.
const callCredsEnv = "GRPC_EXPERIMENTAL_XDS_BOOTSTRAP_CALL_CREDS"

// TestXDSClientOverTLSThroughTier: an independent client, grpc-go's own
// xds:/// resolver, with a bootstrap of channel_creds tls (the mesh root)
// and call_creds jwt_token_file (its service-account token), resolves and
// calls a service through a 3-relay tier that is an Istio drop-in: Envoys
// on the TLS port verified by JWT, relays on an mTLS peer port, forward
// mode to an upstream that is istiod's 15012 (TLS, and a Guard that
// checks each stream's token against its node). The upstream sees only
// streams carrying the client's token and its node.
func TestXDSClientOverTLSThroughTier(t *testing.T) {
	if os.Getenv(callCredsEnv) != "true" {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestXDSClientOverTLSThroughTier$", "-test.count=1")
		cmd.Env = append(os.Environ(), callCredsEnv+"=true")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("the test in a child process with %s=true: %v\n%s", callCredsEnv, err, out)
		}
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	m := newTestMesh(t, ctx)
	mesh, issuer, root, verifier := m.ca, m.issuer, m.root, m.verifier
	backend := healthBackend(t, "greeter")
	guard := &upstream.Guard{Tokens: verifier}
	ucfg := upstream.DefaultConfig()
	ucfg.Listen = "127.0.0.1:0"
	ucfg.Scenario = upstream.Scenario{Services: 20, Endpoints: 20, Namespaces: 2,
		GRPCServices: []upstream.GRPCService{{Name: "greeter.test", Backend: backend}}}
	ucfg.ServerOptions = []grpc.ServerOption{
		grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{mesh.Serving(t, "istiod.istio-system.svc").TLS}, MinVersion: tls.VersionTLS12})),
		grpc.ChainStreamInterceptor(guard.Interceptor),
	}
	up := startTestUpstream(t, ctx, ucfg)

	tier, err := cluster.StartConvergedTier(ctx, cluster.TierConfig{
		Relays: 3, Upstream: up.Addr(),
		Secure: m.security(true),
		Relay: func(c *relay.Config) {
			c.Upstream.DialOptions = append(c.Upstream.DialOptions, grpc.WithTransportCredentials(credentials.NewTLS(
				&tls.Config{RootCAs: mesh.Pool(), ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12})))
		},
	}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Stop(context.Background())

	ns := upstream.NamespaceName(0)
	token := issuer.Sign(t, authtest.Token{Namespace: ns, ServiceAccount: "greeter-client"})
	nodeID := "sidecar~127.0.0.1~grpc-client." + ns + "~" + ns + ".svc.cluster.local"
	bootstrap, err := json.Marshal(map[string]any{
		"xds_servers": []any{map[string]any{
			"server_uri":      tier.Addr(),
			"channel_creds":   []any{map[string]any{"type": "tls", "config": map[string]any{"ca_certificate_file": root}}},
			"call_creds":      []any{map[string]any{"type": "jwt_token_file", "config": map[string]any{"jwt_token_file": authtest.WriteToken(t, token)}}},
			"server_features": []string{"xds_v3"},
		}},
		"node": map[string]any{"id": nodeID, "metadata": map[string]any{
			"NAMESPACE": ns, "SERVICE_ACCOUNT": "greeter-client", "GENERATOR": "grpc",
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	builder, err := xds.NewXDSResolverWithConfigForTesting(bootstrap)
	if err != nil {
		t.Fatalf("NewXDSResolverWithConfigForTesting: %v", err)
	}
	cc, err := grpc.NewClient("xds:///greeter.test", grpc.WithTransportCredentials(insecureCreds()), grpc.WithResolvers(builder))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	resp, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{Service: "greeter"})
	if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check through xds:///greeter.test: %v %v, want SERVING", resp, err)
	}
	admitted := guard.Admitted()
	if len(admitted) == 0 {
		t.Fatal("the upstream admitted no stream")
	}
	for _, s := range admitted {
		if s.Token != sha256.Sum256([]byte(token)) || s.Node != nodeID {
			t.Fatalf("upstream stream %+v: want the client's token and node %s", s, nodeID)
		}
	}
	if refused := guard.Refused(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}
}

// An authenticating tier whose gossip has no key is refused: fake members
// joined such a ring and served Envoys a cluster of their own (issue 31,
// finding 2). For development it starts, and every relay says so on
// /healthz.
func TestSecureTierNeedsAGossipKey(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	m := newTestMesh(t, ctx)
	ucfg := upstream.DefaultConfig()
	ucfg.Listen = "127.0.0.1:0"
	ucfg.Scenario = upstream.Scenario{Services: 4, Endpoints: 4, Namespaces: 1}
	up := startTestUpstream(t, ctx, ucfg)
	tierOf := func(dev bool) cluster.TierConfig {
		return cluster.TierConfig{
			Relays: 2, Upstream: up.Addr(), Secure: m.security(false),
			Relay: func(c *relay.Config) { c.Admin.Listen = "127.0.0.1:0" },
			Node: func(nc *shard.NodeConfig) {
				nc.Ring.SecretKey, nc.Relay.Tier.InsecureForDevelopment = nil, dev
			},
		}
	}
	if tier, err := cluster.StartTier(ctx, tierOf(false)); err == nil || !strings.Contains(err.Error(), "Ring.SecretKey") {
		if tier != nil {
			tier.Stop(context.Background())
		}
		t.Fatalf("StartTier without a gossip key: %v, want a refusal that names Ring.SecretKey", err)
	}
	tier, err := cluster.StartConvergedTier(ctx, tierOf(true), 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Stop(context.Background())
	for _, r := range tier.Running() {
		resp, err := http.Get("http://" + r.Node.Relay().AdminAddr().String() + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if want := "WARNING: INSECURE: gossip neither encrypted nor authenticated"; !strings.Contains(string(body), want) {
			t.Errorf("%s: /healthz says:\n%s\nwant %q", r.ID, body, want)
		}
	}
}

// testMesh is a mesh's credentials for a secure tier: a root CA, a
// service-account token issuer, and a local verifier of its tokens.
type testMesh struct {
	ca       *authtest.CA
	root     string // the root's PEM file
	issuer   *authtest.Issuer
	verifier *auth.Local
	t        *testing.T
}

func newTestMesh(t *testing.T, ctx context.Context) *testMesh {
	t.Helper()
	m := &testMesh{ca: authtest.NewCA(t, "mesh root"), issuer: authtest.NewIssuer(t), t: t}
	m.root = m.ca.WriteRoot(t)
	lcfg := auth.DefaultLocalConfig()
	lcfg.Issuer, lcfg.Keys = m.issuer.URL, auth.KeysFromFile(m.issuer.WriteJWKS(t))
	var err error
	if m.verifier, err = auth.NewLocal(ctx, lcfg); err != nil {
		t.Fatal(err)
	}
	return m
}

// security is a tier that is an Istio drop-in: Envoys on a TLS port
// (certificate for relayServerName) verified by JWT, relays on an mTLS
// peer port; forward passes each Envoy's token upstream.
func (m *testMesh) security(forward bool) *cluster.TierSecurity {
	t := m.t
	t.Helper()
	roots, err := tlsfiles.LoadCAPool(m.root)
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tlsfiles.LoadKeyPair(m.ca.Serving(t, relayServerName).Write(t, ""))
	if err != nil {
		t.Fatal(err)
	}
	tierPair, err := tlsfiles.LoadKeyPair(m.ca.Workload(t, "cluster.local", "istio-system", "meshrelay").Write(t, ""))
	if err != nil {
		t.Fatal(err)
	}
	peerServer, peerClient, err := auth.PeerTLS(tierPair, roots, "spiffe://cluster.local/ns/istio-system/sa/meshrelay")
	if err != nil {
		t.Fatal(err)
	}
	authn, err := auth.NewAuthenticator(auth.ModeJWT, nil, m.verifier)
	if err != nil {
		t.Fatal(err)
	}
	return &cluster.TierSecurity{
		XDSTLS: tlsfiles.ServerConfig(pair, roots, tls.RequestClientCert), Authenticator: authn,
		PeerServer: peerServer, PeerClient: peerClient, Forward: forward,
	}
}

// healthBackend runs a gRPC health server on loopback reporting service
// SERVING until the test ends, and returns its address.
func healthBackend(t *testing.T, service string) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := health.NewServer()
	hs.SetServingStatus(service, healthpb.HealthCheckResponse_SERVING)
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return lis.Addr().String()
}

func insecureCreds() credentials.TransportCredentials { return insecure.NewCredentials() }
