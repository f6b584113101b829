package relay

import (
	"slices"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
)

// Type URLs the relay caches, aggregates and serves itself. Every other type
// URL passes through to the upstream on the requesting stream's own upstream
// stream (see passthrough.go).
const (
	typeCluster     = resource.ClusterType
	typeEndpoint    = resource.EndpointType
	typeListener    = resource.ListenerType
	typeRoute       = resource.RouteType
	typeScopedRoute = resource.ScopedRouteType
	typeSecret      = resource.SecretType
	typeRuntime     = resource.RuntimeType
	typeExtension   = resource.ExtensionConfigType
)

// pushOrder is the order in which a stream sends updates of several types at
// once: make-before-break, so that a cluster exists before its endpoints, and
// both before a listener or route refers to them.
var pushOrder = []string{typeCluster, typeEndpoint, typeListener, typeScopedRoute, typeRoute, typeSecret, typeRuntime, typeExtension}

// removalOrder is the order in which removals go out, after every update:
// referrers first (listeners, routes), then what they referred to.
var removalOrder = []string{typeListener, typeScopedRoute, typeRoute, typeCluster, typeEndpoint, typeSecret, typeRuntime, typeExtension}

// typeRef is one edge of the graph of which type refers to which: resources
// of from name resources of to (kind says which of their references).
// Everything that follows references reads this one table: hasRefs (which
// types are parsed for references), stream.heldBy (what a removal would
// break), stream.awaitingDeclarations (the referrers a client must declare
// before a removal is sent), upstream.follow and followRestored (the
// names fetched before any Envoy asks for them).
type typeRef struct {
	from, to string
	kind     refKind
	// fetched: the relay asks its source for the names as soon as a view
	// of from refers to them, as Envoy would ask next (EDS for clusters,
	// RDS for listeners).
	fetched bool
	// declared: a client that holds resources of to is expected to
	// subscribe to from when its stream starts (Envoy's first requests),
	// so removals of to wait a moment for it (declareGrace). Scoped
	// routes are optional: most clients never ask for them.
	declared bool
}

var typeRefs = []typeRef{
	{from: typeCluster, to: typeEndpoint, kind: refEndpoints, fetched: true, declared: true}, // eds_cluster_config
	{from: typeListener, to: typeRoute, kind: refRoutes, fetched: true, declared: true},      // rds route_config_name
	{from: typeScopedRoute, to: typeRoute, kind: refRoutes, fetched: true},                   // scoped route_configuration_name
	{from: typeListener, to: typeCluster, kind: refClusters, declared: true},                 // tcp_proxy and other filters' clusters
	{from: typeRoute, to: typeCluster, kind: refClusters, declared: true},                    // route actions' clusters
}

// refsTo returns the edges into typeURL (who refers to its resources).
func refsTo(typeURL string) []typeRef {
	var out []typeRef
	for _, e := range typeRefs {
		if e.to == typeURL {
			out = append(out, e)
		}
	}
	return out
}

// refsFrom returns the edges out of typeURL (what its resources refer to).
func refsFrom(typeURL string) []typeRef {
	var out []typeRef
	for _, e := range typeRefs {
		if e.from == typeURL {
			out = append(out, e)
		}
	}
	return out
}

// cached reports whether the relay serves typeURL from its own cache.
func cached(typeURL string) bool { return slices.Contains(pushOrder, typeURL) }

// fullStateSotW reports whether a SotW response of typeURL must carry every
// subscribed resource (absence means removal). For every other type a SotW
// response may carry only what changed, and a real istiod sends just that
// (XDS-NOTES: "SotW EDS and RDS responses may carry only the resources that
// changed").
func fullStateSotW(typeURL string) bool { return typeURL == typeCluster || typeURL == typeListener }

// legacyWildcard reports whether an empty first subscription to typeURL means
// "everything" (the legacy wildcard of the xDS protocol).
func legacyWildcard(typeURL string) bool { return typeURL == typeCluster || typeURL == typeListener }

// shortType names a type URL in logs and metrics labels.
func shortType(typeURL string) string {
	switch typeURL {
	case typeCluster:
		return "cds"
	case typeEndpoint:
		return "eds"
	case typeListener:
		return "lds"
	case typeRoute:
		return "rds"
	case typeScopedRoute:
		return "srds"
	case typeSecret:
		return "sds"
	case typeRuntime:
		return "rtds"
	case typeExtension:
		return "ecds"
	}
	return "other"
}

// fetchedTarget is a type whose names the relay fetches ahead (typeRef
// fetched), with the types whose resources name them.
type fetchedTarget struct {
	target  string
	kind    refKind
	sources []string
}

// fetchedTargets groups the fetched edges of typeRefs by target, in the
// table's order.
func fetchedTargets() []fetchedTarget {
	var out []fetchedTarget
	for _, e := range typeRefs {
		if !e.fetched {
			continue
		}
		i := slices.IndexFunc(out, func(t fetchedTarget) bool { return t.target == e.to })
		if i < 0 {
			out = append(out, fetchedTarget{target: e.to, kind: e.kind})
			i = len(out) - 1
		}
		out[i].sources = append(out[i].sources, e.from)
	}
	return out
}
