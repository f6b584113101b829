package realistio

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/xds"
	"github.com/meshrelay/meshrelay/shard"
)

// binaries returns the built binaries, or skips the test with one line
// naming the command that builds them; with CI=true a missing binary
// fails the test instead.
func binaries(t *testing.T) Binaries {
	t.Helper()
	b, err := Find()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("real Istio required (CI=true): %v", err)
		}
		t.Skipf("no real Istio: %v", err)
	}
	return b
}

// processLog opens name in dir for a process's output; its last lines
// are printed when the test fails.
func processLog(t *testing.T, dir, name string) *os.File {
	t.Helper()
	f, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(f.Name())
			if len(b) > 4000 {
				b = b[len(b)-4000:]
			}
			t.Logf("%s's last output:\n%s", name, bytes.TrimSpace(b))
		}
		f.Close()
	})
	return f
}

// TestRealIstiodStarts: kube-apiserver and istiod, built from their
// modules, start here and istiod becomes ready on the API server.
func TestRealIstiodStarts(t *testing.T) {
	b := binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dir := t.TempDir()
	k, err := StartKubeAPI(ctx, b.KubeAPIServer, dir, processLog(t, dir, "kube-apiserver"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Stop)
	v, err := k.Client.Discovery().ServerVersion()
	if err != nil || v.GitVersion != KubernetesVersion {
		t.Fatalf("kube-apiserver /version = %v, %v; want %s", v, err, KubernetesVersion)
	}
	idir := filepath.Join(dir, "istiod")
	if err := os.MkdirAll(idir, 0o755); err != nil {
		t.Fatal(err)
	}
	d, err := StartIstiod(ctx, b.PilotDiscovery, k, idir, processLog(t, dir, "istiod"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Stop)
}

// mesh is a real API server and istiod, and a namespace with a Service
// and its endpoints (no controller-manager runs: the test writes the
// EndpointSlice itself).
type mesh struct {
	kube   *KubeAPI
	istiod *Istiod
	dir    string
	bins   Binaries
}

func startMesh(t *testing.T, ctx context.Context, opts ...IstiodOption) *mesh {
	t.Helper()
	m := &mesh{bins: binaries(t), dir: t.TempDir()}
	var err error
	if m.kube, err = StartKubeAPI(ctx, m.bins.KubeAPIServer, m.dir, processLog(t, m.dir, "kube-apiserver")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.kube.Stop)
	idir := filepath.Join(m.dir, "istiod")
	if err := os.MkdirAll(idir, 0o755); err != nil {
		t.Fatal(err)
	}
	if m.istiod, err = StartIstiod(ctx, m.bins.PilotDiscovery, m.kube, idir, processLog(t, m.dir, "istiod"), opts...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.istiod.Stop)
	if err := m.kube.AddService(ctx, "ns1", "reviews", 9080, "10.1.0.5", "10.1.0.6"); err != nil {
		t.Fatal(err)
	}
	return m
}

// sidecarNode is the node pilot-agent presents for pod i of ns/app: what
// istiod needs to build a sidecar's config, and to list it in syncz (it
// has proxy config).
func sidecarNode(ns, app string, i int) *core.Node {
	ip := fmt.Sprintf("10.1.0.%d", 5+i)
	md, err := structpb.NewStruct(map[string]any{
		"NAMESPACE": ns, "CLUSTER_ID": ClusterID, "ISTIO_VERSION": "1.31.0", "SERVICE_ACCOUNT": "default",
		"WORKLOAD_NAME": app + "-v1", "LABELS": map[string]any{"app": app, "version": "v1"},
		"INTERCEPTION_MODE": "REDIRECT", "INSTANCE_IPS": ip, "PROXY_CONFIG": map[string]any{"concurrency": 2.0},
	})
	if err != nil {
		panic(err)
	}
	return &core.Node{Id: fmt.Sprintf("sidecar~%s~%s-v1-%d.%s~%s.svc.cluster.local", ip, app, i, ns, ns), Metadata: md}
}

// fetch asks addr, over SotW ADS as node, for what a sidecar asks first,
// the way Envoy and pilot-agent ask: clusters, then the endpoints of its
// EDS clusters, then listeners, then the NameTable pilot-agent's DNS
// proxy asks for, ACKing each answer. It returns each type's resources,
// name → content hash.
func fetch(t *testing.T, ctx context.Context, addr string, node *core.Node) map[string]map[string]string {
	t.Helper()
	got, closeStream := connect(t, ctx, addr, node)
	closeStream()
	return got
}

// connect is fetch, leaving the stream open until closeStream.
func connect(t *testing.T, ctx context.Context, addr string, node *core.Node) (_ map[string]map[string]string, closeStream func()) {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if closeStream == nil {
			conn.Close()
		}
	}()
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]map[string]string{}
	ask := func(typeURL string, names []string) *discovery.DiscoveryResponse {
		req := &discovery.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: names}
		if len(out) == 0 {
			req.Node = node
		}
		if err := st.Send(req); err != nil {
			t.Fatal(err)
		}
		resp, err := st.Recv()
		for err == nil && resp.GetTypeUrl() != typeURL {
			resp, err = st.Recv() // another type's push
		}
		if err != nil {
			t.Fatalf("%s from %s: %v", xds.ShortType(typeURL), addr, err)
		}
		got := map[string]string{}
		for _, a := range resp.GetResources() {
			got[resourceName(t, a)] = fmt.Sprintf("%x", sha256.Sum256(a.GetValue()))
		}
		out[typeURL] = got
		ack := &discovery.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: names, VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}
		if err := st.Send(ack); err != nil {
			t.Fatal(err)
		}
		return resp
	}
	var eds []string
	for _, a := range ask(xds.TypeCluster, nil).GetResources() {
		var c cluster.Cluster
		if err := a.UnmarshalTo(&c); err != nil {
			t.Fatal(err)
		}
		if c.GetType() == cluster.Cluster_EDS {
			name := c.GetEdsClusterConfig().GetServiceName()
			if name == "" {
				name = c.GetName()
			}
			eds = append(eds, name)
		}
	}
	slices.Sort(eds)
	ask(xds.TypeEndpoint, eds)
	ask(xds.TypeListener, nil)
	ask(xds.TypeNameTable, nil)
	return out, func() { conn.Close() }
}

