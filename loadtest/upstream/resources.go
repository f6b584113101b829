package upstream

import (
	"fmt"
	"math"
	"net/netip"
	"strconv"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"github.com/envoyproxy/go-control-plane/pkg/wellknown"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// MetadataKey is the filter_metadata key under which every resource carries
// its generation, in a field named "generation":
//   - Cluster and Listener: metadata.filter_metadata[MetadataKey];
//   - RouteConfiguration: metadata.filter_metadata[MetadataKey] (the
//     RouteConfiguration.metadata field);
//   - ClusterLoadAssignment: each LocalityLbEndpoints' metadata holds the
//     generation of the whole assignment, each LbEndpoint's metadata the
//     generation at which that endpoint last changed (never larger).
const MetadataKey = "meshrelay.io/loadtest"

const generationField = "generation"

// Generation returns the generation a resource built by this package carries,
// and false if m carries none. m may be a *Cluster, *Listener,
// *RouteConfiguration, *ClusterLoadAssignment or an *anypb.Any holding one.
// For a ClusterLoadAssignment it is the largest generation found in its
// localities and endpoints. Generations of a resource name only grow, across
// every group and across Stop/Start, so a client can check that it never
// goes back to an older one. Safe for concurrent use.
func Generation(m proto.Message) (uint64, bool) {
	switch r := m.(type) {
	case *anypb.Any:
		inner, err := r.UnmarshalNew()
		if err != nil {
			return 0, false
		}
		return Generation(inner)
	case *clusterv3.Cluster:
		return markerGeneration(r.GetMetadata())
	case *listenerv3.Listener:
		return markerGeneration(r.GetMetadata())
	case *routev3.RouteConfiguration:
		return markerGeneration(r.GetMetadata())
	case *endpointv3.ClusterLoadAssignment:
		var max uint64
		found := false
		take := func(md *core.Metadata) {
			if g, ok := markerGeneration(md); ok {
				found = true
				if g > max {
					max = g
				}
			}
		}
		for _, loc := range r.GetEndpoints() {
			take(loc.GetMetadata())
			for _, lb := range loc.GetLbEndpoints() {
				take(lb.GetMetadata())
			}
		}
		return max, found
	}
	return 0, false
}

func markerGeneration(md *core.Metadata) (uint64, bool) {
	v, ok := md.GetFilterMetadata()[MetadataKey].GetFields()[generationField]
	if !ok {
		return 0, false
	}
	n, ok := v.GetKind().(*structpb.Value_NumberValue)
	if !ok || n.NumberValue < 0 || n.NumberValue != math.Trunc(n.NumberValue) {
		return 0, false
	}
	return uint64(n.NumberValue), true
}

// shared holds immutable proto pieces that every resource of an Upstream
// points to. Sharing them keeps a 30k-service build cheap; protos are never
// modified once published.
type shared struct {
	ads            *core.ConfigSource
	connectTimeout *durationpb.Duration
	zero           *durationpb.Duration
	breakers       *clusterv3.CircuitBreakers
	locality       *core.Locality
	weight1        *wrapperspb.UInt32Value
	prefixSlash    *routev3.RouteMatch
	retry          *routev3.RetryPolicy
	noValidate     *wrapperspb.BoolValue
	noBind         *wrapperspb.BoolValue
	router         *hcmv3.HttpFilter
}

func newShared() (*shared, error) {
	routerAny, err := anypb.New(&routerv3.Router{})
	if err != nil {
		return nil, fmt.Errorf("upstream: marshal router: %w", err)
	}
	max := wrapperspb.UInt32(math.MaxUint32)
	return &shared{
		ads: &core.ConfigSource{
			ConfigSourceSpecifier: &core.ConfigSource_Ads{Ads: &core.AggregatedConfigSource{}},
			ResourceApiVersion:    core.ApiVersion_V3,
		},
		connectTimeout: durationpb.New(10 * time.Second),
		zero:           durationpb.New(0),
		breakers: &clusterv3.CircuitBreakers{Thresholds: []*clusterv3.CircuitBreakers_Thresholds{{
			MaxConnections:     max,
			MaxPendingRequests: max,
			MaxRequests:        max,
			MaxRetries:         max,
			TrackRemaining:     true,
		}}},
		locality:    &core.Locality{Region: "region-1", Zone: "zone-1"},
		weight1:     wrapperspb.UInt32(1),
		prefixSlash: &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"}},
		retry: &routev3.RetryPolicy{
			RetryOn:                       "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
			NumRetries:                    wrapperspb.UInt32(2),
			HostSelectionRetryMaxAttempts: 5,
			RetriableStatusCodes:          []uint32{503},
		},
		noValidate: wrapperspb.Bool(false),
		noBind:     wrapperspb.Bool(false),
		router: &hcmv3.HttpFilter{
			Name:       wellknown.Router,
			ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: routerAny},
		},
	}, nil
}

