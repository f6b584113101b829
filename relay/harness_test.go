package relay

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	route "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	router "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcm "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	runtimev3 "github.com/envoyproxy/go-control-plane/envoy/service/runtime/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	meshv1alpha1 "istio.io/api/mesh/v1alpha1"

	"github.com/meshrelay/meshrelay/relay/xds"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// typeOther stands for the types the relay does not cache, which pass
// through per client (passthrough.go).
const typeOther = "type.googleapis.com/meshrelay.test.v1.PerProxy"

var upstreamTypes = append(slices.Clone(xds.PushOrder), typeOther)

// testUpstream is a real go-control-plane ADS server on loopback: one
// LinearCache per (namespace group, type), so different namespaces can see
// different views. It records every request it receives.
type testUpstream struct {
	t      testing.TB
	addr   string
	groups []string
	caches map[string]*cache.LinearCache
	opts   []grpc.ServerOption // added to the server's (interceptors)
	// groupBy names the group whose caches serve a node.
	groupBy func(*core.Node) string

	mu       sync.Mutex
	srv      *grpc.Server
	done     chan struct{}
	sotwReqs []*discovery.DiscoveryRequest
	deltaReq []*discovery.DeltaDiscoveryRequest
	open     int
	opened   int
	silent   map[string]bool // types never answered (silence)
	// quiet holds SotW types a new stream that tells a version hears
	// nothing of (quietToVersions).
	quiet map[string]bool
}

func newTestUpstream(t testing.TB, groups ...string) *testUpstream {
	t.Helper()
	return newTestUpstreamWith(t, nil, groups...)
}

// newTestUpstreamWith is newTestUpstream with server options of its own.
func newTestUpstreamWith(t testing.TB, opts []grpc.ServerOption, groups ...string) *testUpstream {
	t.Helper()
	return newTestUpstreamBy(t, opts, groupOf, groups...)
}

// newTestUpstreamBy is newTestUpstreamWith with nodes grouped by groupBy.
func newTestUpstreamBy(t testing.TB, opts []grpc.ServerOption, groupBy func(*core.Node) string, groups ...string) *testUpstream {
	t.Helper()
	if len(groups) == 0 {
		groups = []string{"default"}
	}
	u := &testUpstream{t: t, groups: groups, caches: make(map[string]*cache.LinearCache), opts: opts, groupBy: groupBy}
	for _, g := range groups {
		for _, typeURL := range upstreamTypes {
			u.caches[g+"|"+typeURL] = cache.NewLinearCache(typeURL)
		}
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.addr = lis.Addr().String()
	u.serve(lis)
	t.Cleanup(u.stop)
	return u
}

func groupOf(n *core.Node) string {
	if ns := n.GetMetadata().GetFields()["NAMESPACE"].GetStringValue(); ns != "" {
		return ns
	}
	return "default"
}

func (u *testUpstream) serve(lis net.Listener) {
	mux := &cache.MuxCache{
		Classify:      func(r *cache.Request) string { return u.groupBy(r.GetNode()) + "|" + r.GetTypeUrl() },
		ClassifyDelta: func(r *cache.DeltaRequest) string { return u.groupBy(r.GetNode()) + "|" + r.GetTypeUrl() },
		Caches:        map[string]cache.Cache{},
	}
	for k, c := range u.caches {
		mux.Caches[k] = silenceable{c, u}
	}
	cb := serverv3.CallbackFuncs{
		StreamOpenFunc:      func(context.Context, int64, string) error { u.count(1); return nil },
		StreamClosedFunc:    func(int64, *core.Node) { u.count(-1) },
		DeltaStreamOpenFunc: func(context.Context, int64, string) error { u.count(1); return nil },
		DeltaStreamClosedFunc: func(int64, *core.Node) {
			u.count(-1)
		},
		StreamRequestFunc: func(_ int64, r *discovery.DiscoveryRequest) error {
			u.mu.Lock()
			u.sotwReqs = append(u.sotwReqs, proto.Clone(r).(*discovery.DiscoveryRequest))
			u.mu.Unlock()
			return nil
		},
		StreamDeltaRequestFunc: func(_ int64, r *discovery.DeltaDiscoveryRequest) error {
			u.mu.Lock()
			u.deltaReq = append(u.deltaReq, proto.Clone(r).(*discovery.DeltaDiscoveryRequest))
			u.mu.Unlock()
			return nil
		},
	}
	srv := grpc.NewServer(append([]grpc.ServerOption{grpc.MaxRecvMsgSize(256 << 20), grpc.MaxSendMsgSize(256 << 20)}, u.opts...)...)
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, serverv3.NewServer(context.Background(), mux, cb))
	done := make(chan struct{})
	u.mu.Lock()
	u.srv, u.done = srv, done
	u.mu.Unlock()
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
}

