package realistio

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/realenvoy/install"
	"github.com/meshrelay/meshrelay/relay"

	_ "github.com/cncf/xds/go/udpa/type/v1" // TypedStruct, in Istio's config
	_ "github.com/cncf/xds/go/xds/type/v3"
	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshrelay/meshrelay/loadtest/realenvoy"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// The sidecar suite: real pilot-agents, each starting a real Envoy in a
// network namespace of its own with DNS capture on, against a tier of
// three `meshrelay serve` processes on TLS in front of a real istiod, as
// an operator runs them (deploy/ISTIO.md): tokens verified by TokenReview,
// forwarded to istiod's 15012, relays dialing each other over mTLS. One
// more pod of each workload is on istiod directly, as the reference.

const (
	relayName  = "meshrelay.istio-system.svc"
	istiodName = "istiod.istio-system.svc"
	// detailsSvc is the service the pods call; its backends are HTTP
	// servers of the test's.
	detailsHost = "details.ns1.svc.cluster.local"
	detailsPort = 9080
)

// sidecar is one pod: pilot-agent and its Envoy in netns.
type sidecar struct {
	pod, ns, app, netns, ip string
	cmd                     *exec.Cmd
	admin, client           *http.Client
}

// NodeID is the node id pilot-agent presents for the pod.
func (s *sidecar) NodeID() string {
	return fmt.Sprintf("sidecar~%s~%s.%s~%s.svc.cluster.local", s.ip, s.pod, s.ns, s.ns)
}

// startSidecar starts pilot-agent for pod app-i of ns (service account
// app) in a new network namespace, dialing xds for its config and istiod
// for its certificate.
func startSidecar(t *testing.T, ctx context.Context, m *mesh, pn *podNet, envoy, app string, i, last int, xds string, hosts map[string][]string) *sidecar {
	t.Helper()
	s := &sidecar{pod: fmt.Sprintf("%s-v1-%d", app, i), ns: "ns1", app: app}
	s.netns, s.ip = pn.pod(last, hosts, "10.96.0.0/16")
	dir := filepath.Join(m.dir, s.pod)
	for _, d := range []string{"var/run/secrets/tokens", "var/run/secrets/istio", "var/lib/istio/envoy", "etc/istio/proxy",
		"var/run/secrets/workload-spiffe-uds", "var/run/secrets/workload-spiffe-credentials"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	src, err := moduleDir(ctx, IstioModule, IstioVersion)
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := os.ReadFile(filepath.Join(src, "tools", "packaging", "common", "envoy_bootstrap.json"))
	if err != nil {
		t.Fatal(err)
	}
	for path, b := range map[string][]byte{
		"var/run/secrets/tokens/istio-token":            []byte(m.kube.Token(t, ctx, s.ns, app)),
		"var/run/secrets/istio/root-cert.pem":           m.istiod.Root.RootPEM(),
		"var/lib/istio/envoy/envoy_bootstrap_tmpl.json": tmpl,
	} {
		if err := os.WriteFile(filepath.Join(dir, path), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	proxyConfig, _ := json.Marshal(map[string]any{
		"discoveryAddress": xds, "binaryPath": envoy, "configPath": filepath.Join(dir, "etc/istio/proxy"),
		"concurrency": 1, "drainDuration": "1s", "terminationDrainDuration": "1s",
	})
	labels, _ := json.Marshal(map[string]string{"app": app, "version": "v1"})
	_, caPort, _ := net.SplitHostPort(m.istiod.TLSAddr)
	s.cmd = exec.Command("ip", "netns", "exec", s.netns, m.bins.PilotAgent, "proxy", "sidecar",
		"--domain", s.ns+".svc.cluster.local", "--log_output_level", "default:warn", "--proxyLogLevel", "warning")
	s.cmd.Dir = dir
	s.cmd.Env = append(os.Environ(),
		"PROXY_CONFIG="+string(proxyConfig), "POD_NAME="+s.pod, "POD_NAMESPACE="+s.ns, "INSTANCE_IP="+s.ip,
		"HOST_IP="+hostAddr, "SERVICE_ACCOUNT="+app, "CA_ADDR="+istiodName+":"+caPort, "ISTIO_META_CLUSTER_ID="+ClusterID,
		"TRUST_DOMAIN=cluster.local", "PILOT_CERT_PROVIDER=istiod", "JWT_POLICY=third-party-jwt",
		"ISTIO_META_WORKLOAD_NAME="+app+"-v1", "ISTIO_META_OWNER=kubernetes://apis/apps/v1/namespaces/"+s.ns+"/deployments/"+app+"-v1",
		"ISTIO_META_INTERCEPTION_MODE=REDIRECT", "ISTIO_METAJSON_LABELS="+string(labels),
		"ISTIO_META_DNS_CAPTURE=true",
		// pilot-agent asks for PCDS too; istiod, without MULTI_ROOT_MESH,
		// never answers it.
		"PROXY_CONFIG_XDS_AGENT=true")
	s.cmd.Stdout = processLog(t, m.dir, s.pod)
	s.cmd.Stderr = s.cmd.Stdout
	s.cmd.SysProcAttr = childAttr()
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.cmd.Process.Kill(); _ = s.cmd.Wait() })
	s.client = podClient(s.netns)
	s.admin = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dialIn(ctx, s.netns, network, "127.0.0.1:15000")
		},
	}}
	return s
}

