package relay

// What configures the downstream ADS server (Config.XDS), who may use it
// (Authorizer, Authenticator), and the ports it serves.

import (
	"context"
	"crypto/tls"
	"net"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc"

	"github.com/meshrelay/meshrelay/relay/auth"
)

// Authorizer decides whether a stream may be served, before anything is
// served on it. It sees the node of the stream's first request and, through
// ctx, the peer (grpc/peer.FromContext: address and TLS state).
// Implementations must be safe for concurrent use.
type Authorizer interface {
	Authorize(ctx context.Context, node *core.Node) error
}

// AllowAll authorizes every stream. It is right only where the network
// itself is trusted (plaintext mode, like istiod's port 15010).
type AllowAll struct{}

// Authorize implements Authorizer.
func (AllowAll) Authorize(context.Context, *core.Node) error { return nil }

// Authenticator proves the workload identity of a stream on the TLS xDS
// port from its TLS state and metadata (grpc/peer and grpc/metadata in
// ctx), before anything is read from it. *auth.Authenticator is the one
// the serve command wires. Errors should be *auth.Error (their Reason
// labels meshrelay_xds_auth_failures_total); their text reaches the
// client, so it must not hold the credential. Token returns the bearer
// token of a stream that proves the identity Authenticate gave it, with
// its expiry (zero if unknown), or ok false: in forward mode it is what the
// key's upstream stream presents for the stream's workload, whether the
// workload was proven by that token or by a certificate beside it.
// Implementations must be safe for concurrent use.
type Authenticator interface {
	Authenticate(ctx context.Context) (auth.Identity, error)
	Token(ctx context.Context, id auth.Identity) (token string, expires time.Time, ok bool)
}

var _ Authenticator = (*auth.Authenticator)(nil)

