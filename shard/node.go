package shard

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/snapshot"
	"github.com/meshrelay/meshrelay/shard/adminpb"
)

// NodeConfig configures a Node: a relay, its snapshot store, and its
// membership of a tier, if it has one.
type NodeConfig struct {
	// Relay configures the relay. In a tier, Tier.Owners, Tier.Balancer
	// and Tier.Peers are set to the ring, and Tier.Secret, if empty, is
	// derived from Ring.SecretKey; alone, they are left as given (nil: the
	// relay owns every key and answers tier-wide questions for itself).
	Relay relay.Config
	// Ring configures membership of a tier; nil (the default): a relay
	// alone, with no gossip. XDSAddr, if empty, is the address of the port
	// the tier's relays dial (the relay's peer port if it has one, else
	// its plaintext xDS port), which must then be dialable (not 0.0.0.0).
	Ring *Config
	// Store, if set, persists the views of the keys this relay owns in
	// etcd and warms the relay at start from every key persisted (it
	// becomes Relay.Snapshots). The Node starts and stops it; the owner of
	// snapshot.GCLeaderKey collects its garbage.
	Store *snapshot.Store
	// DrainPeriod is how long Stop (and Drain) spreads the closing of
	// streams over, after leaving the ring; it is cut short by Stop's
	// context. DefaultNodeConfig: 10s; 0: every stream is closed at once.
	DrainPeriod time.Duration
	// AllowMutations lets the admin API change the tier (Drain). Default
	// false: the admin API only reads.
	AllowMutations bool
}

// DefaultNodeConfig returns the configuration of a relay alone, with
// relay.DefaultConfig's defaults; set Ring (to DefaultConfig(), adjusted)
// for a tier.
func DefaultNodeConfig() NodeConfig {
	return NodeConfig{Relay: relay.DefaultConfig(), DrainPeriod: 10 * time.Second}
}

// Node is one relay: a relay.Relay with its snapshot store and admin API,
// and, in a sharded tier, a Ring that gives it key owners and its fair
// share. NewNode is the one place a relay is assembled (meshrelay serve in
// every mode, the demo, the loadtest children and the tests of a whole
// relay): create it with NewNode, Start it, and Stop it when done. Safe
// for concurrent use.
type Node struct {
	cfg   NodeConfig
	relay *relay.Relay
	ring  *Ring // nil: a relay alone
	log   *slog.Logger

	drainMu     sync.Mutex
	drainCancel context.CancelFunc // set once Drain started
	drainDone   chan struct{}      // closed when its streams are closed (set by Stop too)
}

// Compile-time checks of the interfaces package relay declares.
var (
	_ relay.Owners   = (*Ring)(nil)
	_ relay.Balancer = (*Ring)(nil)
	_ relay.Peers    = (*Ring)(nil)
)

// NewNode builds a Node. The relay's listeners the tier gossips (the one
// relays dial: the peer port, else the plaintext xDS port; the admin port)
// are opened now, if not given, so that their addresses are known.
func NewNode(cfg NodeConfig) (*Node, error) {
	if cfg.DrainPeriod < 0 {
		return nil, errors.New("shard: field DrainPeriod is negative")
	}
	// On failure the listeners are closed, given or opened: the relay
	// that would have closed them will not run.
	closeListeners := func() {
		for _, l := range []net.Listener{cfg.Relay.Tier.Listener, cfg.Relay.XDS.Listener, cfg.Relay.Admin.Listener} {
			if l != nil {
				l.Close()
			}
		}
	}
	open := func(given *net.Listener, addr string) error {
		if *given != nil || addr == "" {
			return nil
		}
		lis, err := net.Listen("tcp", addr)
		if err != nil {
			closeListeners()
			return fmt.Errorf("shard: listen %s: %w", addr, err)
		}
		*given = lis
		return nil
	}
	if err := open(&cfg.Relay.Tier.Listener, cfg.Relay.Tier.Listen); err != nil {
		return nil, err
	}
	if err := open(&cfg.Relay.XDS.Listener, cfg.Relay.XDS.Listen); err != nil {
		return nil, err
	}
	if err := open(&cfg.Relay.Admin.Listener, cfg.Relay.Admin.Listen); err != nil {
		return nil, err
	}
	if cfg.Relay.Registerer == nil && cfg.Relay.Gatherer == nil {
		reg := prometheus.NewRegistry()
		cfg.Relay.Registerer, cfg.Relay.Gatherer = reg, reg
	}
	gossipOpen := cfg.Ring != nil && len(cfg.Ring.SecretKey) == 0 && cfg.Relay.XDS.Authenticator != nil
	if gossipOpen && !cfg.Relay.Tier.InsecureForDevelopment {
		closeListeners()
		return nil, errors.New("shard: field Ring.SecretKey is empty while the relay's xDS port authenticates: gossip would be " +
			"neither encrypted nor authenticated, and whoever reaches the gossip port could join the ring, own keys and serve " +
			"Envoys; set it (--gossip-key-file), or, for development only, Relay.Tier.InsecureForDevelopment (--insecure-tier-for-development)")
	}
	n := &Node{log: cfg.Relay.Logger}
	if n.log == nil {
		n.log = slog.New(slog.DiscardHandler)
	}
	if cfg.Ring != nil {
		ring, err := newNodeRing(&cfg)
		if err != nil {
			closeListeners()
			return nil, err
		}
		n.ring = ring
	}
	if cfg.Store != nil {
		cfg.Relay.Keys.Snapshots = cfg.Store
		cfg.Store.SetOwns(func(key string) bool {
			if n.ring == nil {
				return true
			}
			_, self := n.ring.Owner(key)
			return self
		})
	}
	// The tier's admin API, on the relay's admin listener.
	registerMore := cfg.Relay.Admin.Services
	cfg.Relay.Admin.Services = func(s *grpc.Server) {
		adminpb.RegisterAdminServer(s, adminServer{n: n})
		if registerMore != nil {
			registerMore(s)
		}
	}
	r, err := relay.New(cfg.Relay)
	if err != nil {
		closeListeners()
		return nil, err
	}
	if gossipOpen {
		r.WarnInsecure("gossip neither encrypted nor authenticated (no --gossip-key-file) while the xDS port authenticates " +
			"(--insecure-tier-for-development): whoever reaches the gossip port joins the ring")
	}
	n.cfg, n.relay = cfg, r
	return n, nil
}