func resourceName(t *testing.T, a *anypb.Any) string {
	t.Helper()
	switch a.GetTypeUrl() {
	case xds.TypeCluster:
		var c cluster.Cluster
		if err := a.UnmarshalTo(&c); err != nil {
			t.Fatal(err)
		}
		return c.GetName()
	case xds.TypeEndpoint:
		var e endpoint.ClusterLoadAssignment
		if err := a.UnmarshalTo(&e); err != nil {
			t.Fatal(err)
		}
		return e.GetClusterName()
	case xds.TypeListener:
		var l listener.Listener
		if err := a.UnmarshalTo(&l); err != nil {
			t.Fatal(err)
		}
		return l.GetName()
	}
	return xds.SingletonName
}

// TestRelayAgainstRealIstiod: a relay in front of a real istiod (on a real
// API server) serves a sidecar the very config istiod serves it directly,
// type by type (clusters, listeners, its DNS name table); a second sidecar
// of the workload shares the key's one upstream stream; and istioctl, run
// against the relay, lists the sidecars.
func TestRelayAgainstRealIstiod(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	m := startMesh(t, ctx)
	cfg := relay.DefaultConfig()
	cfg.ID, cfg.Upstream.Addr, cfg.XDS.Listen = "meshrelay-e2e", m.istiod.PlainAddr, "127.0.0.1:0"
	if os.Getenv("RELAY_TEST_LOG") != "" {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	node, err := shard.NewNode(shard.NodeConfig{Relay: cfg})
	if err != nil {
		t.Fatal(err)
	}
	if err := node.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = node.Stop(context.Background()) })
	r := node.Relay()

	pod := sidecarNode("ns1", "reviews", 0)
	// istiod builds the Service's config a moment after it is written:
	// compare once istiod serves it, and until both sides agree (each
	// fetch is a new stream's full answer).
	const svcCluster = "outbound|9080||reviews.ns1.svc.cluster.local"
	var direct, relayed map[string]map[string]string
	for try := 0; ; try++ {
		direct = fetch(t, ctx, m.istiod.PlainAddr, pod)
		relayed = fetch(t, ctx, r.Addr().String(), pod)
		_, served := direct[xds.TypeCluster][svcCluster]
		same := served
		for _, typeURL := range []string{xds.TypeCluster, xds.TypeEndpoint, xds.TypeListener, xds.TypeNameTable} {
			same = same && len(direct[typeURL]) > 0 && maps.Equal(direct[typeURL], relayed[typeURL])
		}
		if same {
			break
		}
		if try == 50 {
			for _, typeURL := range []string{xds.TypeCluster, xds.TypeEndpoint, xds.TypeListener, xds.TypeNameTable} {
				t.Errorf("%s: istiod %v, through the relay %v", xds.ShortType(typeURL), slices.Sorted(maps.Keys(direct[typeURL])), slices.Sorted(maps.Keys(relayed[typeURL])))
			}
			t.Fatalf("the relay's config never equalled istiod's (istiod serves %s: %v)", svcCluster, served)
		}
		time.Sleep(200 * time.Millisecond)
	}
	second := fetch(t, ctx, r.Addr().String(), sidecarNode("ns1", "reviews", 1))
	if !maps.Equal(second[xds.TypeCluster], direct[xds.TypeCluster]) {
		t.Errorf("the workload's second pod got other clusters through the relay")
	}
	if st := r.Stats(); st.Keys != 1 {
		t.Errorf("the relay holds %d keys for two pods of a workload, want 1", st.Keys)
	}

	// istioctl, as an operator runs it against istiod's plaintext port,
	// run against the relay's: it lists the sidecars connected there.
	_, closeA := connect(t, ctx, r.Addr().String(), sidecarNode("ns1", "reviews", 0))
	defer closeA()
	_, closeB := connect(t, ctx, r.Addr().String(), sidecarNode("ns1", "reviews", 1))
	defer closeB()
	out := istioctl(t, ctx, m, "proxy-status", "--xds-address", r.Addr().String(), "--plaintext")
	t.Logf("istioctl proxy-status --xds-address <relay> --plaintext:\n%s", out)

	for _, pod := range []*core.Node{sidecarNode("ns1", "reviews", 0), sidecarNode("ns1", "reviews", 1)} {
		if !strings.Contains(out, pod.GetId()) {
			t.Errorf("istioctl proxy-status against the relay does not list %s:\n%s", pod.GetId(), out)
		}
	}
}

