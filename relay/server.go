package relay

import (
	"context"
	"log/slog"
	"maps"
	"sync"
	"sync/atomic"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"golang.org/x/sync/singleflight"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/admission"
	"github.com/meshrelay/meshrelay/relay/metrics"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// server is the downstream ADS server: the streams Envoys (and the tier's
// other relays) open, who they are and whether they may start, what each
// is sent and in what order, what each holds. Its streams join the keys of
// the cache below it; what it asks of the tier above it, it asks through
// its serverHost. Its methods are safe for concurrent use.
type server struct {
	cfg   serverConfig
	host  serverHost
	cache *keyCache

	log     *slog.Logger
	store   *xds.Store
	metrics *metrics.Metrics
	pushACK metrics.Latency
	ledger  *ledger.Tracker
	clock   *ledger.Clock

	controlPlane *core.ControlPlane
	// controlPlaneWire is controlPlane encoded, for responses the relay
	// encodes itself; bodies caches those responses' shared bytes.
	controlPlaneWire []byte
	bodies           wire.Bodies
	versions         wire.Versions // every version string rendered once
	usable           usableSet     // routes and listeners found usable, for every Envoy stream alike
	streamID         atomic.Uint64

	admission *admission.Fair            // nil: no limit (Envoy streams shared by identity)
	authLogs  *rate.Limiter              // bounds authentication warnings
	failures  *admission.FailureGate     // bounds verifications of failing sources
	verifying singleflight.Group         // one verification for the streams presenting one credential at once
	shares    *admission.Shares[*stream] // Envoy streams by identity (XDS.MaxStreams)
	budget    *admission.Budget          // large requests decoded and applied at once (XDS.RequestBudgetBytes)
	draining  atomic.Bool                // set by MarkNotReady: new streams are refused
	warm      chan struct{}              // closed once the upstream was first reached, or snapshots loaded
	warmOnce  sync.Once

	// The streams' passthrough (passthrough.go): the upstream connection
	// and the relay's context it runs in (both set by start), and its
	// pace, a fifth of Upstream.StreamRate (nil: no bound).
	upConn   *grpc.ClientConn
	passRate *rate.Limiter
	ctx      context.Context
	stopping chan struct{} // closed by the relay's Stop: streams end

	mu sync.Mutex
	// attached holds the streams joined to a key, with the key: each is
	// a member of it from acquireKey to releaseKey.
	attached map[*stream]joinedKey
}

// serverConfig is what configures the server: the parts of Config it
// reads.
type serverConfig struct {
	XDS XDSConfig
	// ForwardCredentials is Config.Upstream.ForwardCredentials: a stream
	// keeps the token its key's upstream stream may present.
	ForwardCredentials bool
}

// serverHost is what the server asks of the relay that holds it: the
// tier's part in a stream.
type serverHost struct {
	// goRun runs fn on a goroutine the relay's Stop waits for, and
	// reports whether it did (not once Stop has begun).
	goRun func(fn func(context.Context)) bool
	// identifyPeer reads a relay-to-relay stream's metadata: nil for an
	// Envoy's stream, an error for a peer stream that does not prove
	// itself. checkPort refuses a stream the port p does not serve.
	identifyPeer func(ctx context.Context, p port) (*peerIdentity, error)
	checkPort    func(p port, isPeer bool) error
	// askTier looks a SotW stream's claimed version of sub up in the
	// tier, and reports whether there is anyone to ask (claims.go).
	askTier func(s *stream, sub *typeSub) bool
	// answerDebugSotW (with the names asked) and answerDebugDelta answer
	// a request for one of istiod's debug types (debugxds.go).
	answerDebugSotW  func(s *stream, req *discovery.DiscoveryRequest, names []string) error
	answerDebugDelta func(s *stream, req *discovery.DeltaDiscoveryRequest) error
}

// start gives the server the upstream connection its streams' passthrough
// uses, and the context it runs in; the relay calls it before it serves.
func (srv *server) start(ctx context.Context, conn *grpc.ClientConn) {
	srv.mu.Lock()
	defer srv.mu.Unlock()
	srv.ctx, srv.upConn = ctx, conn
}

// attachedStreams returns the streams joined to a key now, with the key.
func (srv *server) attachedStreams() map[*stream]joinedKey {
	srv.mu.Lock()
	defer srv.mu.Unlock()
	return maps.Clone(srv.attached)
}
