package envoy

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	route "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcm "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tls "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/delta/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/sotw/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// The upstream used by these tests is go-control-plane's own SotW and Delta
// server engines (pkg/server/sotw/v3, pkg/server/delta/v3) behind a
// three-line ADS adapter. pkg/server/v3, which bundles them, needs the
// go-control-plane/ratelimit module, which this module does not require.

const (
	secretType = resource.SecretType
	nameTable  = "type.googleapis.com/istio.networking.nds.v1.NameTable"
	testNodeID = "sidecar~10.0.0.1~app-0.ns~ns.svc.cluster.local"
)

// world is the configuration the upstream serves.
type world struct {
	clusters map[string]uint32   // EDS cluster → its endpoint's port
	routes   map[string][]string // route configuration → clusters it uses
	lns      map[string]string   // listener → its route configuration
	secrets  []string
}

// baseWorld: c2 is used by no route, so it can be removed on its own.
func baseWorld() world {
	return world{
		clusters: map[string]uint32{"c1": 8001, "c2": 8002},
		routes:   map[string][]string{"r1": {"c1"}},
		lns:      map[string]string{"l1": "r1"},
		secrets:  []string{"s1"},
	}
}

func (w world) clone() world {
	c := world{
		clusters: make(map[string]uint32),
		routes:   make(map[string][]string),
		lns:      make(map[string]string),
		secrets:  append([]string(nil), w.secrets...),
	}
	for k, v := range w.clusters {
		c.clusters[k] = v
	}
	for k, v := range w.routes {
		c.routes[k] = append([]string(nil), v...)
	}
	for k, v := range w.lns {
		c.lns[k] = v
	}
	return c
}

func edsCluster(name string) *cluster.Cluster {
	return &cluster.Cluster{
		Name:                 name,
		ClusterDiscoveryType: &cluster.Cluster_Type{Type: cluster.Cluster_EDS},
		EdsClusterConfig: &cluster.Cluster_EdsClusterConfig{
			EdsConfig: &core.ConfigSource{ConfigSourceSpecifier: &core.ConfigSource_Ads{Ads: &core.AggregatedConfigSource{}}},
		},
	}
}

func staticCluster(name string) *cluster.Cluster {
	return &cluster.Cluster{Name: name, ClusterDiscoveryType: &cluster.Cluster_Type{Type: cluster.Cluster_STATIC}}
}

func loadAssignment(name string, port uint32) *endpoint.ClusterLoadAssignment {
	return &endpoint.ClusterLoadAssignment{
		ClusterName: name,
		Endpoints: []*endpoint.LocalityLbEndpoints{{
			LbEndpoints: []*endpoint.LbEndpoint{{
				HostIdentifier: &endpoint.LbEndpoint_Endpoint{Endpoint: &endpoint.Endpoint{
					Address: &core.Address{Address: &core.Address_SocketAddress{SocketAddress: &core.SocketAddress{
						Address:       "10.1.0.1",
						PortSpecifier: &core.SocketAddress_PortValue{PortValue: port},
					}}},
				}},
			}},
		}},
	}
}

func portOf(t *testing.T, h Held) uint32 {
	t.Helper()
	var c endpoint.ClusterLoadAssignment
	if err := h.Resource.UnmarshalTo(&c); err != nil {
		t.Fatalf("decode CLA: %v", err)
	}
	return c.GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetSocketAddress().GetPortValue()
}

func rdsListener(name, routeName string) *listener.Listener {
	m := &hcm.HttpConnectionManager{
		StatPrefix: name,
		RouteSpecifier: &hcm.HttpConnectionManager_Rds{Rds: &hcm.Rds{
			RouteConfigName: routeName,
			ConfigSource:    &core.ConfigSource{ConfigSourceSpecifier: &core.ConfigSource_Ads{Ads: &core.AggregatedConfigSource{}}},
		}},
	}
	tc, err := anypb.New(m)
	if err != nil {
		panic(err)
	}
	return &listener.Listener{
		Name: name,
		FilterChains: []*listener.FilterChain{{Filters: []*listener.Filter{{
			Name:       "envoy.filters.network.http_connection_manager",
			ConfigType: &listener.Filter_TypedConfig{TypedConfig: tc},
		}}}},
	}
}