// marker is the generation stamp of one mutation; its protos are shared by
// every resource the mutation touches.
type marker struct {
	gen  uint64
	mark *structpb.Struct
	meta *core.Metadata // FilterMetadata{MetadataKey: mark}
}

func newMarker(gen uint64) marker {
	mark := &structpb.Struct{Fields: map[string]*structpb.Value{
		generationField: structpb.NewNumberValue(float64(gen)),
	}}
	return marker{
		gen:  gen,
		mark: mark,
		meta: &core.Metadata{FilterMetadata: map[string]*structpb.Struct{MetadataKey: mark}},
	}
}

// serviceCluster builds the istiod-shaped outbound EDS cluster of a service.
func (sh *shared) serviceCluster(name, host, svcName, ns string, mk marker) *clusterv3.Cluster {
	str := structpb.NewStringValue
	istio := &structpb.Struct{Fields: map[string]*structpb.Value{
		"services": structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{
			structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
				"host":      str(host),
				"name":      str(svcName),
				"namespace": str(ns),
			}}),
		}}),
	}}
	return &clusterv3.Cluster{
		Name:                 name,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
		EdsClusterConfig:     &clusterv3.Cluster_EdsClusterConfig{EdsConfig: sh.ads, ServiceName: name},
		ConnectTimeout:       sh.connectTimeout,
		LbPolicy:             clusterv3.Cluster_LEAST_REQUEST,
		CircuitBreakers:      sh.breakers,
		Metadata: &core.Metadata{FilterMetadata: map[string]*structpb.Struct{
			"istio":     istio,
			MetadataKey: mk.mark,
		}},
	}
}

// grpcCluster builds a cluster grpc-go's xDS client accepts (EDS, ADS,
// ROUND_ROBIN).
func (sh *shared) grpcCluster(name string, mk marker) *clusterv3.Cluster {
	return &clusterv3.Cluster{
		Name:                 name,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
		EdsClusterConfig:     &clusterv3.Cluster_EdsClusterConfig{EdsConfig: sh.ads, ServiceName: name},
		ConnectTimeout:       sh.connectTimeout,
		LbPolicy:             clusterv3.Cluster_ROUND_ROBIN,
		Metadata:             mk.meta,
	}
}

// lbEndpoint builds one endpoint at ip:port stamped with mk.
func (sh *shared) lbEndpoint(ip string, port uint32, mk marker) *endpointv3.LbEndpoint {
	return &endpointv3.LbEndpoint{
		HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
			Address: socketAddress(ip, port),
		}},
		HealthStatus:        core.HealthStatus_HEALTHY,
		LoadBalancingWeight: sh.weight1,
		Metadata:            mk.meta,
	}
}

// cla builds a ClusterLoadAssignment with one locality holding lbs; the
// locality carries the assignment's generation. The locality weight is never
// zero (grpc-go ignores zero-weight localities).
func (sh *shared) cla(name string, lbs []*endpointv3.LbEndpoint, mk marker) *endpointv3.ClusterLoadAssignment {
	weight := sh.weight1
	if len(lbs) > 1 {
		weight = wrapperspb.UInt32(uint32(len(lbs)))
	}
	return &endpointv3.ClusterLoadAssignment{
		ClusterName: name,
		Endpoints: []*endpointv3.LocalityLbEndpoints{{
			Locality:            sh.locality,
			LbEndpoints:         lbs,
			LoadBalancingWeight: weight,
			Metadata:            mk.meta,
		}},
	}
}