// newNodeRing builds the ring of cfg.Ring for the relay of cfg.Relay,
// filling the addresses it gossips and the relay's seams to the tier.
func newNodeRing(cfg *NodeConfig) (*Ring, error) {
	rc := *cfg.Ring
	peerLis, flag := cfg.Relay.Tier.Listener, "--advertise-peer"
	if peerLis == nil {
		peerLis, flag = cfg.Relay.XDS.Listener, "--advertise-xds"
	}
	if peerLis == nil {
		return nil, errors.New("shard: the relay has neither a peer port nor a plaintext xDS port for the tier's relays to dial")
	}
	if rc.XDSAddr == "" {
		addr, err := advertised(peerLis, "peer", flag)
		if err != nil {
			return nil, err
		}
		rc.XDSAddr = addr
	}
	if rc.AdminAddr == "" && cfg.Relay.Admin.Listener != nil {
		addr, err := advertised(cfg.Relay.Admin.Listener, "admin", "--advertise-admin")
		if err != nil {
			return nil, err
		}
		rc.AdminAddr = addr
	}
	if rc.Name == "" {
		rc.Name = cfg.Relay.ID
	}
	if len(cfg.Relay.Tier.Secret) == 0 && len(rc.SecretKey) > 0 {
		// Not the gossip key itself: a key of its own, derived from it.
		sum := sha256.Sum256(append([]byte("meshrelay peer secret\x00"), rc.SecretKey...))
		cfg.Relay.Tier.Secret = sum[:]
	}
	if rc.Registerer == nil {
		rc.Registerer = cfg.Relay.Registerer
	}
	ring, err := New(rc)
	if err != nil {
		return nil, err
	}
	cfg.Ring = &rc
	cfg.Relay.Tier.Owners, cfg.Relay.Tier.Balancer, cfg.Relay.Tier.Peers = ring, ring, ring
	return ring, nil
}

// advertised returns the address other hosts dial for lis: its own, or,
// if it listens on every address, the one other hosts most likely reach
// (as memberlist does for gossip).
func advertised(lis net.Listener, what, flag string) (string, error) {
	addr := lis.Addr().(*net.TCPAddr)
	ip := addr.IP
	if ip.IsUnspecified() {
		if ip = interfaceIP(); ip == nil {
			return "", fmt.Errorf("shard: the relay listens on %s and this host has no address to advertise: set the %s address other hosts dial (%s)", addr, what, flag)
		}
	}
	return net.JoinHostPort(ip.String(), strconv.Itoa(addr.Port)), nil
}

// interfaceIP returns the first private (RFC 1918 or ULA) address of an up,
// non-loopback interface, else its first global unicast address, else nil.
func interfaceIP() net.IP {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	var global net.IP
	for _, a := range addrs {
		n, ok := a.(*net.IPNet)
		if !ok || n.IP.IsLoopback() || !n.IP.IsGlobalUnicast() {
			continue
		}
		if n.IP.IsPrivate() {
			return n.IP
		}
		if global == nil {
			global = n.IP
		}
	}
	return global
}

// Relay returns the node's relay.
func (n *Node) Relay() *relay.Relay { return n.relay }

// Ring returns the node's ring; nil for a relay alone.
func (n *Node) Ring() *Ring { return n.ring }

// name is the relay's name in the tier: its ring member's, or its ID when
// alone.
func (n *Node) name() string {
	if n.ring == nil {
		return n.relay.ID()
	}
	return n.ring.Name()
}

