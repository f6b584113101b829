// Package cluster is a tier of relays as a test drives it: the Cluster
// interface that scenarios (loadtest/scenario) are written against, and
// Tier, which runs one in this process: each relay a shard.Node gossiping
// over shard/memnet, an embedded etcd for their snapshots, and a
// Service-like proxy Envoys dial, as Kubernetes would put in front of the
// tier. Relays can be killed, stopped, started and added while it runs.
// (loadtest.RelayProcs is the Cluster of `meshrelay serve` processes.)
package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/meshrelay/meshrelay/shard/memnet"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/snapshot"
	"github.com/meshrelay/meshrelay/shard"
)

// TierConfig describes an in-process sharded tier: relays gossiping over an
// in-memory network, dialling each other over loopback, behind one
// Service-like proxy that Envoys connect to.
type TierConfig struct {
	// Relays is the number of relays started. Default 3.
	Relays int
	// Upstream is the upstream's address. Required.
	Upstream string
	// UpstreamProtocol is spoken to the upstream. Default Delta.
	UpstreamProtocol relay.Protocol
	// DrainPeriod is each relay's drain on a graceful stop. Default 1s.
	DrainPeriod time.Duration
	// BalanceInterval is each relay's balancing interval. Default 1s.
	BalanceInterval time.Duration
	// ShedRate bounds the streams a relay moves a second. Default 50.
	ShedRate float64
	// AdmitRate bounds new streams per relay and second (0: no limit).
	// Default 0.
	AdmitRate float64
	// Etcd, if set, gives every relay a snapshot store on these endpoints:
	// the relays persist the keys they own and a (re)started relay warms
	// from them.
	Etcd []string
	// Relay, if set, adjusts each relay's configuration last.
	Relay func(*relay.Config)
	// Node, if set, adjusts each node's configuration last (after Relay).
	Node func(*shard.NodeConfig)
	// Logger receives every relay's logs. Default: discard.
	Logger *slog.Logger
	// Secure, if set, makes every relay an Istio drop-in: Envoys on a TLS
	// port (the Service's), the relays on an mTLS peer port of their own,
	// and no plaintext port.
	Secure *TierSecurity
}

// TierSecurity is what a secure tier's relays need (see relay.Config).
type TierSecurity struct {
	// XDSTLS and Authenticator serve the TLS xDS port.
	XDSTLS        *tls.Config
	Authenticator relay.Authenticator
	// PeerServer and PeerClient are the peer port's mTLS (auth.PeerTLS).
	PeerServer, PeerClient *tls.Config
	// Forward makes keys' upstream streams present their members' tokens.
	Forward bool
}

// Tier is a running in-process tier. Its methods are safe for concurrent
// use. Stop it when done.
type Tier struct {
	cfg TierConfig
	nw  *memnet.Network
	svc *Service

	mu     sync.Mutex
	slots  []*TierRelay // by index; a stopped relay's slot keeps its place
	closed bool
}

// TierRelay is one relay of a Tier.
type TierRelay struct {
	Index int
	ID    string
	Node  *shard.Node
	// Gossip is its address on the in-memory gossip network.
	Gossip string
	// Running is false once stopped or killed.
	Running bool
}