func routeConfig(name string, clusters ...string) *route.RouteConfiguration {
	rc := &route.RouteConfiguration{Name: name}
	vh := &route.VirtualHost{Name: name, Domains: []string{"*"}}
	for _, c := range clusters {
		vh.Routes = append(vh.Routes, &route.Route{
			Match:  &route.RouteMatch{PathSpecifier: &route.RouteMatch_Prefix{Prefix: "/" + c}},
			Action: &route.Route_Route{Route: &route.RouteAction{ClusterSpecifier: &route.RouteAction_Cluster{Cluster: c}}},
		})
	}
	rc.VirtualHosts = []*route.VirtualHost{vh}
	return rc
}

// resources renders a world, by type, in push order.
func (w world) resources() map[string]map[string]types.Resource {
	out := map[string]map[string]types.Resource{
		resource.ClusterType:  {},
		resource.EndpointType: {},
		resource.ListenerType: {},
		resource.RouteType:    {},
		secretType:            {},
	}
	for n, port := range w.clusters {
		out[resource.ClusterType][n] = edsCluster(n)
		out[resource.EndpointType][n] = loadAssignment(n, port)
	}
	for n, cs := range w.routes {
		out[resource.RouteType][n] = routeConfig(n, cs...)
	}
	for n, r := range w.lns {
		out[resource.ListenerType][n] = rdsListener(n, r)
	}
	for _, n := range w.secrets {
		out[secretType][n] = &tls.Secret{Name: n}
	}
	return out
}

var pushOrder = []string{resource.ClusterType, resource.EndpointType, resource.ListenerType, resource.RouteType, secretType}

// allNodes makes every node share one snapshot.
type allNodes struct{}

func (allNodes) ID(*core.Node) string { return "all" }

// recorder keeps what the upstream received and sent, via its callbacks.
type recorder struct {
	mu     sync.Mutex
	epoch  int // incremented on every restart
	sotw   []sotwReq
	delta  []deltaReq
	sresp  []*discovery.DiscoveryResponse
	dresp  []*discovery.DeltaDiscoveryResponse
	opened int
	change chan struct{}
	quiet  bool // keep nothing (benchmarks)
}

type sotwReq struct {
	epoch  int
	stream int64
	req    *discovery.DiscoveryRequest
}

type deltaReq struct {
	epoch  int
	stream int64
	req    *discovery.DeltaDiscoveryRequest
}

func newRecorder() *recorder { return &recorder{change: make(chan struct{})} }

func (r *recorder) changed() {
	close(r.change)
	r.change = make(chan struct{})
}

func (r *recorder) OnStreamOpen(context.Context, int64, string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.opened++
	r.changed()
	return nil
}

func (r *recorder) OnStreamClosed(int64, *core.Node) {}

func (r *recorder) OnStreamRequest(id int64, req *discovery.DiscoveryRequest) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.quiet {
		return nil
	}
	r.sotw = append(r.sotw, sotwReq{epoch: r.epoch, stream: id, req: proto.Clone(req).(*discovery.DiscoveryRequest)})
	r.changed()
	return nil
}

func (r *recorder) OnStreamResponse(_ context.Context, _ int64, _ *discovery.DiscoveryRequest, resp *discovery.DiscoveryResponse) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.quiet {
		return
	}
	r.sresp = append(r.sresp, proto.Clone(resp).(*discovery.DiscoveryResponse))
	r.changed()
}

func (r *recorder) OnDeltaStreamOpen(context.Context, int64, string) error {
	return r.OnStreamOpen(context.Background(), 0, "")
}

func (r *recorder) OnDeltaStreamClosed(int64, *core.Node) {}

func (r *recorder) OnStreamDeltaRequest(id int64, req *discovery.DeltaDiscoveryRequest) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.quiet {
		return nil
	}
	r.delta = append(r.delta, deltaReq{epoch: r.epoch, stream: id, req: proto.Clone(req).(*discovery.DeltaDiscoveryRequest)})
	r.changed()
	return nil
}

