package xds

import (
	"slices"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
)

// Type URLs the relay caches, aggregates and serves itself. Every other type
// URL passes through to the upstream on the requesting stream's own upstream
// stream (see the relay's passthrough.go).
const (
	TypeCluster     = resource.ClusterType
	TypeEndpoint    = resource.EndpointType
	TypeListener    = resource.ListenerType
	TypeRoute       = resource.RouteType
	TypeScopedRoute = resource.ScopedRouteType
	TypeSecret      = resource.SecretType
	TypeRuntime     = resource.RuntimeType
	TypeExtension   = resource.ExtensionConfigType
	// TypeNameTable is Istio's NDS: pilot-agent's DNS proxy asks for the
	// names its workload resolves (ISTIO_META_DNS_CAPTURE) on the ADS
	// stream it proxies. istiod builds it from what the node's key holds
	// (its Sidecar scope, cluster, network, IP families, DNS settings), so
	// a key's members share it. One unnamed resource (Singleton).
	TypeNameTable = "type.googleapis.com/istio.networking.nds.v1.NameTable"
	// TypeProxyConfig is Istio's PCDS: pilot-agent asks for it
	// (PROXY_CONFIG_XDS_AGENT) to learn the mesh's trust bundle. istiod
	// builds it from mesh-wide state alone (the trust bundle), and only
	// with MULTI_ROOT_MESH: otherwise it never answers (Silent). One
	// unnamed resource (Singleton).
	TypeProxyConfig = "type.googleapis.com/istio.mesh.v1alpha1.ProxyConfig"
)

// PushOrder is the order in which a stream sends updates of several types at
// once: make-before-break, so that a cluster exists before its endpoints, and
// both before a listener or route refers to them. Read it, never modify it.
var PushOrder = []string{TypeCluster, TypeEndpoint, TypeListener, TypeScopedRoute, TypeRoute, TypeSecret, TypeRuntime, TypeExtension, TypeNameTable, TypeProxyConfig}

// RemovalOrder is the order in which removals go out, after every update:
// referrers first (listeners, routes), then what they referred to. Read
// it, never modify it.
var RemovalOrder = []string{TypeListener, TypeScopedRoute, TypeRoute, TypeCluster, TypeEndpoint, TypeSecret, TypeRuntime, TypeExtension, TypeNameTable, TypeProxyConfig}

// TypeRef is one edge of the graph of which type refers to which: resources
// of From name resources of To (Kind says which of their references).
// Everything that follows references reads this one table: hasRefs (which
// types are parsed for references) and, in the relay, stream.heldBy (what a
// removal would break), stream.awaitingDeclarations (the referrers a
// client must declare before a removal is sent), feed.follow and
// followRestored (the names fetched before any Envoy asks for them).
type TypeRef struct {
	From, To string
	Kind     RefKind
	// Fetched: the relay asks its source for the names as soon as a view
	// of From refers to them, as Envoy would ask next (EDS for clusters,
	// RDS for listeners).
	Fetched bool
	// Declared: a client that holds resources of To is expected to
	// subscribe to From when its stream starts (Envoy's first requests),
	// so removals of To wait for it until the client has answered a
	// response (the relay's awaitingDeclarations). Scoped
	// routes are optional: most clients never ask for them.
	Declared bool
}

// TypeRefs is the graph, one edge per way a type's resources name
// another's. Read it, never modify it.
var TypeRefs = []TypeRef{
	{From: TypeCluster, To: TypeEndpoint, Kind: RefEndpoints, Fetched: true, Declared: true}, // eds_cluster_config
	{From: TypeListener, To: TypeRoute, Kind: RefRoutes, Fetched: true, Declared: true},      // rds route_config_name
	{From: TypeScopedRoute, To: TypeRoute, Kind: RefRoutes, Fetched: true},                   // scoped route_configuration_name
	{From: TypeListener, To: TypeCluster, Kind: RefClusters, Declared: true},                 // tcp_proxy and other filters' clusters
	{From: TypeRoute, To: TypeCluster, Kind: RefClusters, Declared: true},                    // route actions' clusters
}

// RefsTo returns the edges into typeURL (who refers to its resources).
func RefsTo(typeURL string) []TypeRef {
	var out []TypeRef
	for _, e := range TypeRefs {
		if e.To == typeURL {
			out = append(out, e)
		}
	}
	return out
}

// RefsFrom returns the edges out of typeURL (what its resources refer to).
func RefsFrom(typeURL string) []TypeRef {
	var out []TypeRef
	for _, e := range TypeRefs {
		if e.From == typeURL {
			out = append(out, e)
		}
	}
	return out
}

// Cached reports whether the relay serves typeURL from its own cache.
func Cached(typeURL string) bool { return slices.Contains(PushOrder, typeURL) }

// FullStateSotW reports whether a SotW response of typeURL must carry every
// subscribed resource (absence means removal). For every other type a SotW
// response may carry only what changed, and a real istiod sends just that
// (XDS-NOTES: "SotW EDS and RDS responses may carry only the resources that
// changed").
func FullStateSotW(typeURL string) bool {
	return typeURL == TypeCluster || typeURL == TypeListener || Singleton(typeURL)
}

// LegacyWildcard reports whether an empty first subscription to typeURL means
// "everything" (the legacy wildcard of the xDS protocol).
func LegacyWildcard(typeURL string) bool {
	return typeURL == TypeCluster || typeURL == TypeListener || Singleton(typeURL)
}

// Singleton reports whether a response of typeURL carries one resource
// that names nothing (Istio's NDS and PCDS): istiod sends it unnamed, its
// clients take the first resource of a response and ask for the type
// without names. The relay keeps it under SingletonName.
func Singleton(typeURL string) bool { return typeURL == TypeNameTable || typeURL == TypeProxyConfig }

// Silent reports whether an upstream may rightly never answer a
// subscription to typeURL: istiod answers PCDS only with MULTI_ROOT_MESH.
// Waiting for such a type's answer would keep a key's views from ever
// being confirmed.
func Silent(typeURL string) bool { return typeURL == TypeProxyConfig }

// SingletonName is the name a Singleton type's one resource has in the
// relay's views and in its Delta responses (clients ignore it).
const SingletonName = "singleton"

// ShortType names a type URL in logs and metrics labels.
func ShortType(typeURL string) string {
	switch typeURL {
	case TypeCluster:
		return "cds"
	case TypeEndpoint:
		return "eds"
	case TypeListener:
		return "lds"
	case TypeRoute:
		return "rds"
	case TypeScopedRoute:
		return "srds"
	case TypeSecret:
		return "sds"
	case TypeRuntime:
		return "rtds"
	case TypeExtension:
		return "ecds"
	case TypeNameTable:
		return "nds"
	case TypeProxyConfig:
		return "pcds"
	}
	return "other"
}

// FetchedTarget is a type whose names the relay fetches ahead (TypeRef
// fetched), with the types whose resources name them.
type FetchedTarget struct {
	Target  string
	Kind    RefKind
	Sources []string
}

// FetchedTargets groups the fetched edges of TypeRefs by target, in the
// table's order.
func FetchedTargets() []FetchedTarget {
	var out []FetchedTarget
	for _, e := range TypeRefs {
		if !e.Fetched {
			continue
		}
		i := slices.IndexFunc(out, func(t FetchedTarget) bool { return t.Target == e.To })
		if i < 0 {
			out = append(out, FetchedTarget{Target: e.To, Kind: e.Kind})
			i = len(out) - 1
		}
		out[i].Sources = append(out[i].Sources, e.From)
	}
	return out
}