// silence makes the upstream never answer typeURL from now on, as istiod
// never answers PCDS without MULTI_ROOT_MESH.
func (u *testUpstream) silence(typeURL string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.silent == nil {
		u.silent = map[string]bool{}
	}
	u.silent[typeURL] = true
}

func (u *testUpstream) silenced(typeURL string) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.silent[typeURL]
}

// quietToVersions makes the upstream never answer a SotW request of
// typeURL that carries a version but no nonce (a new stream's) from now
// on: a stream that tells it the version the relay holds hears nothing of
// the type, as from go-control-plane's snapshot cache, which answers only
// a version that differs from its own. A request without a version is
// answered.
func (u *testUpstream) quietToVersions(typeURL string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.quiet == nil {
		u.quiet = map[string]bool{}
	}
	u.quiet[typeURL] = true
}

func (u *testUpstream) quietTo(r *cache.Request) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.quiet[r.GetTypeUrl()] && r.GetVersionInfo() != "" && r.GetResponseNonce() == ""
}

// silenceable is a cache the upstream may silence: its watches then never
// fire.
type silenceable struct {
	*cache.LinearCache
	u *testUpstream
}

func (c silenceable) CreateWatch(r *cache.Request, sub cache.Subscription, out chan cache.Response) (func(), error) {
	if c.u.silenced(r.GetTypeUrl()) || c.u.quietTo(r) {
		return func() {}, nil
	}
	return c.LinearCache.CreateWatch(r, sub, out)
}

func (c silenceable) CreateDeltaWatch(r *cache.DeltaRequest, sub cache.Subscription, out chan cache.DeltaResponse) (func(), error) {
	if c.u.silenced(r.GetTypeUrl()) {
		return func() {}, nil
	}
	return c.LinearCache.CreateDeltaWatch(r, sub, out)
}

func (u *testUpstream) count(d int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.open += d
	if d > 0 {
		u.opened++
	}
}

// streams returns the upstream streams open now and ever opened.
func (u *testUpstream) streams() (open, opened int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.open, u.opened
}

// stop kills the upstream (streams end with an error at the relay).
func (u *testUpstream) stop() {
	u.mu.Lock()
	srv, done := u.srv, u.done
	u.srv = nil
	u.mu.Unlock()
	if srv != nil {
		srv.Stop()
		<-done
	}
}

// restart serves the same caches on the same address again.
func (u *testUpstream) restart() {
	u.t.Helper()
	u.mu.Lock()
	addr := u.addr
	u.mu.Unlock()
	var lis net.Listener
	var err error
	for range 50 { // the port may take a moment to be free again
		if lis, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		// Taken for good: by an outgoing connection of another test
		// process that got it as its ephemeral port, or by a redial of
		// the relay's that connected to itself (Linux's TCP simultaneous
		// open). Relays started with startRelay follow the upstream
		// wherever it listens (dialCurrent).
		if lis, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			u.t.Fatalf("restart upstream: %v", err)
		}
		u.t.Logf("restart upstream: %s is taken; listening on %s", addr, lis.Addr())
		u.mu.Lock()
		u.addr = lis.Addr().String()
		u.mu.Unlock()
	}
	u.serve(lis)
}

// dialCurrent dials the upstream where it listens now (restart may have
// moved it), whatever address the relay names.
func (u *testUpstream) dialCurrent(ctx context.Context, _ string) (net.Conn, error) {
	u.mu.Lock()
	addr := u.addr
	u.mu.Unlock()
	var d net.Dialer
	return d.DialContext(ctx, "tcp", addr)
}