// waitReady waits until pilot-agent says its Envoy is ready (the status
// port, which kubelet's readiness probe asks).
func (s *sidecar) waitReady(t *testing.T, ctx context.Context) {
	t.Helper()
	waitHTTPOK(t, ctx, "http://"+net.JoinHostPort(s.ip, "15020")+"/healthz/ready", "sidecar "+s.pod)
}

// adminGet returns the body of Envoy's admin path.
func (s *sidecar) adminGet(ctx context.Context, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://envoy-admin"+path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := s.admin.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	return b, err
}

// config returns the dynamic config the sidecar's Envoy is using, by type
// URL and name.
func (s *sidecar) config(t *testing.T, ctx context.Context) map[string]map[string]proto.Message {
	t.Helper()
	body, err := s.adminGet(ctx, "/config_dump?include_eds")
	if err != nil {
		t.Fatalf("%s config_dump: %v", s.pod, err)
	}
	dump := &adminv3.ConfigDump{}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(body, dump); err != nil {
		t.Fatalf("%s config_dump: %v", s.pod, err)
	}
	dyn, err := realenvoy.Dynamic(dump)
	if err != nil {
		t.Fatalf("%s: %v", s.pod, err)
	}
	out := map[string]map[string]proto.Message{}
	for typeURL, byName := range dyn {
		out[typeURL] = map[string]proto.Message{}
		for name, r := range byName {
			out[typeURL][name] = r.Message
		}
	}
	return out
}

// resolve returns what the agent's DNS proxy answers for host, sorted.
func (s *sidecar) resolve(ctx context.Context, host string) ([]string, error) {
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		return dialIn(ctx, s.netns, network, "127.0.0.1:15053")
	}}
	addrs, err := r.LookupHost(ctx, host)
	slices.Sort(addrs)
	return addrs, err
}

// hasEndpoint reports whether Envoy's cluster of the details service has
// addr among its hosts.
func (s *sidecar) hasEndpoint(ctx context.Context, addr string) bool {
	b, err := s.adminGet(ctx, "/clusters")
	return err == nil && strings.Contains(string(b), fmt.Sprintf("outbound|%d||%s::%s:%d::", detailsPort, detailsHost, addr, detailsPort))
}

// tierRelay is one `meshrelay serve` of the tier.
type tierRelay struct {
	id, ip string
	cmd    *exec.Cmd
}

// metric returns the sum of the relay's samples of a metric (its admin
// port serves /metrics to anyone, as a scrape).
func (r *tierRelay) metric(t *testing.T, ctx context.Context, name string) float64 {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+r.ip+":15014/metrics", nil)
	resp, err := hostHTTP.Do(req)
	if err != nil {
		t.Fatalf("%s /metrics: %v", r.id, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) == 2 && (f[0] == name || strings.HasPrefix(f[0], name+"{")) {
			v, _ := strconv.ParseFloat(f[1], 64)
			sum += v
		}
	}
	return sum
}