// StartTier starts cfg.Relays relays and the Service in front of them.
func StartTier(ctx context.Context, cfg TierConfig) (*Tier, error) {
	if cfg.Relays == 0 {
		cfg.Relays = 3
	}
	if cfg.UpstreamProtocol == "" {
		cfg.UpstreamProtocol = relay.ProtocolDelta
	}
	if cfg.DrainPeriod == 0 {
		cfg.DrainPeriod = time.Second
	}
	if cfg.BalanceInterval == 0 {
		cfg.BalanceInterval = time.Second
	}
	if cfg.ShedRate == 0 {
		cfg.ShedRate = 50
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Relays < 1 || cfg.Upstream == "" {
		return nil, errors.New("loadtest: a tier needs at least one relay and an upstream")
	}
	t := &Tier{cfg: cfg, nw: memnet.NewNetwork()}
	svc, err := NewService(t.readyAddrs)
	if err != nil {
		return nil, err
	}
	t.svc = svc
	for range cfg.Relays {
		if _, err := t.Add(ctx); err != nil {
			t.Stop(context.Background())
			return nil, err
		}
	}
	return t, nil
}

// StartConvergedTier starts a tier (StartTier) and waits up to wait for it
// to converge (WaitConverged); if it does not, it stops the tier.
func StartConvergedTier(ctx context.Context, cfg TierConfig, wait time.Duration) (*Tier, error) {
	t, err := StartTier(ctx, cfg)
	if err != nil {
		return nil, err
	}
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	if err := t.WaitConverged(wctx); err != nil {
		t.Stop(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("loadtest: tier not converged after %v: %w", wait, err)
	}
	return t, nil
}

// Addr is the Service's address: what Envoys connect to.
func (t *Tier) Addr() string { return t.svc.Addr() }

// readyAddrs lists the xDS addresses of ready relays (the Service's
// endpoints, as Kubernetes lists ready pods).
func (t *Tier) readyAddrs() []string {
	var out []string
	for _, r := range t.Running() {
		if rl := r.Node.Relay(); rl.Ready() {
			if a := rl.TLSAddr(); a != nil {
				out = append(out, a.String())
			} else {
				out = append(out, rl.Addr().String())
			}
		}
	}
	return out
}

// Running returns the relays running now.
func (t *Tier) Running() []*TierRelay {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []*TierRelay
	for _, r := range t.slots {
		if r.Running {
			out = append(out, r)
		}
	}
	return out
}

// Relay returns slot i.
func (t *Tier) Relay(i int) *TierRelay {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.slots[i]
}

// Relays returns a copy of every slot, running or not, by index.
func (t *Tier) Relays() []TierRelay {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]TierRelay, len(t.slots))
	for i, r := range t.slots {
		out[i] = *r
	}
	return out
}

// Slots returns the number of relay slots, running or not.
func (t *Tier) Slots() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.slots)
}

// IsRunning reports whether r (an incarnation Relay returned) still runs.
func (t *Tier) IsRunning(r *TierRelay) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return r.Running
}

// Ready reports whether slot i runs and its relay is ready.
func (t *Tier) Ready(i int) bool {
	t.mu.Lock()
	r := t.slots[i]
	running := r.Running
	t.mu.Unlock()
	return running && r.Node.Relay().Ready()
}

// Add starts one more relay, joining the running ones, and returns its
// index.
func (t *Tier) Add(ctx context.Context) (int, error) {
	t.mu.Lock()
	i := len(t.slots)
	t.slots = append(t.slots, &TierRelay{Index: i})
	t.mu.Unlock()
	return i, t.Start(ctx, i)
}

// Start starts slot i again (a new incarnation, as after a pod restart).
func (t *Tier) Start(ctx context.Context, i int) error {
	var join []string
	for _, r := range t.Running() {
		join = append(join, r.Gossip)
	}
	tr := t.nw.NewTransport()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	id := fmt.Sprintf("relay-%d", i)
	t.nw.Register(tr.Addr(), lis.Addr().String())

	rc := relay.DefaultConfig()
	rc.ID = id
	rc.XDS.Listener = lis
	rc.Upstream.Addr = t.cfg.Upstream
	rc.Upstream.Protocol = t.cfg.UpstreamProtocol
	rc.Tier.BalanceInterval = t.cfg.BalanceInterval
	rc.Tier.ShedRate = t.cfg.ShedRate
	rc.XDS.AdmitRate = t.cfg.AdmitRate
	rc.Tier.DialOptions = []grpc.DialOption{grpc.WithContextDialer(t.nw.Dialer(tr.Addr()))}
	rc.Logger = t.cfg.Logger
	rc.Tier.Secret = []byte("tier test peer secret")
	if s := t.cfg.Secure; s != nil {
		tlsLis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			lis.Close()
			return err
		}
		rc.XDS.Listener, rc.XDS.Listen, rc.Tier.Listener = nil, "", lis
		rc.XDS.TLSListener, rc.XDS.TLS, rc.XDS.Authenticator = tlsLis, s.XDSTLS, s.Authenticator
		rc.Tier.TLS, rc.Upstream.ForwardCredentials = s.PeerServer, s.Forward
		rc.Tier.DialOptions = append(rc.Tier.DialOptions, grpc.WithTransportCredentials(credentials.NewTLS(s.PeerClient)))
	}
	if t.cfg.Relay != nil {
		t.cfg.Relay(&rc)
	}
	sc := shard.DefaultConfig()
	sc.Transport = tr
	sc.Gossip = "local"
	sc.Join = join
	sc.RejoinInterval = time.Second
	sc.MetaInterval = 200 * time.Millisecond
	sc.Logger = t.cfg.Logger
	if t.cfg.Secure != nil {
		sc.SecretKey = []byte("tier test gossip") // an authenticating tier's gossip has a key (shard.NewNode)
	}
	var store *snapshot.Store
	if len(t.cfg.Etcd) > 0 {
		stc := snapshot.DefaultConfig()
		stc.Endpoints, stc.Logger = t.cfg.Etcd, t.cfg.Logger
		stc.Member = fmt.Sprintf("%s-%d", id, time.Now().UnixNano())
		if store, err = snapshot.New(stc); err != nil {
			closeListeners(rc)
			return err
		}
	}
	nc := shard.NodeConfig{Relay: rc, Ring: &sc, DrainPeriod: t.cfg.DrainPeriod, Store: store}
	if t.cfg.Node != nil {
		t.cfg.Node(&nc)
	}
	node, err := shard.NewNode(nc)
	if err != nil {
		closeListeners(rc)
		if store != nil {
			store.Stop(ctx)
		}
		return err
	}
	if err := node.Start(ctx); err != nil {
		return err
	}
	t.mu.Lock()
	t.slots[i] = &TierRelay{Index: i, ID: id, Node: node, Gossip: tr.Addr(), Running: true}
	t.mu.Unlock()
	return nil
}

// closeListeners closes the listeners a relay that did not start was given.
func closeListeners(rc relay.Config) {
	for _, l := range []net.Listener{rc.XDS.Listener, rc.XDS.TLSListener, rc.Tier.Listener} {
		if l != nil {
			l.Close()
		}
	}
}

// StopRelay stops slot i: gracefully (leave, drain) or as a crash.
func (t *Tier) StopRelay(ctx context.Context, i int, graceful bool) error {
	t.mu.Lock()
	r := t.slots[i]
	running := r.Running
	r.Running = false
	t.mu.Unlock()
	if !running {
		return nil
	}
	if graceful {
		return r.Node.Stop(ctx)
	}
	r.Node.Kill()
	return nil
}

// Partition cuts slot i off from the other relays: gossip and
// relay-to-relay streams. Envoys and the upstream still reach it.
func (t *Tier) Partition(i int) { t.nw.Partition(t.Relay(i).Gossip) }

// Heal ends every partition.
func (t *Tier) Heal() { t.nw.Heal() }

// Members returns, for each running relay, the relay IDs in its ring.
func (t *Tier) Members() map[string][]string {
	out := map[string][]string{}
	for _, r := range t.Running() {
		var ids []string
		for _, m := range r.Node.Ring().Members() {
			ids = append(ids, m.XDSAddr)
		}
		slices.Sort(ids)
		out[r.ID] = ids
	}
	return out
}

// Converged reports whether every running relay sees exactly the running
// relays in its ring.
func (t *Tier) Converged() bool {
	var want []string
	running := t.Running()
	for _, r := range running {
		want = append(want, r.Node.Relay().PeerAddr().String())
	}
	slices.Sort(want)
	for _, got := range t.Members() {
		if !slices.Equal(got, want) {
			return false
		}
	}
	return len(running) > 0
}

// WaitConverged waits until Converged or ctx ends.
func (t *Tier) WaitConverged(ctx context.Context) error {
	for !t.Converged() {
		select {
		case <-ctx.Done():
			return fmt.Errorf("loadtest: ring did not converge: %v: %w", t.Members(), ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}

// Stop stops every relay (without draining) and the Service.
func (t *Tier) Stop(ctx context.Context) {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return
	}
	t.closed = true
	t.mu.Unlock()
	t.svc.Close()
	var wg sync.WaitGroup
	for _, r := range t.Running() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t.StopRelay(ctx, r.Index, false)
		}()
	}
	wg.Wait()
}