func (u *testUpstream) set(group, typeURL string, res ...types.Resource) {
	u.t.Helper()
	upd := map[string]types.Resource{}
	for _, r := range res {
		upd[cache.GetResourceName(r)] = r
	}
	if typeURL == typeOther || xds.Singleton(typeURL) {
		upd = map[string]types.Resource{}
		for i, r := range res {
			upd[fmt.Sprint("nds-", i)] = r
		}
	}
	if err := u.caches[group+"|"+typeURL].UpdateResources(upd, nil); err != nil {
		u.t.Fatal(err)
	}
}

func (u *testUpstream) del(group, typeURL string, names ...string) {
	u.t.Helper()
	if err := u.caches[group+"|"+typeURL].UpdateResources(nil, names); err != nil {
		u.t.Fatal(err)
	}
}

// nacksSeen returns the requests with error_detail that reached the upstream.
func (u *testUpstream) nacksSeen() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := 0
	for _, r := range u.sotwReqs {
		if r.GetErrorDetail() != nil {
			n++
		}
	}
	for _, r := range u.deltaReq {
		if r.GetErrorDetail() != nil {
			n++
		}
	}
	return n
}

// startRelay starts a relay in front of up on loopback.
func startRelay(t testing.TB, up *testUpstream, mod func(*Config)) *Relay {
	t.Helper()
	return startRelayTo(t, up.addr, func(c *Config) {
		c.Upstream.DialOptions = append(c.Upstream.DialOptions, grpc.WithContextDialer(up.dialCurrent))
		if mod != nil {
			mod(c)
		}
	})
}

