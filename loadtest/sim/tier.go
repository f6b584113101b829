package sim

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/shard"
)

// Addresses on the simulated network.
const (
	xdsPort     = 15010
	upstreamIP  = "10.0.0.1"
	serviceAddr = "10.0.0.2:15010" // the Service Envoys dial
)

func relayIP(i int) string { return fmt.Sprintf("10.0.1.%d", i+1) }
func envoyIP(i int) string { return fmt.Sprintf("10.0.2.%d", i+1) }

// dialOptions are a client's on the network: its host's dialer, plaintext,
// and gRPC's reconnect backoff without jitter (gRPC draws its jitter from
// the process's global source, which a seed cannot replay; the relay's
// own peer pool options are kept but for the jitter).
func dialOptions(h *Host, base time.Duration, maxDelay time.Duration, minConnect time.Duration) []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithContextDialer(h.Dialer()),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		// No transparent retries. A retried stream's RecvMsg holds the
		// stream's lock while it waits for the picker; a SendMsg waiting
		// on that lock is not durably blocked, so synctest's clock never
		// moves and the connect attempt the picker waits for never times
		// out: a seed hung so. Outside a bubble the wait ends with the
		// attempt. Every client here reopens failed streams itself.
		grpc.WithDisableRetry(),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: base, Multiplier: 1.6, Jitter: 0, MaxDelay: maxDelay},
			MinConnectTimeout: minConnect,
		}),
	}
}

// simRelay is one relay slot: a host and, while running, a node on it.
type simRelay struct {
	i           int
	host        *Host
	store       *StoreClient
	incarnation int

	// node and running are read by the Service's dials (readyRelays), on
	// the network's goroutines: under tier.mu.
	node    *shard.Node
	running bool
}

// tier is the simulated tier: the network, the upstream, the relays, the
// store and the Envoys.
type tier struct {
	cfg    Config
	seed   uint64
	net    *Network
	log    *slog.Logger
	store  *Store
	up     *upstream.Upstream
	upHost *Host
	upUp   bool
	relays []*simRelay
	proto  relay.Protocol
	mu     sync.Mutex // the relays' node and running

	envoys []*simEnvoy
}

type simEnvoy struct {
	i     int
	group string
	host  *Host
	conn  *grpc.ClientConn
	e     *envoy.Envoy
}

// startUpstream starts (or restarts) the upstream on its host.
func (t *tier) startUpstream(ctx context.Context) error {
	t.net.Restart(t.upHost.name)
	if err := t.up.Start(ctx); err != nil {
		return err
	}
	t.upUp = true
	return nil
}

// killUpstream crashes the upstream.
func (t *tier) killUpstream(ctx context.Context) {
	t.net.Crash(t.upHost.name)
	t.up.Stop(ctx)
	t.upUp = false
}

// readyRelays are the Service's endpoints: the xDS addresses of running,
// ready relays. A frozen relay is not one: its readiness probe times out
// (the chaos suite's probe notices within 0.7 s; here at once).
func (t *tier) readyRelays() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for _, r := range t.relays {
		if r.running && !r.host.Frozen() && r.node.Relay().Ready() {
			out = append(out, r.host.Addr(xdsPort))
		}
	}
	return out
}

// take marks slot i stopped and returns its node, nil if it was not
// running.
func (t *tier) take(i int) *shard.Node {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.relays[i]
	if !r.running {
		return nil
	}
	r.running = false
	return r.node
}

// gossipJoin lists every other relay's gossip address.
func (t *tier) gossipJoin(i int) []string {
	var out []string
	for _, r := range t.relays {
		if r.i != i {
			out = append(out, r.host.Addr(GossipPort))
		}
	}
	return out
}

// ipResolver resolves the IP literals of Join to themselves.
type ipResolver struct{}

func (ipResolver) LookupHost(_ context.Context, host string) ([]string, error) {
	if net.ParseIP(host) == nil {
		return nil, fmt.Errorf("sim: cannot resolve %q", host)
	}
	return []string{host}, nil
}