func (r *recorder) OnStreamDeltaResponse(_ int64, _ *discovery.DeltaDiscoveryRequest, resp *discovery.DeltaDiscoveryResponse) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.quiet {
		return
	}
	r.dresp = append(r.dresp, proto.Clone(resp).(*discovery.DeltaDiscoveryResponse))
	r.changed()
}

// waitFor waits until cond (called with r.mu held) holds, or fails the test.
func (r *recorder) waitFor(t testing.TB, what string, cond func(r *recorder) bool) {
	t.Helper()
	deadline := time.NewTimer(10 * time.Second)
	defer deadline.Stop()
	for {
		r.mu.Lock()
		ok := cond(r)
		ch := r.change
		r.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-ch:
		case <-deadline.C:
			t.Fatalf("upstream: timed out waiting for %s", what)
		}
	}
}

// adsServer exposes go-control-plane's engines as the ADS service.
type adsServer struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	sotw  sotw.Server
	delta delta.Server
}

func (s *adsServer) StreamAggregatedResources(st discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	return s.sotw.StreamHandler(st, resource.AnyType)
}

func (s *adsServer) DeltaAggregatedResources(st discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	return s.delta.DeltaStreamHandler(st, resource.AnyType)
}

// upstream is a real go-control-plane ADS server on bufconn.
type upstream struct {
	t      testing.TB
	kind   string // "snapshot" or "linear"
	snap   cache.SnapshotCache
	linear map[string]*cache.LinearCache
	cache  cache.Cache
	rec    *recorder
	conn   *grpc.ClientConn

	mu      sync.Mutex
	version int
	last    map[string]map[string]types.Resource // linear: what is served
	lis     *bufconn.Listener
	srv     *grpc.Server
	cancel  context.CancelFunc
	done    chan struct{}
}

var cacheKinds = []string{"snapshot", "linear"}

func newUpstream(t testing.TB, kind string, w world) *upstream {
	t.Helper()
	u := &upstream{t: t, kind: kind, rec: newRecorder()}
	switch kind {
	case "snapshot":
		u.snap = cache.NewSnapshotCache(true, allNodes{}, nil)
		u.cache = u.snap
	case "linear":
		u.linear = make(map[string]*cache.LinearCache)
		mux := &cache.MuxCache{
			Classify:      func(r *cache.Request) string { return r.GetTypeUrl() },
			ClassifyDelta: func(r *cache.DeltaRequest) string { return r.GetTypeUrl() },
			Caches:        make(map[string]cache.Cache),
		}
		for _, typ := range append(pushOrder, nameTable) {
			lc := cache.NewLinearCache(typ)
			u.linear[typ] = lc
			mux.Caches[typ] = lc
		}
		u.linear[nameTable].SetResources(map[string]types.Resource{"nt": wrapperspb.String("names")})
		u.cache = mux
	default:
		t.Fatalf("unknown cache kind %q", kind)
	}
	u.set(w)
	u.start()
	conn, err := grpc.NewClient("passthrough:///upstream",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			u.mu.Lock()
			lis := u.lis
			u.mu.Unlock()
			if lis == nil {
				return nil, fmt.Errorf("upstream is down")
			}
			return lis.DialContext(ctx)
		}),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 10 * time.Millisecond, Multiplier: 1.6, MaxDelay: 100 * time.Millisecond},
			MinConnectTimeout: time.Second,
		}),
	)
	if err != nil {
		t.Fatalf("grpc.NewClient: %v", err)
	}
	u.conn = conn
	t.Cleanup(func() {
		conn.Close()
		u.stop()
	})
	return u
}

