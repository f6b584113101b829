package xds

import (
	"fmt"
	"runtime"
	"slices"
	"testing"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	route "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcm "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tcpproxy "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
)

// TestDroppedKeepsNewestWithinBudget: the store holds a resource only
// while something refers to it; dropped keeps the newest dropped ones
// alive within its byte budget, and lets the oldest go.
func TestDroppedKeepsNewestWithinBudget(t *testing.T) {
	s := NewStore()
	d := NewDropped(3 * 100)
	var hashes []ledger.Hash
	for i := range 5 {
		body := make([]byte, 100)
		copy(body, fmt.Sprint("resource ", i))
		r := s.Intern(&Resource{Type: TypeCluster, Name: fmt.Sprint("c", i), Hash: ContentHash(TypeCluster, body),
			Body: &anypb.Any{TypeUrl: TypeCluster, Value: body}})
		hashes = append(hashes, r.Hash)
		d.Keep([]*Resource{r, nil}) // a nil (no body) is skipped
	}
	if n, b := d.Held(); n != 3 || b != 300 {
		t.Fatalf("held %d resources, %d bytes; want 3, 300", n, b)
	}
	runtime.GC()
	runtime.GC()
	for i, h := range hashes {
		if alive, want := s.Lookup(h) != nil, i >= 2; alive != want {
			t.Errorf("resource %d alive = %v, want %v (the newest 3 kept, the others collected)", i, alive, want)
		}
	}
	runtime.KeepAlive(d)
	var none Dropped // a zero budget keeps nothing
	none.Keep([]*Resource{{Body: &anypb.Any{Value: []byte("x")}}})
	if n, _ := none.Held(); n != 0 {
		t.Errorf("a zero budget kept %d", n)
	}
}

// Every reference refsOf reads from a type is an edge of TypeRefs, and
// every edge of TypeRefs is read from some resource: the table is the
// whole graph.
func TestTypeRefsAreTheGraph(t *testing.T) {
	routeOnly := &route.ScopedRouteConfiguration{Name: "scope", RouteConfigurationName: "r80"}
	seen := map[TypeRef]bool{}
	for _, m := range []proto.Message{mkCluster("c1"), mkListener("l80", "r80"), mkTCPListener("l9000", "c1"), mkRoute("r80", "c1"), routeOnly} {
		typeURL := typeOfMessage(t, m)
		r := refsOf(m)
		for _, kind := range []RefKind{RefEndpoints, RefRoutes, RefClusters} {
			if len(r.of(kind)) == 0 {
				continue
			}
			i := slices.IndexFunc(TypeRefs, func(e TypeRef) bool { return e.From == typeURL && e.Kind == kind })
			if i < 0 {
				t.Fatalf("%s refers by kind %d to %v, and TypeRefs has no such edge", ShortType(typeURL), kind, r.of(kind))
			}
			seen[TypeRefs[i]] = true
		}
	}
	for _, e := range TypeRefs {
		if !seen[e] {
			t.Errorf("edge %s → %s of TypeRefs is read from no resource", ShortType(e.From), ShortType(e.To))
		}
	}
	if got := FetchedTargets(); len(got) != 2 || got[0].Target != TypeEndpoint || got[1].Target != TypeRoute ||
		!slices.Equal(got[1].Sources, []string{TypeListener, TypeScopedRoute}) {
		t.Errorf("fetchedTargets() = %+v, want endpoints (from clusters) and routes (from listeners and scoped routes)", got)
	}
}

func typeOfMessage(t *testing.T, m proto.Message) string {
	t.Helper()
	a, err := anypb.New(m)
	if err != nil {
		t.Fatal(err)
	}
	return a.GetTypeUrl()
}

// mkCluster is an EDS cluster (its endpoints are ClusterLoadAssignment name).
func mkCluster(name string) *cluster.Cluster {
	return &cluster.Cluster{Name: name, ClusterDiscoveryType: &cluster.Cluster_Type{Type: cluster.Cluster_EDS}}
}

// mkCLA is the endpoints of cluster name, one on each port.
func mkCLA(name string, ports ...uint32) *endpoint.ClusterLoadAssignment {
	var lbs []*endpoint.LbEndpoint
	for _, p := range ports {
		lbs = append(lbs, &endpoint.LbEndpoint{HostIdentifier: &endpoint.LbEndpoint_Endpoint{Endpoint: &endpoint.Endpoint{
			Address: &core.Address{Address: &core.Address_SocketAddress{SocketAddress: &core.SocketAddress{
				Address: "10.1.0.1", PortSpecifier: &core.SocketAddress_PortValue{PortValue: p}}}}}}})
	}
	return &endpoint.ClusterLoadAssignment{ClusterName: name, Endpoints: []*endpoint.LocalityLbEndpoints{{LbEndpoints: lbs}}}
}

// mkListener is a listener whose HTTP connection manager takes its routes
// from RDS routeName.
func mkListener(name, routeName string) *listener.Listener {
	return &listener.Listener{Name: name, FilterChains: []*listener.FilterChain{{Filters: []*listener.Filter{filter(&hcm.HttpConnectionManager{
		RouteSpecifier: &hcm.HttpConnectionManager_Rds{Rds: &hcm.Rds{RouteConfigName: routeName}}})}}}}
}

// mkRoute is a route configuration with a virtual host for each cluster.
func mkRoute(name string, clusters ...string) *route.RouteConfiguration {
	rc := &route.RouteConfiguration{Name: name}
	for _, c := range clusters {
		rc.VirtualHosts = append(rc.VirtualHosts, &route.VirtualHost{Name: c, Domains: []string{c}, Routes: []*route.Route{{
			Action: &route.Route_Route{Route: &route.RouteAction{ClusterSpecifier: &route.RouteAction_Cluster{Cluster: c}}}}}})
	}
	return rc
}

// mkTCPListener is a listener whose tcp_proxy sends to cluster c.
func mkTCPListener(name, c string) *listener.Listener {
	return &listener.Listener{Name: name, FilterChains: []*listener.FilterChain{{Filters: []*listener.Filter{
		filter(&tcpproxy.TcpProxy{StatPrefix: name, ClusterSpecifier: &tcpproxy.TcpProxy_Cluster{Cluster: c}})}}}}
}

// filter is a network filter of config m.
func filter(m proto.Message) *listener.Filter {
	a, err := anypb.New(m)
	if err != nil {
		panic(err)
	}
	return &listener.Filter{Name: string(m.ProtoReflect().Descriptor().FullName()), ConfigType: &listener.Filter_TypedConfig{TypedConfig: a}}
}