// startRelay starts slot i (a new incarnation, warm from the store).
func (t *tier) startRelay(ctx context.Context, i int) error {
	r := t.relays[i]
	t.net.Restart(r.host.name)
	r.incarnation++
	lis, err := r.host.Listen(xdsPort)
	if err != nil {
		return err
	}
	tr, err := r.host.NewTransport()
	if err != nil {
		lis.Close()
		return err
	}
	id := fmt.Sprintf("relay-%d", i)
	log := t.log.With("relay", id)

	rc := relay.DefaultConfig()
	rc.ID = id
	rc.XDS.Listener = lis
	rc.Upstream.Addr = t.upHost.Addr(xdsPort)
	rc.Upstream.Protocol = t.proto
	// The relay's own choices, as Relay.Start and peers.NewPool make them,
	// without gRPC's jitter.
	rc.Upstream.DialOptions = dialOptions(r.host, time.Second, 120*time.Second, 20*time.Second)
	rc.Tier.DialOptions = dialOptions(r.host, 250*time.Millisecond, 3*time.Second, 5*time.Second)
	rc.Tier.Secret = []byte("sim peer secret")
	rc.Tier.BalanceInterval = time.Second
	rc.Tier.ShedRate = 50
	rc.Keys.DivergenceInterval = t.cfg.DivergenceInterval
	rc.Logger = log
	rc.Rand = rand.NewPCG(t.seed, hash64(fmt.Sprintf("%s/%d", id, r.incarnation)))
	r.store = t.store.Client(fmt.Sprintf("%s-%d", id, r.incarnation), time.Second)
	rc.Keys.Snapshots = r.store
	if t.cfg.Relay != nil {
		t.cfg.Relay(&rc)
	}

	sc := shard.DefaultConfig()
	sc.Name = id
	sc.XDSAddr = r.host.Addr(xdsPort)
	sc.Transport = tr
	sc.Join = t.gossipJoin(i)
	sc.Resolver = ipResolver{}
	sc.RejoinInterval = 2 * time.Second
	sc.Logger = log

	node, err := shard.NewNode(shard.NodeConfig{Relay: rc, Ring: &sc, DrainPeriod: 2 * time.Second})
	if err != nil {
		lis.Close()
		tr.Shutdown()
		return fmt.Errorf("%s: %w", id, err)
	}
	r.store.Start()
	if err := node.Start(ctx); err != nil {
		r.store.Kill()
		return fmt.Errorf("%s: %w", id, err)
	}
	t.mu.Lock()
	r.node, r.running = node, true
	t.mu.Unlock()
	return nil
}

// killRelay crashes slot i: its host goes down first, so that nothing it
// does while stopping reaches anyone.
func (t *tier) killRelay(i int) {
	r := t.relays[i]
	node := t.take(i)
	if node == nil {
		return
	}
	t.net.Crash(r.host.name)
	node.Kill()
	r.store.Kill()
}

// stopRelay stops slot i gracefully (leave, drain, flush), within d.
func (t *tier) stopRelay(ctx context.Context, i int, d time.Duration) error {
	r := t.relays[i]
	node := t.take(i)
	if node == nil {
		return nil
	}
	sctx, cancel := context.WithTimeout(ctx, d)
	err := node.Stop(sctx)
	cancel()
	r.store.Stop()
	t.net.Crash(r.host.name) // whatever it left open
	return err
}

// startEnvoys starts every Envoy, recording its events with rec.
func (t *tier) startEnvoys(ctx context.Context, proto envoy.Protocol, rec func(i int, ev envoy.Event)) error {
	sc := t.cfg.Scenario
	for i := range t.cfg.Envoys {
		h := t.net.AddHost(fmt.Sprintf("envoy-%d", i), envoyIP(i))
		conn, err := grpc.NewClient(serviceAddr, append(dialOptions(h, time.Second, 120*time.Second, 20*time.Second),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))...)
		if err != nil {
			return err
		}
		key := i % t.cfg.Keys
		node := sc.Node(key%sc.Namespaces, key/sc.Namespaces, i/t.cfg.Keys)
		ec := envoy.DefaultConfig()
		ec.Node = node
		ec.Protocol = proto
		ec.Conn = conn
		ec.Generation = upstream.Generation
		ec.UnsubscribeGrace = 8 // a relay pushes without waiting for ACKs
		ec.Backoff = envoy.Backoff{Base: 500 * time.Millisecond, Max: 5 * time.Second}
		ec.Rand = rand.New(rand.NewPCG(t.seed, hash64(h.name)))
		idx := i
		ec.OnEvent = func(ev envoy.Event) { rec(idx, ev) }
		e, err := envoy.New(ec)
		if err != nil {
			conn.Close()
			return err
		}
		se := &simEnvoy{i: i, group: sc.Group(node), host: h, conn: conn, e: e}
		t.envoys = append(t.envoys, se)
		if err := e.Start(ctx); err != nil {
			return err
		}
	}
	return nil
}

// stopEnvoys stops every Envoy and closes its connection.
func (t *tier) stopEnvoys() {
	for _, se := range t.envoys {
		se.e.Stop(context.Background())
		se.conn.Close()
	}
}

// keyOf returns the aggregation key index of Envoy node id.
func (t *tier) keyIndex() map[string]int {
	out := map[string]int{}
	for _, se := range t.envoys {
		out[se.e.ID()] = se.i % t.cfg.Keys
	}
	return out
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }
