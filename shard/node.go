package shard

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
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

// NodeConfig configures a Node: a relay and its membership of the tier.
type NodeConfig struct {
	// Relay configures the relay. Owners and Tier are set to the ring;
	// PeerSecret, if empty, is derived from Ring.SecretKey.
	Relay relay.Config
	// Ring configures membership. XDSAddr, if empty, is the address of
	// the port the tier's relays dial (the relay's peer port if it has
	// one, else its plaintext xDS port), which must then be dialable (not
	// 0.0.0.0).
	Ring Config
	// Store, if set, persists the views of the keys this relay owns in
	// etcd and warms the relay at start from every key persisted (it
	// becomes Relay.Snapshots). The Node starts and stops it; the owner of
	// snapshot.GCLeaderKey collects its garbage.
	Store *snapshot.Store
	// DrainPeriod is how long Stop (and Drain) spreads the closing of
	// streams over, after leaving the ring. Default 10s; it is cut short by
	// Stop's context.
	DrainPeriod time.Duration
	// AllowMutations lets the admin API change the tier (Drain). Default
	// false: the admin API only reads.
	AllowMutations bool
}

// Node is one relay of a sharded tier: a relay.Relay whose key owners and
// fair share come from a Ring. Create it with NewNode, Start it, and Stop it
// when done. Safe for concurrent use.
type Node struct {
	cfg   NodeConfig
	relay *relay.Relay
	ring  *Ring

	drainMu     sync.Mutex
	drainCancel context.CancelFunc // set once Drain started
	drainDone   chan struct{}      // closed when its streams are closed (set by Stop too)
}

// Compile-time checks of the interfaces package relay declares.
var (
	_ relay.Owners = (*Ring)(nil)
	_ relay.Tier   = (*Ring)(nil)
	_ relay.Peers  = (*Ring)(nil)
)

// NewNode builds a Node. The relay's listeners the tier gossips (the one
// relays dial: the peer port, else the plaintext xDS port; the admin port)
// are opened now, if not given, so that their addresses are known.
func NewNode(cfg NodeConfig) (*Node, error) {
	if cfg.DrainPeriod == 0 {
		cfg.DrainPeriod = 10 * time.Second
	}
	if cfg.DrainPeriod < 0 {
		return nil, errors.New("shard: field DrainPeriod is negative")
	}
	// On failure the listeners are closed, given or opened: the relay
	// that would have closed them will not run.
	closeListeners := func() {
		for _, l := range []net.Listener{cfg.Relay.PeerListener, cfg.Relay.Listener, cfg.Relay.AdminListener} {
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
	if err := open(&cfg.Relay.PeerListener, cfg.Relay.PeerListen); err != nil {
		return nil, err
	}
	if err := open(&cfg.Relay.Listener, cfg.Relay.XDSListen); err != nil {
		return nil, err
	}
	if err := open(&cfg.Relay.AdminListener, cfg.Relay.AdminListen); err != nil {
		return nil, err
	}
	peerLis, flag := cfg.Relay.PeerListener, "--advertise-peer"
	if peerLis == nil {
		peerLis, flag = cfg.Relay.Listener, "--advertise-xds"
	}
	if peerLis == nil {
		closeListeners()
		return nil, errors.New("shard: the relay has neither a peer port nor a plaintext xDS port for the tier's relays to dial")
	}
	if cfg.Ring.XDSAddr == "" {
		addr, err := advertised(peerLis, "peer", flag)
		if err != nil {
			closeListeners()
			return nil, err
		}
		cfg.Ring.XDSAddr = addr
	}
	if cfg.Ring.AdminAddr == "" && cfg.Relay.AdminListener != nil {
		addr, err := advertised(cfg.Relay.AdminListener, "admin", "--advertise-admin")
		if err != nil {
			closeListeners()
			return nil, err
		}
		cfg.Ring.AdminAddr = addr
	}
	if cfg.Ring.Name == "" {
		cfg.Ring.Name = cfg.Relay.ID
	}
	if len(cfg.Relay.PeerSecret) == 0 && len(cfg.Ring.SecretKey) > 0 {
		// Not the gossip key itself: a key of its own, derived from it.
		sum := sha256.Sum256(append([]byte("meshrelay peer secret\x00"), cfg.Ring.SecretKey...))
		cfg.Relay.PeerSecret = sum[:]
	}
	if cfg.Relay.Registerer == nil && cfg.Relay.Gatherer == nil {
		reg := prometheus.NewRegistry()
		cfg.Relay.Registerer, cfg.Relay.Gatherer = reg, reg
	}
	if cfg.Ring.Registerer == nil {
		cfg.Ring.Registerer = cfg.Relay.Registerer
	}
	ring, err := New(cfg.Ring)
	if err != nil {
		closeListeners()
		return nil, err
	}
	cfg.Relay.Owners, cfg.Relay.Tier, cfg.Relay.Peers = ring, ring, ring
	if cfg.Store != nil {
		cfg.Relay.Snapshots = cfg.Store
		cfg.Store.SetGCLeader(func() bool {
			_, self := ring.Owner(snapshot.GCLeaderKey)
			return self
		})
	}
	n := &Node{ring: ring}
	// The tier's admin API, on the relay's admin listener.
	registerMore := cfg.Relay.AdminServices
	cfg.Relay.AdminServices = func(s *grpc.Server) {
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
	n.cfg, n.relay = cfg, r
	return n, nil
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

// Ring returns the node's ring.
func (n *Node) Ring() *Ring { return n.ring }

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
	return errors.Join(n.relay.Stop(ctx), n.stopStore(ctx), n.ring.Stop(ctx))
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
	n.ring.log.Info("draining on request", "streams", st.Streams+st.PeerClients, "period", n.cfg.DrainPeriod)
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
	if err := n.ring.Leave(ctx); err != nil {
		n.ring.log.Warn("leaving the tier", "err", err)
	}
}

// Kill stops the node at once, as a crash would look to the others: no
// leave message, no drain. For tests and the demo.
func (n *Node) Kill() {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	n.ring.kill()
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
