package relay

// The configuration of the keys' feeds (Config.Upstream) and of the keys
// themselves (Config.Keys), and the tier's Owners that a feed asks for its
// key's source: what the key layer (keycache.go) is configured by.

import (
	"fmt"
	"time"

	"google.golang.org/grpc"

	"github.com/meshrelay/meshrelay/relay/aggkey"
)

// Protocol is an ADS protocol variant.
type Protocol string

// The two ADS variants.
const (
	ProtocolSotW  Protocol = "sotw"
	ProtocolDelta Protocol = "delta"
)

// ParseProtocol parses a --upstream-protocol flag value.
func ParseProtocol(s string) (Protocol, error) {
	switch Protocol(s) {
	case ProtocolSotW, ProtocolDelta:
		return Protocol(s), nil
	}
	return "", fmt.Errorf("relay: unknown protocol %q (want sotw or delta)", s)
}

// UpstreamConfig configures each key's stream to the upstream control
// plane (istiod).
type UpstreamConfig struct {
	// Addr is the gRPC target of the upstream control plane (istiod),
	// e.g. "istiod.istio-system.svc:15010". Required.
	Addr string
	// DialOptions are added to the upstream connection's options
	// (credentials, a bufconn dialer, …). Default: plaintext.
	DialOptions []grpc.DialOption
	// Protocol is the ADS variant spoken to the upstream. Default delta.
	// Envoys may use either variant whatever this is.
	Protocol Protocol
	// Syncs bounds the keys whose stream to their source (the upstream, or
	// the key's owner) is open and has not answered every type yet; a key
	// waits for one of them to finish before it opens its stream. A first
	// answer is the key's whole config (16 MB of clusters at 30,000
	// services), held while it is decoded: a relay starting cold with a
	// hundred keys, or a tier whose istiod restarted, would otherwise
	// receive and hold them all at once, and istiod compute them all at
	// once (at 30,000 services, 16 keys' first answers in flight were 600
	// MB of a cold relay's heap). A stream holds its slot 30 s at most.
	// Streams to keys' owners (other relays) are bounded apart, by as many
	// slots again: an owner's answer waits on its own upstream stream,
	// which must not wait behind them. Default 4; 0: no bound.
	Syncs int
	// StreamRate bounds the streams this relay opens to the upstream per
	// second (a token bucket holding one second's worth, at least one),
	// whatever their key: a cold relay of a thousand per-node keys, or
	// every key after istiod restarts, reaches istiod at this pace rather
	// than as the storm the tier exists to spare it. Streams of the types
	// the relay passes through per client (passthrough.go) take at most a
	// fifth of the pace, so that no client can hold back the keys'
	// streams. Streams to keys' owners (other relays) are not counted.
	// Default 50; 0: no bound.
	StreamRate float64
	// ForwardCredentials makes each key's upstream stream present, as
	// "authorization: Bearer", the service-account token of the member
	// whose node it presents (--upstream-auth forward): members of a key
	// share namespace and service account, so istiod's own identity check
	// passes unchanged. The token is one the XDS.Authenticator verified on
	// the TLS port (Authenticator.Token: members that send a certificate
	// alone have none to give, and are presented only when no member has),
	// or, on a stream from another relay, the one that relay presents;
	// tokens stay in memory, are never logged and never persisted. The
	// upstream stream moves to another member's node and token when its
	// member leaves, or TokenRefreshBefore ahead of its token's expiry if
	// another member's token lives longer. The move is make-before-break
	// for Envoys, not for istiod: the key's views stay and keep being
	// served, and the new stream declares what they hold, so nothing is
	// sent again; the old stream closes as the new one opens (one stream
	// per key, as istiod counts). A token the upstream refuses
	// (Unauthenticated, PermissionDenied: revoked, its pod deleted) is not
	// presented again: the next stream presents another member's. Needs
	// an XDS.Authenticator and, in a tier, Tier.TLS (tokens cross between
	// relays). DialOptions should carry TLS. Default false.
	ForwardCredentials bool
	// TokenRefreshBefore: see ForwardCredentials. Also, an Envoy whose
	// token comes within half of it of its expiry is asked to reconnect
	// (its connection is closed), so that the key always has a token
	// istiod takes when its stream must be opened again. Default 5m.
	TokenRefreshBefore time.Duration
	// BackoffInitial and BackoffMax bound the jittered exponential backoff
	// of upstream reconnects. Defaults 250ms and 30s.
	BackoffInitial time.Duration
	BackoffMax     time.Duration
}

// DefaultUpstreamConfig returns the upstream streams' defaults; Addr has
// none.
func DefaultUpstreamConfig() UpstreamConfig {
	return UpstreamConfig{
		Protocol:           ProtocolDelta,
		Syncs:              4,
		StreamRate:         50,
		TokenRefreshBefore: 5 * time.Minute,
		BackoffInitial:     250 * time.Millisecond,
		BackoffMax:         30 * time.Second,
	}
}

// KeysConfig configures aggregation keys and each key's cache.
type KeysConfig struct {
	// Profile derives aggregation keys. Default aggkey.Istio{}.
	Profile aggkey.Profile
	// IdleTimeout is how long a key with no connected Envoy keeps its
	// upstream stream and cache, so that reconnecting Envoys find it warm.
	// Default 2m.
	IdleTimeout time.Duration
	// KeepDroppedBytes is how many bytes of the resources the views dropped
	// most recently (removed or replaced) the relay keeps, so that a SotW
	// Envoy that moved between relays and holds a version a few changes
	// old can be told what it holds, and keep the clusters its routes
	// still use until the routes change. Default 32 MiB; 0 keeps none.
	KeepDroppedBytes int64
	// DivergenceInterval is how often the relay checks each aggregated key
	// it is the upstream source of: a second upstream stream presents
	// another member's node, and if its config differs from the key's, the
	// key splits (see package divergence). Its owner also checks a key as
	// soon as it gets its second member. One check per key at a time, two
	// per relay, at the pace of Upstream.StreamRate. Default 10 min; zero:
	// never.
	DivergenceInterval time.Duration
	// AggregationWarnInterval is how often the relay checks whether most
	// of its keys serve one Envoy each (at least MinLoneKeysToWarn of
	// them), and warns if so: the key profile does not group this fleet's
	// nodes, and every Envoy costs a source of its own. The first check is
	// a minute after start, or sooner if the interval is shorter. Default
	// 5 min; zero: never.
	AggregationWarnInterval time.Duration
	// Snapshots, if set, persists the views of the keys this relay owns and
	// loads every persisted key at Start: the relay serves them at once,
	// stale until a source confirms them (warm start). Default nil: no
	// persistence; the relay starts cold. The caller stops it after the
	// relay.
	Snapshots Snapshots
}

// DefaultKeysConfig returns the keys' defaults: Istio's profile, no
// persistence.
func DefaultKeysConfig() KeysConfig {
	return KeysConfig{
		Profile:                 aggkey.Istio{},
		IdleTimeout:             2 * time.Minute,
		KeepDroppedBytes:        32 << 20,
		DivergenceInterval:      10 * time.Minute,
		AggregationWarnInterval: 5 * time.Minute,
	}
}

// Owners says which relay of the tier owns each aggregation key: the one
// that holds the key's upstream stream. shard.Ring implements it.
// Implementations must be safe for concurrent use.
type Owners interface {
	// Owner returns the xDS address of key's owner, and whether that is
	// this relay.
	Owner(key string) (addr string, self bool)
	// Changed is signalled when owners may have moved. The relay is its
	// only consumer.
	Changed() <-chan struct{}
}
