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
