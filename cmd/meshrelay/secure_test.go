package main

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/base64"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

// TestServeSecure runs meshrelay serve as an Istio drop-in: a TLS xDS
// port verifying service-account JWTs locally, the plaintext port off,
// and forward mode to an upstream that is istiod's 15012 (TLS, and a
// Guard that checks each stream's token against its node). A sidecar with
// its token is served, and the upstream sees that sidecar's token; one
// without a token is refused.
func TestServeSecure(t *testing.T) {
	mesh, issuer := authtest.NewCA(t, "mesh root"), authtest.NewIssuer(t)
	root := mesh.WriteRoot(t)
	lcfg := auth.DefaultLocalConfig()
	lcfg.Issuer, lcfg.Keys = issuer.URL, auth.KeysFromFile(issuer.WriteJWKS(t))
	verifier, err := auth.NewLocal(context.Background(), lcfg)
	if err != nil {
		t.Fatal(err)
	}
	guard := &upstream.Guard{Tokens: verifier}
	upCert := mesh.Serving(t, "istiod.istio-system.svc")
	ucfg := upstream.DefaultConfig()
	ucfg.Listen = "127.0.0.1:0"
	ucfg.ServerOptions = []grpc.ServerOption{
		grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{upCert.TLS}, MinVersion: tls.VersionTLS12})),
		grpc.ChainStreamInterceptor(guard.Interceptor),
	}
	up, err := upstream.New(ucfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := up.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer up.Stop(context.Background())

	cert, key := mesh.Serving(t, "meshrelay.istio-system.svc").Write(t, "")
	adminCert, adminKey := mesh.Serving(t).Write(t, "")
	const istioctl = "spiffe://cluster.local/ns/istio-system/sa/istioctl"
	xdsAddr, admin := freeAddr(t), freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- serve(ctx, []string{"--upstream", up.Addr(), "--upstream-ca", root, "--upstream-san", "istiod.istio-system.svc",
			"--xds-tls-cert", cert, "--xds-tls-key", key, "--xds-tls-listen", xdsAddr,
			"--xds-auth", "jwt", "--jwt-verifier", "local", "--jwt-issuer", issuer.URL, "--jwt-jwks-file", issuer.WriteJWKS(t),
			"--gossip-listen", "", "--admin-listen", admin, "--log-level", "error",
			"--admin-tls-cert", adminCert, "--admin-tls-key", adminKey, "--admin-identities", istioctl})
	}()
	defer func() {
		cancel()
		if err := <-errc; err != nil {
			t.Errorf("serve: %v", err)
		}
	}()

	ns := upstream.NamespaceName(0)
	md, _ := structpb.NewStruct(map[string]any{"NAMESPACE": ns, "SERVICE_ACCOUNT": "app"})
	node := &core.Node{Id: "sidecar~10.0.0.1~app-1." + ns + "~" + ns + ".svc.cluster.local", Metadata: md}
	conn, err := grpc.NewClient(xdsAddr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: mesh.Pool(), ServerName: "meshrelay.istio-system.svc", MinVersion: tls.VersionTLS12})))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	first := func(token string) (*discovery.DeltaDiscoveryResponse, error) {
		sctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if token != "" {
			sctx = metadata.AppendToOutgoingContext(sctx, "authorization", "Bearer "+token)
		}
		var resp *discovery.DeltaDiscoveryResponse
		var err error
		// The relay refuses streams (Unavailable) until it reached its
		// upstream: retry those, as Envoy does.
		for sctx.Err() == nil {
			var st discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
			if st, err = discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(sctx); err == nil {
				st.Send(&discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: "type.googleapis.com/envoy.config.cluster.v3.Cluster"})
				resp, err = st.Recv()
			}
			if status.Code(err) != codes.Unavailable {
				return resp, err
			}
			time.Sleep(50 * time.Millisecond)
		}
		return resp, err
	}
	token := issuer.Sign(t, authtest.Token{Namespace: ns, ServiceAccount: "app"})
	resp, err := first(token)
	if err != nil || len(resp.GetResources()) == 0 {
		t.Fatalf("sidecar with its token: %v, %d clusters; want the namespace's clusters", err, len(resp.GetResources()))
	}
	admitted := guard.Admitted()
	if len(admitted) != 1 || admitted[0].Token != sha256.Sum256([]byte(token)) || admitted[0].Node != node.GetId() {
		t.Fatalf("upstream admitted %+v, want one stream with the sidecar's token and node", admitted)
	}
	if _, err := first(""); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("sidecar without a token: %v, want Unauthenticated", err)
	}
	// The admin API proves its callers with the TLS port's verifiers: the
	// admin identity reads pprof, a workload of a namespace may not.
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: mesh.Pool(), MinVersion: tls.VersionTLS12}}}
	for _, tc := range []struct {
		ns, sa string
		want   int
	}{{"istio-system", "istioctl", http.StatusOK}, {ns, "app", http.StatusForbidden}} {
		req, _ := http.NewRequest(http.MethodGet, "https://"+admin+"/debug/pprof/", nil)
		req.Header.Set("Authorization", "Bearer "+issuer.Sign(t, authtest.Token{Namespace: tc.ns, ServiceAccount: tc.sa}))
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("pprof as %s/%s: %s, want %d", tc.ns, tc.sa, resp.Status, tc.want)
		}
	}
	health := get(t, hc, "https://"+admin+"/healthz")
	if !strings.Contains(health, "xds tls: "+xdsAddr+", auth jwt") || strings.Contains(health, "plaintext") {
		t.Fatalf("/healthz = %q, want the TLS port with jwt auth and no plaintext port", health)
	}
}