// startTier starts three relays on TLS in front of m's istiod, as
// deploy/ISTIO.md has them: each on its own address (the Service's
// endpoints), tokens verified by TokenReview and forwarded to istiod,
// relays dialing each other on their peer ports over mTLS.
func startTier(t *testing.T, ctx context.Context, m *mesh, pn *podNet, bin string) []*tierRelay {
	t.Helper()
	dir := filepath.Join(m.dir, "tier")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	root := write("root-cert.pem", m.istiod.Root.RootPEM())
	serving := m.istiod.Root.Serving(t, relayName)
	tlsCrt, tlsKey := write("tls.crt", serving.CertPEM), write("tls.key", serving.KeyPEM)
	peer := m.istiod.Root.Workload(t, "cluster.local", SystemNamespace, "meshrelay")
	peerCrt, peerKey := write("peer.crt", peer.CertPEM), write("peer.key", peer.KeyPEM)
	// The tier's gossip key (openssl rand -base64 32): an authenticating
	// relay refuses gossip without one.
	gossipKey := make([]byte, 32)
	if _, err := rand.Read(gossipKey); err != nil {
		t.Fatal(err)
	}
	gossipKeyFile := write("gossip.key", []byte(base64.StdEncoding.EncodeToString(gossipKey)))
	_, istiodPort, _ := net.SplitHostPort(m.istiod.TLSAddr)
	var relays []*tierRelay
	var joins []string
	for i := range 3 {
		r := &tierRelay{id: fmt.Sprintf("relay-%d", i), ip: pn.hostIP(20 + i)}
		relays = append(relays, r)
		joins = append(joins, r.ip+":7946")
	}
	for _, r := range relays {
		r.cmd = exec.Command(bin, "serve", "--id", r.id,
			"--upstream", net.JoinHostPort(hostAddr, istiodPort), "--upstream-ca", root, "--upstream-san", istiodName,
			"--xds-tls-listen", r.ip+":15012", "--xds-tls-cert", tlsCrt, "--xds-tls-key", tlsKey,
			"--jwt-verifier", "tokenreview", "--kubeconfig", m.kube.Kubeconfig,
			"--peer-listen", r.ip+":15011", "--peer-tls-cert", peerCrt, "--peer-tls-key", peerKey, "--peer-tls-ca", root,
			"--peer-identity", "spiffe://cluster.local/ns/"+SystemNamespace+"/sa/meshrelay", "--advertise-peer", r.ip+":15011",
			"--gossip-listen", r.ip+":7946", "--gossip-key-file", gossipKeyFile, "--join", strings.Join(joins, ","),
			"--admin-listen", r.ip+":15014", "--advertise-admin", r.ip+":15014", "--log-level", "warn")
		r.cmd.Stdout = processLog(t, m.dir, r.id)
		r.cmd.Stderr = r.cmd.Stdout
		r.cmd.SysProcAttr = childAttr()
		if err := r.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = r.cmd.Process.Kill(); _ = r.cmd.Wait() })
	}
	for _, r := range relays {
		waitHTTPOK(t, ctx, "http://"+r.ip+":15014/readyz", r.id)
	}
	return relays
}

// backends serves HTTP on each address's detailsPort, answering its
// address: the details service's pods.
func backends(t *testing.T, addrs ...string) {
	t.Helper()
	for _, a := range addrs {
		l, err := net.Listen("tcp", net.JoinHostPort(a, strconv.Itoa(detailsPort)))
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, a) }), ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(l) }()
		t.Cleanup(func() { _ = srv.Close() })
	}
}