// virtualHost builds the virtual host of a service: domains host and
// host:port, one default route to its cluster.
func (sh *shared) virtualHost(host string, port uint32, cluster string) *routev3.VirtualHost {
	hostPort := host + ":" + strconv.FormatUint(uint64(port), 10)
	return &routev3.VirtualHost{
		Name:    hostPort,
		Domains: []string{host, hostPort},
		Routes: []*routev3.Route{{
			Name:  "default",
			Match: sh.prefixSlash,
			Action: &routev3.Route_Route{Route: &routev3.RouteAction{
				ClusterSpecifier: &routev3.RouteAction_Cluster{Cluster: cluster},
				Timeout:          sh.zero,
				RetryPolicy:      sh.retry,
			}},
		}},
		IncludeRequestAttemptCount: true,
	}
}

// routeConfig builds a RouteConfiguration stamped with mk.
func (sh *shared) routeConfig(name string, vhosts []*routev3.VirtualHost, mk marker) *routev3.RouteConfiguration {
	return &routev3.RouteConfiguration{
		Name:             name,
		VirtualHosts:     vhosts,
		ValidateClusters: sh.noValidate,
		Metadata:         mk.meta,
	}
}

// grpcRouteConfig builds the RouteConfiguration grpc-go's xDS client accepts
// for target name: one virtual host whose domains include name, routing
// everything to cluster.
func (sh *shared) grpcRouteConfig(routeName, target, cluster string, mk marker) *routev3.RouteConfiguration {
	return &routev3.RouteConfiguration{
		Name: routeName,
		VirtualHosts: []*routev3.VirtualHost{{
			Name:    target,
			Domains: []string{target},
			Routes: []*routev3.Route{{
				Match: sh.prefixSlash,
				Action: &routev3.Route_Route{Route: &routev3.RouteAction{
					ClusterSpecifier: &routev3.RouteAction_Cluster{Cluster: cluster},
				}},
			}},
		}},
		Metadata: mk.meta,
	}
}

func (sh *shared) hcm(statPrefix, routeName string) *hcmv3.HttpConnectionManager {
	return &hcmv3.HttpConnectionManager{
		StatPrefix: statPrefix,
		RouteSpecifier: &hcmv3.HttpConnectionManager_Rds{Rds: &hcmv3.Rds{
			ConfigSource:    sh.ads,
			RouteConfigName: routeName,
		}},
		HttpFilters: []*hcmv3.HttpFilter{sh.router},
	}
}

// portListener builds the outbound listener "0.0.0.0_<port>": an HTTP
// connection manager using RDS route "<port>". Like Istio's outbound
// listeners it does not bind (traffic arrives through the virtual outbound
// listener), so a real Envoy accepts it without privileges.
func (sh *shared) portListener(port uint32, mk marker) (*listenerv3.Listener, error) {
	name := listenerName(port)
	hcm, err := anypb.New(sh.hcm("outbound_"+name, routeName(port)))
	if err != nil {
		return nil, fmt.Errorf("upstream: marshal listener %s: %w", name, err)
	}
	return &listenerv3.Listener{
		Name:    name,
		Address: socketAddress("0.0.0.0", port),
		FilterChains: []*listenerv3.FilterChain{{
			Filters: []*listenerv3.Filter{{
				Name:       wellknown.HTTPConnectionManager,
				ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: hcm},
			}},
		}},
		BindToPort:       sh.noBind,
		TrafficDirection: core.TrafficDirection_OUTBOUND,
		Metadata:         mk.meta,
	}, nil
}

