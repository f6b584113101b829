package upstream_test

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

const hcmTypeURL = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"

// startBackend runs a gRPC server with the health service on 127.0.0.1:0.
func startBackend(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, health.NewServer())
	done := make(chan struct{})
	go func() {
		defer close(done)
		srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return lis.Addr().String()
}

// TestGRPCProxylessShape follows the references a grpc-go xds:/// client
// follows (LDS → RDS → CDS → EDS, all named, SotW, node without namespace),
// checks the rules grpc-go's xDS client applies to each resource, and calls
// the backend at the address the ClusterLoadAssignment gives.
func TestGRPCProxylessShape(t *testing.T) {
	const target = "greeter.test"
	backend := startBackend(t)
	sc := testScenario()
	sc.GRPCServices = []upstream.GRPCService{{Name: target, Backend: backend}}
	u := startUpstream(t, sc)
	c := newSotwClient(t, dial(t, u.Addr()), &core.Node{Id: "grpc-client-1", UserAgentName: "gRPC Go"})

	// LDS: an API listener named exactly target, HCM typed as grpc expects.
	l, ok := c.Subscribe(resource.ListenerType, []string{target}, true).Resources[target].(*listenerv3.Listener)
	if !ok {
		t.Fatalf("LDS %q: no listener", target)
	}
	if got := l.GetApiListener().GetApiListener().GetTypeUrl(); got != hcmTypeURL {
		t.Fatalf("api_listener type = %q, want %q", got, hcmTypeURL)
	}
	hcm, err := listenerHCM(l)
	if err != nil {
		t.Fatalf("listener %s: %v", target, err)
	}
	if hcm.GetXffNumTrustedHops() != 0 || len(hcm.GetOriginalIpDetectionExtensions()) != 0 {
		t.Errorf("HCM sets fields grpc rejects: %v", hcm)
	}
	if hcm.GetRds().GetConfigSource().GetAds() == nil {
		t.Errorf("RDS config source = %v, want ADS", hcm.GetRds().GetConfigSource())
	}
	filters := hcm.GetHttpFilters()
	if len(filters) == 0 || !filters[len(filters)-1].GetTypedConfig().MessageIs(&routerv3.Router{}) {
		t.Fatalf("http filters = %v, want the router last", filters)
	}
	routeName := hcm.GetRds().GetRouteConfigName()
	if routeName != "route-"+target {
		t.Errorf("route_config_name = %q, want %q", routeName, "route-"+target)
	}

	// RDS: a virtual host whose domains include target.
	rc, ok := c.Subscribe(resource.RouteType, []string{routeName}, true).Resources[routeName].(*routev3.RouteConfiguration)
	if !ok {
		t.Fatalf("RDS %q: no route configuration", routeName)
	}
	var clusterName string
	for _, vh := range rc.GetVirtualHosts() {
		if slices.Contains(vh.GetDomains(), target) {
			r := vh.GetRoutes()
			if len(r) == 0 || r[len(r)-1].GetMatch().GetPrefix() != "/" {
				t.Fatalf("virtual host %s routes = %v, want a last route matching prefix /", vh.GetName(), r)
			}
			clusterName = r[len(r)-1].GetRoute().GetCluster()
		}
	}
	if clusterName != "cluster-"+target {
		t.Fatalf("route cluster = %q, want %q", clusterName, "cluster-"+target)
	}

	// CDS: EDS over ADS, round robin.
	cl, ok := c.Subscribe(resource.ClusterType, []string{clusterName}, true).Resources[clusterName].(*clusterv3.Cluster)
	if !ok {
		t.Fatalf("CDS %q: no cluster", clusterName)
	}
	if cl.GetType() != clusterv3.Cluster_EDS || cl.GetEdsClusterConfig().GetEdsConfig().GetAds() == nil || cl.GetLbPolicy() != clusterv3.Cluster_ROUND_ROBIN {
		t.Fatalf("cluster %s = type %v, eds %v, lb %v; want EDS over ADS, ROUND_ROBIN", clusterName, cl.GetType(), cl.GetEdsClusterConfig(), cl.GetLbPolicy())
	}
	edsName := cl.GetEdsClusterConfig().GetServiceName()

	// EDS: a locality with a non-zero weight holding the backend.
	cla, ok := c.Subscribe(resource.EndpointType, []string{edsName}, true).Resources[edsName].(*endpointv3.ClusterLoadAssignment)
	if !ok {
		t.Fatalf("EDS %q: no load assignment", edsName)
	}
	var addrs []string
	for _, loc := range cla.GetEndpoints() {
		if loc.GetLocality() == nil || loc.GetLoadBalancingWeight().GetValue() == 0 {
			t.Fatalf("locality %v weight %v: grpc drops it", loc.GetLocality(), loc.GetLoadBalancingWeight())
		}
		for _, lb := range loc.GetLbEndpoints() {
			sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
			addrs = append(addrs, netip.AddrPortFrom(netip.MustParseAddr(sa.GetAddress()), uint16(sa.GetPortValue())).String())
		}
	}
	if !slices.Equal(addrs, []string{backend}) {
		t.Fatalf("endpoints = %v, want [%s]", addrs, backend)
	}

	// The address works.
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	resp, err := healthpb.NewHealthClient(dial(t, addrs[0])).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check(%s) = %v, %v, want SERVING", addrs[0], resp, err)
	}

	// Every group gets the gRPC target.
	for _, g := range u.Groups() {
		snap := u.Snapshot(g)
		for typeURL, name := range map[string]string{
			resource.ListenerType: target, resource.RouteType: routeName,
			resource.ClusterType: clusterName, resource.EndpointType: edsName,
		} {
			if snap[typeURL][name] == nil {
				t.Errorf("Snapshot(%s) has no %s %s", g, typeURL, name)
			}
		}
	}
}