// members returns the tier's members as this relay sees them: a relay
// alone is a tier of one.
func (n *Node) members() []Member {
	if n.ring != nil {
		return n.ring.Members()
	}
	self := Member{Name: n.relay.ID(), Conns: n.relay.Stats().Streams, Self: true}
	for _, a := range []net.Addr{n.relay.Addr(), n.relay.TLSAddr()} {
		if a != nil && self.XDSAddr == "" {
			self.XDSAddr = a.String()
		}
	}
	if a := n.relay.AdminAddr(); a != nil {
		self.AdminAddr = a.String()
	}
	return []Member{self}
}

// locate returns the member that owns key: the relay itself when alone.
func (n *Node) locate(key string) (Member, bool) {
	if n.ring != nil {
		return n.ring.Locate(key)
	}
	return n.members()[0], true
}

// health is gossip's view of the tier (Ring.Health); a relay alone is
// healthy and alive.
func (n *Node) health() (score int, states map[string]string) {
	if n.ring != nil {
		return n.ring.Health()
	}
	return 0, map[string]string{n.relay.ID(): "alive"}
}

// Start starts the relay, then joins the tier: peers may dial the relay as
// soon as they hear of it.
func (n *Node) Start(ctx context.Context) error {
	if n.cfg.Store != nil {
		if err := n.cfg.Store.Start(ctx); err != nil {
			return err
		}
	}
	if err := n.relay.Start(ctx); err != nil {
		n.stopStore(ctx)
		return err
	}
	if n.ring == nil {
		return nil
	}
	if err := n.ring.Start(ctx); err != nil {
		n.relay.Stop(ctx)
		n.stopStore(ctx)
		return err
	}
	return nil
}

// stopStore writes what the store still holds (until ctx ends) and closes
// its etcd client.
func (n *Node) stopStore(ctx context.Context) error {
	if n.cfg.Store == nil {
		return nil
	}
	return n.cfg.Store.Stop(ctx)
}

// Stop shuts the node down gracefully: not ready (new streams refused,
// /readyz fails) → leave the ring (its keys get new owners, whose relays
// switch their sources) → drain streams over DrainPeriod (Envoys first,
// peer relays last) → stop the relay and its upstream streams → write
// what the snapshot store holds and close etcd → stop gossip. ctx bounds the whole; when it ends, the rest is cut short.
//
// A leave that times out is logged, not returned: the others then notice
// the relay is gone by probing, a few seconds later.
func (n *Node) Stop(ctx context.Context) error {
	n.drainMu.Lock()
	cancel, done := n.drainCancel, n.drainDone
	if done == nil {
		// Stopping: a Drain from now on has nothing to do.
		n.drainDone = make(chan struct{})
		close(n.drainDone)
	}
	n.drainMu.Unlock()
	if cancel != nil {
		cancel() // what Drain has not closed yet is closed below
		<-done
	}
	n.leaveTier(ctx)
	n.relay.DrainStreams(ctx, n.cfg.DrainPeriod)
	err := errors.Join(n.relay.Stop(ctx), n.stopStore(ctx))
	if n.ring != nil {
		err = errors.Join(err, n.ring.Stop(ctx))
	}
	return err
}

// Drain makes the node leave the tier and move its streams away, as Stop
// does, but keeps it running: it turns not ready, leaves the ring, and
// closes its streams over DrainPeriod in the background. It returns the
// streams it closes, and false if the node was draining already.
func (n *Node) Drain(ctx context.Context) (streams int, started bool) {
	n.drainMu.Lock()
	if n.drainDone != nil {
		n.drainMu.Unlock()
		return 0, false
	}
	dctx, cancel := context.WithCancel(context.Background())
	n.drainCancel, n.drainDone = cancel, make(chan struct{})
	n.drainMu.Unlock()

	st := n.relay.Stats()
	n.leaveTier(ctx)
	n.log.Info("draining on request", "streams", st.Streams+st.PeerClients, "period", n.cfg.DrainPeriod)
	go func() {
		defer close(n.drainDone)
		n.relay.DrainStreams(dctx, n.cfg.DrainPeriod)
	}()
	return st.Streams + st.PeerClients, true
}

// leaveTier turns the relay not ready (no new streams) and takes it out of
// the ring: its keys get other owners. A leave that times out is logged.
func (n *Node) leaveTier(ctx context.Context) {
	n.relay.MarkNotReady()
	if n.ring == nil {
		return
	}
	if err := n.ring.Leave(ctx); err != nil {
		n.log.Warn("leaving the tier", "err", err)
	}
}

// Kill stops the node at once, as a crash would look to the others: no
// leave message, no drain. For tests and the demo.
func (n *Node) Kill() {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if n.ring != nil {
		n.ring.kill()
	}
	n.relay.Stop(ctx)
	n.stopStore(ctx) // unwritten changes are lost, as in a crash
}

// kill shuts gossip down without leaving.
func (r *Ring) kill() {
	r.mu.Lock()
	r.left = true
	r.mu.Unlock()
	if r.state.CompareAndSwap(1, 2) {
		r.cancel()
		r.wg.Wait()
		r.ml.Shutdown()
	}
}