// httpListener builds listener name, bound to at: an HTTP connection
// manager using RDS route routeName.
func (sh *shared) httpListener(name string, at hostPort, routeName string, mk marker) (*listenerv3.Listener, error) {
	hcm, err := anypb.New(sh.hcm(name, routeName))
	if err != nil {
		return nil, fmt.Errorf("upstream: marshal listener %s: %w", name, err)
	}
	return &listenerv3.Listener{
		Name:    name,
		Address: socketAddress(at.host, at.port),
		FilterChains: []*listenerv3.FilterChain{{
			Filters: []*listenerv3.Filter{{
				Name:       wellknown.HTTPConnectionManager,
				ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: hcm},
			}},
		}},
		Metadata: mk.meta,
	}, nil
}

// inboundListener builds the inbound listener of a pod of IP ip that
// serves port, InboundListenerName(ip): an HTTP connection manager whose
// route ("inbound|<port>||", inline, as istiod's inbound routes are)
// answers every request itself, so the listener needs no cluster or route
// of its own. Like portListener it does not bind.
func (sh *shared) inboundListener(ip string, port uint32, mk marker) (*listenerv3.Listener, error) {
	name := InboundListenerName(ip)
	p := strconv.FormatUint(uint64(port), 10)
	h := &hcmv3.HttpConnectionManager{
		StatPrefix: "inbound_" + ip + "_" + p,
		RouteSpecifier: &hcmv3.HttpConnectionManager_RouteConfig{RouteConfig: &routev3.RouteConfiguration{
			Name: "inbound|" + p + "||",
			VirtualHosts: []*routev3.VirtualHost{{
				Name:    "inbound|http|" + p,
				Domains: []string{"*"},
				Routes: []*routev3.Route{{
					Name:   "default",
					Match:  sh.prefixSlash,
					Action: &routev3.Route_DirectResponse{DirectResponse: &routev3.DirectResponseAction{Status: 200}},
				}},
			}},
		}},
		HttpFilters: []*hcmv3.HttpFilter{sh.router},
	}
	hcm, err := anypb.New(h)
	if err != nil {
		return nil, fmt.Errorf("upstream: marshal listener %s: %w", name, err)
	}
	return &listenerv3.Listener{
		Name:    name,
		Address: socketAddress(ip, port),
		FilterChains: []*listenerv3.FilterChain{{
			Filters: []*listenerv3.Filter{{
				Name:       wellknown.HTTPConnectionManager,
				ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: hcm},
			}},
		}},
		BindToPort:       sh.noBind,
		TrafficDirection: core.TrafficDirection_INBOUND,
		Metadata:         mk.meta,
	}, nil
}

// apiListener builds the API listener grpc-go's xds:/// resolver asks for:
// named exactly target, api_listener an HttpConnectionManager using RDS.
func (sh *shared) apiListener(target, routeName string, mk marker) (*listenerv3.Listener, error) {
	hcm, err := anypb.New(sh.hcm(target, routeName))
	if err != nil {
		return nil, fmt.Errorf("upstream: marshal api listener %s: %w", target, err)
	}
	return &listenerv3.Listener{
		Name:        target,
		ApiListener: &listenerv3.ApiListener{ApiListener: hcm},
		Metadata:    mk.meta,
	}, nil
}

func socketAddress(ip string, port uint32) *core.Address {
	return &core.Address{Address: &core.Address_SocketAddress{SocketAddress: &core.SocketAddress{
		Protocol:      core.SocketAddress_TCP,
		Address:       ip,
		PortSpecifier: &core.SocketAddress_PortValue{PortValue: port},
	}}}
}

func listenerName(port uint32) string { return "0.0.0.0_" + strconv.FormatUint(uint64(port), 10) }

func routeName(port uint32) string { return strconv.FormatUint(uint64(port), 10) }

// endpointIP maps an address counter to 10.0.0.1 … 10.127.255.255.
func endpointIP(n uint64) string {
	k := uint32(n%(1<<23-1)) + 1
	return netip.AddrFrom4([4]byte{10, byte(k >> 16), byte(k >> 8), byte(k)}).String()
}

// grpcNames returns the route, cluster (and ClusterLoadAssignment) names of a
// proxyless gRPC target.
func grpcNames(target string) (route, cluster string) {
	return "route-" + target, "cluster-" + target
}