// startRelayTo starts a relay on loopback in front of the upstream at addr
// and stops it when the test ends.
func startRelayTo(t testing.TB, addr string, mod func(*Config)) *Relay {
	t.Helper()
	cfg := DefaultConfig()
	cfg.ID = "relay-test"
	cfg.XDS.Listen = "127.0.0.1:0"
	cfg.Upstream.Addr = addr
	cfg.Upstream.BackoffInitial = 20 * time.Millisecond
	cfg.Upstream.BackoffMax = 200 * time.Millisecond
	// The tests count the upstream streams a key opens: a divergence
	// check is one more. Its tests turn it on.
	cfg.Keys.DivergenceInterval = 0
	if os.Getenv("RELAY_TEST_LOG") != "" {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	if mod != nil {
		mod(&cfg)
	}
	r, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := r.Stop(ctx); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
	return r
}

func dial(t testing.TB, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(256<<20)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// dialWindow dials with fixed flow-control windows (no BDP growth).
func dialWindow(t testing.TB, addr string, window int32) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(window), grpc.WithInitialConnWindowSize(window),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(256<<20)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// node builds an Istio-shaped node of workload wl, pod i, in namespace ns.
func node(ns, wl string, i int) *core.Node {
	md, err := structpb.NewStruct(map[string]any{
		"NAMESPACE":     ns,
		"WORKLOAD_NAME": wl,
		"ISTIO_VERSION": "1.28.0",
		"CLUSTER_ID":    "Kubernetes",
		"INSTANCE_IPS":  fmt.Sprintf("10.0.%d.%d", i/250, i%250+1),
		"LABELS":        map[string]any{"app": wl, "version": "v1"},
	})
	if err != nil {
		panic(err)
	}
	return &core.Node{
		Id:       fmt.Sprintf("sidecar~10.0.%d.%d~%s-%d.%s~%s.svc.cluster.local", i/250, i%250+1, wl, i, ns, ns),
		Metadata: md,
	}
}

// Resource fixtures, istiod-shaped.

func mkCluster(name string, extra ...string) *cluster.Cluster {
	c := &cluster.Cluster{
		Name:                 name,
		ClusterDiscoveryType: &cluster.Cluster_Type{Type: cluster.Cluster_EDS},
		ConnectTimeout:       durationpb.New(10 * time.Second),
		EdsClusterConfig: &cluster.Cluster_EdsClusterConfig{
			ServiceName: name,
			EdsConfig:   &core.ConfigSource{ConfigSourceSpecifier: &core.ConfigSource_Ads{Ads: &core.AggregatedConfigSource{}}},
		},
	}
	if len(extra) > 0 {
		c.AltStatName = extra[0]
	}
	return c
}

func mkCLA(name string, ports ...uint32) *endpoint.ClusterLoadAssignment {
	cla := &endpoint.ClusterLoadAssignment{ClusterName: name}
	var lbs []*endpoint.LbEndpoint
	for _, p := range ports {
		lbs = append(lbs, &endpoint.LbEndpoint{HostIdentifier: &endpoint.LbEndpoint_Endpoint{Endpoint: &endpoint.Endpoint{
			Address: &core.Address{Address: &core.Address_SocketAddress{SocketAddress: &core.SocketAddress{
				Address: "10.1.0.1", PortSpecifier: &core.SocketAddress_PortValue{PortValue: p},
			}}},
		}}})
	}
	cla.Endpoints = []*endpoint.LocalityLbEndpoints{{LbEndpoints: lbs}}
	return cla
}

func mkListener(name, routeName string) *listener.Listener {
	rtr, _ := anypb.New(&router.Router{})
	m := &hcm.HttpConnectionManager{
		StatPrefix:     name,
		RouteSpecifier: &hcm.HttpConnectionManager_Rds{Rds: &hcm.Rds{RouteConfigName: routeName, ConfigSource: &core.ConfigSource{ConfigSourceSpecifier: &core.ConfigSource_Ads{Ads: &core.AggregatedConfigSource{}}}}},
		HttpFilters:    []*hcm.HttpFilter{{Name: "envoy.filters.http.router", ConfigType: &hcm.HttpFilter_TypedConfig{TypedConfig: rtr}}},
	}
	a, _ := anypb.New(m)
	return &listener.Listener{
		Name: name,
		Address: &core.Address{Address: &core.Address_SocketAddress{SocketAddress: &core.SocketAddress{
			Address: "0.0.0.0", PortSpecifier: &core.SocketAddress_PortValue{PortValue: 80},
		}}},
		FilterChains: []*listener.FilterChain{{Filters: []*listener.Filter{{Name: "envoy.filters.network.http_connection_manager", ConfigType: &listener.Filter_TypedConfig{TypedConfig: a}}}}},
	}
}

func mkRoute(name string, clusters ...string) *route.RouteConfiguration {
	rc := &route.RouteConfiguration{Name: name}
	for _, c := range clusters {
		rc.VirtualHosts = append(rc.VirtualHosts, &route.VirtualHost{
			Name: c, Domains: []string{c},
			Routes: []*route.Route{{
				Match:  &route.RouteMatch{PathSpecifier: &route.RouteMatch_Prefix{Prefix: "/"}},
				Action: &route.Route_Route{Route: &route.RouteAction{ClusterSpecifier: &route.RouteAction_Cluster{Cluster: c}}},
			}},
		})
	}
	return rc
}

// seed fills group g of up with n services: clusters c0…, their CLAs,
// listener "l80" with route "r80" pointing at every cluster.
func seed(up *testUpstream, g string, n int) {
	var cs, es []types.Resource
	var names []string
	for i := range n {
		name := fmt.Sprint("c", i)
		names = append(names, name)
		cs = append(cs, mkCluster(name))
		es = append(es, mkCLA(name, 8080))
	}
	up.set(g, xds.TypeCluster, cs...)
	up.set(g, xds.TypeEndpoint, es...)
	up.set(g, xds.TypeListener, mkListener("l80", "r80"))
	up.set(g, xds.TypeRoute, mkRoute("r80", names...))
	var barriers []types.Resource
	for i := 1; i <= 50; i++ {
		barriers = append(barriers, &runtimev3.Runtime{Name: fmt.Sprint("barrier-", i), Layer: &structpb.Struct{}})
	}
	up.set(g, xds.TypeRuntime, barriers...)
	up.set(g, xds.TypeNameTable, nameTable(g, n))
	up.set(g, xds.TypeProxyConfig, &meshv1alpha1.ProxyConfig{CaCertificatesPem: []string{"root of " + g}})
}