// istioctl runs the real istioctl against the mesh's API server and
// returns its output, failing the test if it fails.
func istioctl(t *testing.T, ctx context.Context, m *mesh, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, m.bins.Istioctl, append(args, "--kubeconfig", m.kube.Kubeconfig)...)
	cmd.Env = append(os.Environ(), "HOME="+m.dir) // its config file, not the user's
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("istioctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestRelayTLSWithRealTokens: `meshrelay serve` as a drop-in for istiod's
// 15012 (deploy/OPERATING.md's "Istio with TLS", as a single relay), verifying
// sidecars' service-account tokens by TokenReview against the real API
// server through --kubeconfig: a sidecar with its own token is served; one
// presenting another namespace's is refused as istiod refuses it; and
// istioctl, which presents istio-system's default account over TLS, lists
// the tier's sidecars (istiod's rule for its root namespace).
func TestRelayTLSWithRealTokens(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	m := startMesh(t, ctx)
	for _, sa := range []struct{ ns, name string }{{SystemNamespace, "default"}, {"ns1", "default"}, {"ns2", "default"}} {
		if err := m.kube.AddServiceAccount(ctx, sa.ns, sa.name); err != nil {
			t.Fatal(err)
		}
	}
	bin := buildMeshrelay(t, ctx, m.dir)
	certFile, keyFile := m.istiod.Root.Serving(t, "meshrelay.istio-system.svc").Write(t, "")
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	addr := "127.0.0.1:" + strconv.Itoa(port)
	adminPort, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(m.dir, "root-cert.pem")
	if err := os.WriteFile(root, m.istiod.Root.RootPEM(), 0o644); err != nil {
		t.Fatal(err)
	}
	// forward (the default with --xds-auth jwt): each key's stream to
	// istiod's 15012 presents one of its sidecars' own tokens.
	relayCmd := exec.Command(bin, "serve", "--upstream", m.istiod.TLSAddr, "--upstream-ca", root, "--upstream-san", "istiod.istio-system.svc",
		"--xds-tls-listen", addr, "--xds-tls-cert", certFile, "--xds-tls-key", keyFile,
		"--xds-auth", "jwt", "--jwt-verifier", "tokenreview", "--kubeconfig", m.kube.Kubeconfig,
		"--gossip-listen", "", "--admin-listen", "127.0.0.1:"+strconv.Itoa(adminPort), "--id", "meshrelay-tls", "--log-level", "warn")
	relayCmd.Stdout, relayCmd.Stderr = processLog(t, m.dir, "meshrelay"), processLog(t, m.dir, "meshrelay-err")
	relayCmd.SysProcAttr = childAttr()
	if err := relayCmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = relayCmd.Process.Kill(); _ = relayCmd.Wait() })
	// Ready once it reached istiod (its health checks answer while its
	// admin API is closed to callers it cannot prove).
	waitHTTPOK(t, ctx, "http://127.0.0.1:"+strconv.Itoa(adminPort)+"/readyz", "meshrelay")

	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(m.istiod.Root.RootPEM())
	creds := grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: "meshrelay.istio-system.svc", MinVersion: tls.VersionTLS12}))
	first := func(node *core.Node, token string) (*discovery.DiscoveryResponse, func(), error) {
		conn, err := grpc.NewClient(addr, creds)
		if err != nil {
			t.Fatal(err)
		}
		sctx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
		for {
			st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(sctx)
			var resp *discovery.DiscoveryResponse
			if err == nil {
				if err = st.Send(&discovery.DiscoveryRequest{Node: node, TypeUrl: xds.TypeCluster}); err == nil || err == io.EOF {
					resp, err = st.Recv()
				}
			}
			// The relay refuses streams (Unavailable) until it reached
			// istiod; Envoy retries those.
			if status.Code(err) != codes.Unavailable || ctx.Err() != nil {
				return resp, func() { conn.Close() }, err
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	pod := sidecarNode("ns1", "reviews", 0)
	resp, closePod, err := first(pod, m.kube.Token(t, ctx, "ns1", "default"))
	if err != nil || len(resp.GetResources()) == 0 {
		t.Fatalf("a sidecar with its own token: %v (%d clusters), want its clusters", err, len(resp.GetResources()))
	}
	defer closePod()
	_, closeOther, err := first(sidecarNode("ns1", "reviews", 1), m.kube.Token(t, ctx, "ns2", "default"))
	closeOther()
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a sidecar of ns1 presenting ns2's token: %v, want PermissionDenied", err)
	}
	out := istioctl(t, ctx, m, "proxy-status", "--xds-address", addr)
	t.Logf("istioctl proxy-status --xds-address <relay's TLS port>:\n%s", out)
	if !strings.Contains(out, pod.GetId()) {
		t.Errorf("istioctl proxy-status over TLS does not list %s", pod.GetId())
	}
}

// buildMeshrelay builds cmd/meshrelay into dir.
func buildMeshrelay(t *testing.T, ctx context.Context, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, "meshrelay")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/meshrelay/meshrelay/cmd/meshrelay").CombinedOutput(); err != nil {
		t.Fatalf("go build meshrelay: %v\n%s", err, out)
	}
	return bin
}

// hostHTTP is the tests' HTTP client on the host side: a connection per
// request, and dials bounded too (the transport goes on dialing after a
// request is given up: an address whose SYN goes unanswered would hold
// a goroutine past the test).
var hostHTTP = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
	DisableKeepAlives: true,
	DialContext:       (&net.Dialer{Timeout: 3 * time.Second}).DialContext,
}}

// waitHTTPOK waits until url answers 200.
func waitHTTPOK(t *testing.T, ctx context.Context, url, what string) {
	t.Helper()
	last := ""
	for {
		resp, err := hostHTTP.Get(url)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			last = fmt.Sprintf("%s: %s", resp.Status, strings.TrimSpace(string(b)))
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s never ready: %s", what, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Token returns a token of service account ns/sa bound to audience
// istio-ca, as kubelet projects into a sidecar (kubectl create token).
func (k *KubeAPI) Token(t *testing.T, ctx context.Context, ns, sa string) string {
	t.Helper()
	tr, err := k.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{Audiences: []string{"istio-ca"}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token of %s/%s: %v", ns, sa, err)
	}
	return tr.Status.Token
}