// setEndpoints makes the details service's EndpointSlice list addrs, as
// the EndpointSlice controller would when its pods change.
func setEndpoints(t *testing.T, ctx context.Context, m *mesh, addrs ...string) {
	t.Helper()
	es, err := m.kube.Client.DiscoveryV1().EndpointSlices("ns1").Get(ctx, "details-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ready := true
	es.Endpoints = nil
	for _, a := range addrs {
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{a}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}})
	}
	if _, err := m.kube.Client.DiscoveryV1().EndpointSlices("ns1").Update(ctx, es, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// istiodClients returns the peer addresses of istiod's xDS connections
// (its own debug view, /debug/connections).
func istiodClients(t *testing.T, ctx context.Context, m *mesh) []string {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+m.istiod.HTTPAddr+"/debug/connections", nil)
	resp, err := hostHTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v struct {
		Clients []struct {
			Address string `json:"address"`
		} `json:"clients"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		t.Fatalf("istiod /debug/connections: %v", err)
	}
	var out []string
	for _, c := range v.Clients {
		out = append(out, c.Address)
	}
	return out
}

// eventually calls cond until it is true, for up to within; what says what
// was awaited.
func eventually(t *testing.T, ctx context.Context, within time.Duration, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("never: %s", what)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// TestSidecarsThroughTier: five sidecars of two workloads (pilot-agent
// and Envoy, DNS capture on, each in its network namespace) through a
// three-relay TLS tier, and one more of each workload on istiod directly.
// Through the tier each Envoy holds the config its workload's direct one
// holds, type by type, and each agent's DNS proxy resolves names as the
// direct one's does (NDS);
// istiod's own debug view shows one connection per key, not per sidecar;
// an edit reaches every sidecar; istioctl lists the tier's sidecars; and
// a relay killed while every sidecar sends requests through its Envoy to
// the test's backends fails none of them.
func TestSidecarsThroughTier(t *testing.T) {
	needPodNet(t)
	binaries(t) // skip here, not in the namespace, if not built
	if !ownNetns(t, "TestSidecarsThroughTier") {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	envoy, err := install.Envoy(ctx)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true: %v", err)
		}
		t.Skipf("no real Envoy: %v", err)
	}
	pn := newPodNet(t)
	m := startMesh(t, ctx, ListenOn(hostAddr))
	for _, sa := range []struct{ ns, name string }{{SystemNamespace, "default"}, {"ns1", "productpage"}, {"ns1", "ratings"}} {
		if err := m.kube.AddServiceAccount(ctx, sa.ns, sa.name); err != nil {
			t.Fatal(err)
		}
	}
	be := []string{pn.hostIP(30), pn.hostIP(31), pn.hostIP(32), pn.hostIP(33)}
	backends(t, be...)
	if err := m.kube.AddService(ctx, "ns1", "details", detailsPort, be[0], be[1]); err != nil {
		t.Fatal(err)
	}
	relays := startTier(t, ctx, m, pn, buildMeshrelay(t, ctx, m.dir))

	// Each pod's hosts file names the tier's three addresses, starting
	// with a different one (a Service's endpoints, spread).
	_, istiodPort, _ := net.SplitHostPort(m.istiod.TLSAddr)
	hostsFor := func(first int) map[string][]string {
		h := map[string][]string{istiodName: {hostAddr}}
		for i := range relays {
			h[relayName] = append(h[relayName], relays[(first+i)%len(relays)].ip)
		}
		return h
	}
	var tier []*sidecar
	for i, w := range []struct {
		app string
		i   int
	}{{"productpage", 0}, {"productpage", 1}, {"productpage", 2}, {"ratings", 0}, {"ratings", 1}} {
		tier = append(tier, startSidecar(t, ctx, m, pn, envoy, w.app, w.i, 10+i, relayName+":15012", hostsFor(i)))
	}
	// The reference: a pod of each workload on istiod directly.
	direct := map[string]*sidecar{
		"productpage": startSidecar(t, ctx, m, pn, envoy, "productpage", 3, 18, istiodName+":"+istiodPort, hostsFor(0)),
		"ratings":     startSidecar(t, ctx, m, pn, envoy, "ratings", 2, 19, istiodName+":"+istiodPort, hostsFor(0)),
	}
	all := append(slices.Collect(maps.Values(direct)), tier...)
	for _, s := range all {
		s.waitReady(t, ctx)
	}

	// Through the tier, each Envoy's config is its workload's direct
	// one's, type by type: compared once the direct one serves the details
	// service, until they agree (istiod pushes each at its own pace).
	types := []string{xds.TypeCluster, xds.TypeEndpoint, xds.TypeListener, xds.TypeRoute}
	for _, s := range tier {
		var want, got map[string]map[string]proto.Message
		same := func() bool {
			want, got = direct[s.app].config(t, ctx), s.config(t, ctx)
			if _, ok := want[xds.TypeCluster][fmt.Sprintf("outbound|%d||%s", detailsPort, detailsHost)]; !ok {
				return false
			}
			return !slices.ContainsFunc(types, func(typeURL string) bool { return !maps.EqualFunc(want[typeURL], got[typeURL], proto.Equal) })
		}
		ok := false
		for try := 0; try < 100 && !ok; try++ {
			if ok = same(); !ok {
				time.Sleep(200 * time.Millisecond)
			}
		}
		if ok {
			continue
		}
		for _, typeURL := range types {
			for _, name := range slices.Sorted(maps.Keys(want[typeURL])) {
				if !proto.Equal(want[typeURL][name], got[typeURL][name]) {
					t.Errorf("%s %s: %s's differs from the direct pod's", xds.ShortType(typeURL), name, s.pod)
				}
			}
			for name := range got[typeURL] {
				if _, ok := want[typeURL][name]; !ok {
					t.Errorf("%s %s: only %s has it", xds.ShortType(typeURL), name, s.pod)
				}
			}
		}
		t.Fatalf("%s's config through the tier never equalled its workload's direct pod's", s.pod)
	}

	// NDS: every agent's DNS proxy resolves the mesh's names as its
	// workload's direct one's does.
	names := []string{detailsHost, "details.ns1", "details", "reviews.ns1.svc.cluster.local", "kubernetes.default.svc.cluster.local"}
	for _, name := range names {
		for _, s := range tier {
			ref, err := direct[s.app].resolve(ctx, name)
			if err != nil || len(ref) == 0 {
				t.Fatalf("the direct %s's DNS proxy does not resolve %s: %v %v", s.app, name, ref, err)
			}
			if addrs, err := s.resolve(ctx, name); err != nil || !slices.Equal(addrs, ref) {
				t.Errorf("%s resolves %s to %v (%v) through the tier, %v directly", s.pod, name, addrs, err, ref)
			}
		}
	}

	// istiod serves the tier one stream per key: two workloads, two
	// connections from relays (and the direct sidecar's own).
	podIPs := map[string]bool{}
	for _, s := range all {
		podIPs[s.ip] = true
	}
	var fromTier []string
	eventually(t, ctx, time.Minute, "istiod sees one connection per key", func() bool {
		fromTier = nil
		for _, a := range istiodClients(t, ctx, m) {
			if host, _, _ := net.SplitHostPort(a); !podIPs[host] {
				fromTier = append(fromTier, a)
			}
		}
		return len(fromTier) == 2
	})
	t.Logf("istiod's connections from the tier, 5 sidecars of 2 workloads: %v", fromTier)

	// istioctl, against any relay, lists every sidecar of the tier, with
	// its cluster, and filters them by namespace as against istiod.
	out := istioctl(t, ctx, m, "proxy-status", "--xds-address", relays[1].ip+":15012")
	t.Logf("istioctl proxy-status --xds-address <relay-1>:\n%s", out)
	for _, s := range tier {
		if !containsLine(out, s.NodeID(), ClusterID) {
			t.Errorf("istioctl proxy-status against relay-1 does not list %s in cluster %s", s.NodeID(), ClusterID)
		}
	}
	if out := istioctl(t, ctx, m, "proxy-status", "--xds-address", relays[2].ip+":15012", "-n", "ns1"); !containsLine(out, tier[0].NodeID()) {
		t.Errorf("istioctl proxy-status -n ns1 against relay-2 does not list %s:\n%s", tier[0].NodeID(), out)
	}
	if out := istioctl(t, ctx, m, "proxy-status", "--xds-address", relays[2].ip+":15012", "-n", "ns2"); containsLine(out, tier[0].NodeID()) {
		t.Errorf("istioctl proxy-status -n ns2 lists a sidecar of ns1:\n%s", out)
	}

	// istioctl x internal-debug asks istiod's own state, which only
	// istiod knows: the relay passes it through, with istioctl's token,
	// and istiod answers it (its syncz: the tier's key streams, each
	// presenting a sidecar of the key).
	if out := istioctl(t, ctx, m, "x", "internal-debug", "syncz", "--xds-address", relays[1].ip+":15012"); !strings.Contains(out, `"proxy": "productpage-v1-`) {
		t.Errorf("istioctl x internal-debug syncz through relay-1 does not show istiod's stream of the productpage key:\n%s", out)
	}

	// Traffic: every sidecar of the tier calls the details service by
	// name (its DNS proxy) through its Envoy, without pause, from here to
	// the end; a relay is killed in between, and an edit follows.
	var sent, failed atomic.Int64
	var firstErr sync.Once
	var trafficErr error
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, s := range tier {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				case <-time.After(20 * time.Millisecond):
				}
				sent.Add(1)
				resp, err := s.client.Get(fmt.Sprintf("http://%s:%d/", detailsHost, detailsPort))
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						err = fmt.Errorf("%s", resp.Status)
					}
				}
				if err != nil {
					failed.Add(1)
					firstErr.Do(func() { trafficErr = fmt.Errorf("%s: %w", s.pod, err) })
				}
			}
		}()
	}
	stopTraffic := sync.OnceFunc(func() { close(stop); wg.Wait() })
	defer stopTraffic()

	// An edit reaches every sidecar, through whichever relay it is on.
	setEndpoints(t, ctx, m, be[0], be[1], be[2])
	for _, s := range all {
		eventually(t, ctx, time.Minute, s.pod+" has the new endpoint", func() bool { return s.hasEndpoint(ctx, be[2]) })
	}

	// The relay holding the most of istiod's streams (the keys' owner)
	// dies (SIGKILL): its sidecars' agents dial the next address, the
	// tier hands its keys on, and no request fails; a second edit reaches
	// every sidecar after it.
	victim := relays[0]
	for _, r := range relays[1:] {
		if r.metric(t, ctx, "meshrelay_upstream_streams") > victim.metric(t, ctx, "meshrelay_upstream_streams") {
			victim = r
		}
	}
	t.Logf("killing %s: %v of istiod's streams, %v sidecars", victim.id, victim.metric(t, ctx, "meshrelay_upstream_streams"), victim.metric(t, ctx, "meshrelay_xds_clients"))
	time.Sleep(time.Second)
	_ = victim.cmd.Process.Kill()
	time.Sleep(3 * time.Second)
	setEndpoints(t, ctx, m, be[0], be[1], be[2], be[3])
	for _, s := range tier {
		eventually(t, ctx, 2*time.Minute, s.pod+" has the endpoint added after the relay died", func() bool { return s.hasEndpoint(ctx, be[3]) })
	}
	time.Sleep(time.Second)
	stopTraffic()
	t.Logf("requests through the sidecars' Envoys while %s died: %d sent, %d failed", victim.id, sent.Load(), failed.Load())
	if sent.Load() == 0 || failed.Load() > 0 {
		t.Errorf("%d of %d requests failed; the first: %v", failed.Load(), sent.Load(), trafficErr)
	}
	// The tier's keys are current: confirmed by istiod's answers, PCDS's
	// silence notwithstanding. A key no Envoy holds any more may stay stale
	// until it idles out: istioctl's (its one query above joined a key of
	// its identity's, and left), if the killed relay owned it, falls back
	// to istiod in forward mode with no member's token to present, and is
	// dropped once idle for the relay's key idle timeout (2 min by
	// default). Wait that long, and a minute.
	eventually(t, ctx, relay.DefaultKeysConfig().IdleTimeout+time.Minute, "no stale key on the live relays", func() bool {
		n := 0.0
		for _, r := range relays {
			if r != victim {
				n += r.metric(t, ctx, "meshrelay_stale_keys")
			}
		}
		return n == 0
	})
	// Every stream the tier opened to istiod presented a sidecar's token
	// (istiod logs each one it could not authenticate).
	if b, err := os.ReadFile(filepath.Join(m.dir, "istiod.log")); err != nil || strings.Contains(string(b), "Failed to authenticate client") {
		t.Errorf("istiod refused streams of the tier (%v):\n%s", err, grepLines(string(b), "Failed to authenticate client"))
	}
	eventually(t, ctx, time.Minute, "istiod sees one connection per key after the relay died", func() bool {
		n := 0
		for _, a := range istiodClients(t, ctx, m) {
			if host, _, _ := net.SplitHostPort(a); !podIPs[host] {
				n++
			}
		}
		return n == 2
	})
}

// containsLine reports whether a line of out holds every one of words.
func containsLine(out string, words ...string) bool {
	for line := range strings.Lines(out) {
		if !slices.ContainsFunc(words, func(w string) bool { return !strings.Contains(line, w) }) {
			return true
		}
	}
	return false
}

// grepLines returns the lines of s that hold word.
func grepLines(s, word string) string {
	var b strings.Builder
	for line := range strings.Lines(s) {
		if strings.Contains(line, word) {
			b.WriteString(line)
		}
	}
	return b.String()
}