// XDSConfig configures the downstream ADS server: its ports, who may use
// them, and how streams are admitted and served.
type XDSConfig struct {
	// Listen is the address of the plaintext ADS server for Envoys, the
	// tier's other relays and trusted networks: it authenticates no one
	// (istiod's port 15010). Default ":15010"; empty: none (TLS must then
	// be set). Ignored if Listener is set.
	Listen string
	// Listener, if set, is used instead of listening on Listen (tests pass
	// a bufconn or a loopback listener here). Stop closes it.
	Listener net.Listener

	// TLS, if set, opens the TLS ADS server (istiod's port 15012) on
	// TLSListen (or TLSListener) with this config (tlsfiles.ServerConfig
	// reads rotated certificate files at each handshake). Its ALPN is h2
	// whatever NextProtos says. To verify client certificates in the
	// Authenticator, where a failure is counted and named, ask for them
	// with ClientAuth tls.RequestClientCert. Default nil: no TLS port.
	TLS *tls.Config
	// TLSListen is the TLS ADS server's address. Default ":15012".
	TLSListen string
	// TLSListener, if set, is used instead of listening on TLSListen.
	TLSListener net.Listener
	// Authenticator, if set, proves the identity of every Envoy stream on
	// the TLS port before anything is served; the node the stream
	// presents must then pass istiod's rule (auth.CheckNode: namespace
	// and service account), or the stream is refused with
	// PermissionDenied, and the identity becomes part of the node's key.
	// Default nil: the TLS port serves anyone (--xds-auth=none).
	Authenticator Authenticator
	// HandshakeTimeout bounds a TLS handshake: a client that never
	// finishes one is dropped. Default 10s.
	HandshakeTimeout time.Duration
	// MaxStreamsPerConnection bounds the streams one client connection
	// may have open at once on the xDS ports (HTTP/2
	// SETTINGS_MAX_CONCURRENT_STREAMS): an Envoy opens one, pilot-agent a
	// few; with it set, grpc-go also ends a connection that resets streams
	// faster than it may open them (HTTP/2 rapid reset, CVE-2023-44487).
	// The peer port allows one per key. Default 100.
	MaxStreamsPerConnection uint32
	// MaxConnectionAge ends a client connection on the xDS ports after
	// about this long (±10 %, GOAWAY), as istiod does after 30 minutes:
	// its client reconnects through the Service, so a scaled-up tier
	// takes its share and a credential is proven again. Zero: never.
	// Default 30m.
	MaxConnectionAge time.Duration
	// MaxConnectionAgeGrace is how long a connection's streams may go on
	// after MaxConnectionAge before it is closed. Default 10s.
	MaxConnectionAgeGrace time.Duration
	// Authorizer checks every stream first. Default AllowAll{}.
	Authorizer Authorizer

	// MaxSubscribedNames bounds the names one stream may subscribe to, or
	// declare, for one type. Default 250,000: a 30,000-service mesh's
	// Envoy subscribes to 30,000 endpoint names per port its services
	// have.
	MaxSubscribedNames int
	// MaxRequestBytes bounds one request an Envoy sends on the xDS ports
	// (gRPC's receive limit): the largest a real one sends is a Delta
	// reconnect's initial_resource_versions, 4.65 MB for a mesh of
	// 30,000 clusters (TestRequestLimitFitsA30kMesh), so the default
	// takes a mesh three times that. The peer port takes MaxMsgSize,
	// and so does this one if MaxMsgSize is less. Default 16 MiB.
	MaxRequestBytes int
	// RequestBudgetBytes bounds the bytes of requests of at least
	// admission.Floor bytes (reconnects, not ACKs) that the relay's
	// streams decode and apply at once: a request past it waits for its
	// turn (first come, first served), its client held back by gRPC's
	// flow control, so that many large requests at once cost the relay
	// this much, not their sum, and take half its cores at most. At
	// least MaxRequestBytes. Default 0: MaxRequestBytes times half the
	// cores (GOMAXPROCS), at least once.
	RequestBudgetBytes int64
	// ResourceWaitTimeout is how long a name requested from the upstream may
	// stay missing before the relay treats it as gone: a Delta client that
	// holds it (declared on reconnect, say) is then told it was removed.
	// Until then it is pending, never reported missing. (Envoy's own
	// initial fetch timeout is 15 s.) A listener or route held back for a
	// cluster longer than this is reported overdue, and if the key's view
	// lacks the cluster its source is asked for a new stream, which
	// proves whether it serves it (deferDangling). Default 15s.
	ResourceWaitTimeout time.Duration

	// AdmitRate bounds new Envoy streams per second (a token bucket of
	// AdmitBurst; istiod admits min(15+5×cores, 100) a second), shared
	// by identity: a stream past it waits its identity's turn (its
	// SPIFFE identity, or its address where it proves none), up to
	// AdmitWait, then is refused with ResourceExhausted and the client
	// retries. Relay-to-relay streams are not counted. Default 100; 0:
	// no limit.
	AdmitRate  float64
	AdmitBurst int
	// AdmitWait is how long a stream may wait for its turn. Default 3s.
	AdmitWait time.Duration
	// MaxStreams bounds the Envoy streams the relay serves at once,
	// shared by identity as AdmitRate is: at the bound, a stream of an
	// identity under its share (MaxStreams over the identities holding
	// streams) evicts the newest of the identity most over its share
	// (Unavailable: it reconnects), and one at its share is refused with
	// ResourceExhausted. Relay-to-relay streams are not counted. Default
	// 50,000; 0: no bound.
	MaxStreams int
	// WarmWait is how long a new stream waits for a relay that has not yet
	// reached its upstream before it is refused with Unavailable (istiod
	// refuses streams until its caches are synced). Default 2s. Negative:
	// never refuse; streams wait for config however long it takes.
	WarmWait time.Duration
	// serverOptions are added last to every xDS server's options: set
	// only by the package's benchmarks (BenchmarkSync), which compare
	// grpc-go's transport knobs on the real server.
	serverOptions []grpc.ServerOption
}

// DefaultXDSConfig returns the downstream server's defaults.
func DefaultXDSConfig() XDSConfig {
	return XDSConfig{
		Listen:           ":15010",
		TLSListen:        ":15012",
		HandshakeTimeout: 10 * time.Second,
		Authorizer:       AllowAll{},
		// istiod's: --keepaliveMaxServerConnectionAge 30m.
		MaxStreamsPerConnection: 100,
		MaxConnectionAge:        30 * time.Minute,
		MaxConnectionAgeGrace:   10 * time.Second,
		MaxSubscribedNames:      250_000,
		MaxRequestBytes:         16 << 20,
		ResourceWaitTimeout:     15 * time.Second,
		AdmitRate:               100,
		AdmitBurst:              200,
		AdmitWait:               3 * time.Second,
		MaxStreams:              50_000,
		WarmWait:                2 * time.Second,
	}
}

// port names the listener a stream or call came in on: what it may ask
// and what it must prove depend on it.
type port uint8

const (
	// portPlain is the plaintext xDS port (istiod's 15010): Envoys, and
	// the tier's relays when there is no peer port. It authenticates no
	// one.
	portPlain port = iota
	// portTLS is the TLS xDS port (istiod's 15012): Envoys, each proving
	// its identity when an Authenticator is set.
	portTLS
	// portPeer is the tier's relays' own port.
	portPeer
)

func (p port) String() string {
	switch p {
	case portTLS:
		return "tls"
	case portPeer:
		return "peer"
	}
	return "plaintext"
}