// set makes the upstream serve w.
func (u *upstream) set(w world) {
	u.t.Helper()
	res := w.resources()
	u.mu.Lock()
	u.version++
	v := u.version
	u.mu.Unlock()
	if u.snap != nil {
		byType := make(map[string][]types.Resource)
		for typ, m := range res {
			for _, r := range m {
				byType[typ] = append(byType[typ], r)
			}
		}
		s, err := cache.NewSnapshot(fmt.Sprint(v), byType)
		if err != nil {
			u.t.Fatalf("NewSnapshot: %v", err)
		}
		if err := u.snap.SetSnapshot(context.Background(), "all", s); err != nil {
			u.t.Fatalf("SetSnapshot: %v", err)
		}
		return
	}
	// Like istiod, update only what changed (SetResources would mark every
	// resource as changed).
	for _, typ := range pushOrder {
		update := map[string]types.Resource{}
		var del []string
		for n, r := range res[typ] {
			if old, ok := u.last[typ][n]; !ok || !proto.Equal(old, r) {
				update[n] = r
			}
		}
		for n := range u.last[typ] {
			if _, ok := res[typ][n]; !ok {
				del = append(del, n)
			}
		}
		if len(update) > 0 || len(del) > 0 {
			if err := u.linear[typ].UpdateResources(update, del); err != nil {
				u.t.Fatalf("UpdateResources: %v", err)
			}
		}
	}
	u.last = res
}

// snapshotVersion is the version the SnapshotCache serves now.
func (u *upstream) snapshotVersion() string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return fmt.Sprint(u.version)
}

// start (re)starts the gRPC server on a fresh listener.
func (u *upstream) start() {
	ctx, cancel := context.WithCancel(context.Background())
	srv := grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, &adsServer{
		sotw:  sotw.NewServer(ctx, u.cache, u.rec, sotw.WithOrderedADS()),
		delta: delta.NewServer(ctx, u.cache, u.rec),
	})
	lis := bufconn.Listen(1 << 20)
	done := make(chan struct{})
	u.rec.mu.Lock()
	u.rec.epoch++
	u.rec.mu.Unlock()
	u.mu.Lock()
	u.lis, u.srv, u.cancel, u.done = lis, srv, cancel, done
	u.mu.Unlock()
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
}

// stop stops the gRPC server and closes every stream.
func (u *upstream) stop() {
	u.mu.Lock()
	srv, cancel, done := u.srv, u.cancel, u.done
	u.lis, u.srv = nil, nil
	u.mu.Unlock()
	if srv == nil {
		return
	}
	cancel()
	srv.Stop()
	<-done
}

// newTestEnvoy starts a simulated Envoy on conn and stops it at cleanup.
func newTestEnvoy(t testing.TB, conn grpc.ClientConnInterface, p Protocol, edit func(*Config)) *Envoy {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Node = &core.Node{Id: testNodeID, Cluster: "app.ns"}
	cfg.Protocol = p
	cfg.Conn = conn
	cfg.Backoff = Backoff{Base: 5 * time.Millisecond, Max: 50 * time.Millisecond}
	if edit != nil {
		edit(&cfg)
	}
	e, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if err := e.Start(context.Background()); err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := e.Stop(ctx); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
	return e
}

// waitFor waits for cond with a deadline, failing the test with what.
func waitFor(t testing.TB, e *Envoy, what string, cond func(View) bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.WaitFor(ctx, cond); err != nil {
		t.Fatalf("waiting for %s: %v (stats %+v, violations %v)", what, err, e.Stats(), e.Violations())
	}
}

// synced reports whether v holds exactly w.
func synced(w world) func(View) bool {
	return func(v View) bool {
		if v.Len(ClusterType) != len(w.clusters) || v.Len(EndpointType) != len(w.clusters) ||
			v.Len(ListenerType) != len(w.lns) || v.Len(RouteType) != len(w.routes) {
			return false
		}
		for n := range w.clusters {
			if !v.Has(ClusterType, n) || !v.Has(EndpointType, n) {
				return false
			}
		}
		for n := range w.lns {
			if !v.Has(ListenerType, n) {
				return false
			}
		}
		for n := range w.routes {
			if !v.Has(RouteType, n) {
				return false
			}
		}
		return true
	}
}

func noViolations(t *testing.T, e *Envoy) {
	t.Helper()
	for _, v := range e.Violations() {
		t.Errorf("unexpected violation: %v", v)
	}
}