func get(t *testing.T, hc *http.Client, url string) string {
	t.Helper()
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// meshrelay serve refuses a tier that would leave an authenticating relay
// open (issue 31, findings 1 and 2): relay-to-relay traffic without mTLS,
// or gossip without a key, each named with the flag that fixes it and the
// development flag that allows it; the development flag alone, outside a
// tier, is refused too.
func TestServeRefusesAnOpenTier(t *testing.T) {
	mesh, issuer := authtest.NewCA(t, "mesh root"), authtest.NewIssuer(t)
	root := mesh.WriteRoot(t)
	cert, key := mesh.Serving(t, "meshrelay.istio-system.svc").Write(t, "")
	peerCert, peerKey := mesh.Workload(t, "cluster.local", "istio-system", "meshrelay").Write(t, "")
	gossipKey := filepath.Join(t.TempDir(), "gossip.key")
	if err := os.WriteFile(gossipKey, []byte(base64.StdEncoding.EncodeToString([]byte("0123456789abcdef0123456789abcdef"))), 0o600); err != nil {
		t.Fatal(err)
	}
	secure := []string{"--upstream", "127.0.0.1:1", "--xds-tls-cert", cert, "--xds-tls-key", key, "--xds-tls-listen", "127.0.0.1:0",
		"--xds-auth", "jwt", "--jwt-verifier", "local", "--jwt-issuer", issuer.URL, "--jwt-jwks-file", issuer.WriteJWKS(t),
		"--admin-listen", "", "--log-level", "error"}
	peerTLS := []string{"--peer-listen", "127.0.0.1:0", "--peer-tls-cert", peerCert, "--peer-tls-key", peerKey, "--peer-tls-ca", root}
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"a peer port without mTLS", []string{"--gossip-listen", "127.0.0.1:0", "--gossip-key-file", gossipKey, "--peer-listen", "127.0.0.1:0"},
			[]string{"Tier.TLS", "--peer-tls-cert", "--insecure-tier-for-development"}},
		{"gossip without a key", append([]string{"--gossip-listen", "127.0.0.1:0"}, peerTLS...),
			[]string{"Ring.SecretKey", "--gossip-key-file", "--insecure-tier-for-development"}},
		{"the development flag outside a tier", []string{"--gossip-listen", "", "--insecure-tier-for-development"},
			[]string{"needs a tier"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			err := serve(ctx, append(slices.Clone(secure), tc.args...))
			if err == nil {
				t.Fatal("serve started, want a refusal")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("serve: %v; want it to name %s", err, w)
				}
			}
		})
	}
}
