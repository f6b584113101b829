package relay

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/metrics"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// keyCache is the relay's keys: each key's state (keyState) and the feed
// that fills its views, and what every key shares: the resource store, the
// interned views and versions, the slots and pace of the streams to the
// keys' sources, the splits the tier knows. It is the lowest layer of the
// relay: the downstream server joins streams to its keys and reads their
// views, the tier asks it for keys, and what it asks of the relay above
// it, it asks through its keyHost. Its methods are safe for concurrent
// use.
type keyCache struct {
	cfg  keyConfig
	host keyHost

	log     *slog.Logger
	store   *xds.Store
	dropped *xds.Dropped
	// views shares the keys' views of equal content: the keys of a
	// namespace, each fed by a stream of its own, hold one tree (issue 17).
	// These three are allocated apart from the cache: the cleanups they
	// register hold them, and a pointer into the cache would keep a
	// stopped one alive for as long as a tree it made lives.
	views        *ledger.Interner[*xds.Resource]
	versionTrees *ledger.Interner[string] // the upstream's Delta versions, per key and type, shared by content
	nameSets     *xds.NameSets            // the streams' subscriptions, shared by content
	refIndex     xds.RefIndex
	metrics      *metrics.Metrics
	ledger       *ledger.Tracker
	// clock orders the views of the keys this relay is the source of, and
	// observes the Orders of views it gets from the tier (ledger.Order).
	clock        *ledger.Clock
	rand         *rand.Rand // Config.Rand, serialised; nil: the global source
	pool         *peers.Pool
	syncs        syncSlots     // first answers from the upstream in flight (Config.Upstream.Syncs)
	peerSyncs    syncSlots     // first answers from keys' owners in flight (as many)
	upstreamRate *rate.Limiter // streams opened to the upstream (Config.Upstream.StreamRate); nil: no bound
	// upConn is the connection every key's upstream stream uses, set
	// before the first feed starts (start).
	upConn *grpc.ClientConn

	// splits are the keys' splits the relay knows (splits.go);
	// divergenceWake wakes the divergence checks at once.
	splits         splitBook
	divergenceWake chan struct{}

	loaded     chan struct{} // closed once snapshots are loaded (at once without Snapshots)
	ownersTerm atomic.Uint64 // counts changes of owners (Snapshots.Save's term)
	restored   atomic.Int64  // keys restored from snapshots at start

	mu      sync.Mutex
	keys    map[aggkey.Key]*keyState
	stopped bool // set by stop: no key is installed from then on
}

// keyConfig is what configures the keys: the parts of Config they read.
type keyConfig struct {
	Upstream UpstreamConfig
	Keys     KeysConfig
	// History is Config.History; Owners Config.Tier.Owners (nil: this
	// relay owns every key); ResourceWaitTimeout
	// Config.XDS.ResourceWaitTimeout.
	History             ledger.HistoryConfig
	Owners              Owners
	ResourceWaitTimeout time.Duration
}

// keyHost is what the keys ask of the relay that holds them.
type keyHost struct {
	// goRun runs fn on a goroutine the relay's Stop waits for, and
	// reports whether it did (not once Stop has begun).
	goRun func(fn func(context.Context)) bool
	// peerContext is ctx with what a stream to key's owner presents to
	// it (the tier's proof, the key, the splits known).
	peerContext func(ctx context.Context, key aggkey.Key) context.Context
	// markWarm lets streams in: the relay has config to serve.
	markWarm func(why string)
}

// start gives the keys the connection their upstream streams use. The
// relay calls it before any key's feed starts.
func (c *keyCache) start(conn *grpc.ClientConn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.upConn = conn
}

// stop installs no key from now on (installKey); the relay's Stop calls it
// as it begins.
func (c *keyCache) stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stopped = true
}

// key returns the key named so, or nil if the relay holds none.
func (c *keyCache) key(name aggkey.Key) *keyState {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.keys[name]
}

// join returns the key's state, creating it (and starting its feed) if
// needed, with m joined as a member.
func (c *keyCache) join(name aggkey.Key, m member) *keyState {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := c.keys[name]
	if k == nil {
		k = c.startKeyLocked(name, nil)
	}
	k.join(m)
	return k
}

// watchWarm lets streams in (keyHost.markWarm) once the upstream
// connection is first ready: from then on the keys have a source of
// config (and the cache) to serve from.
func (c *keyCache) watchWarm(ctx context.Context) {
	c.upConn.Connect()
	for {
		s := c.upConn.GetState()
		if s == connectivity.Ready {
			// A relay that loads snapshots takes streams once they are
			// in place: a stream that came first would find its key cold.
			select {
			case <-c.loaded:
			case <-ctx.Done():
				return
			}
			c.host.markWarm("upstream reached")
			return
		}
		if s == connectivity.Idle {
			c.upConn.Connect()
		}
		if !c.upConn.WaitForStateChange(ctx, s) {
			return
		}
	}
}
