package shard

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
)

// Ring is one relay's membership in the tier and its view of who owns each
// aggregation key. Create it with New, Start it, and Stop it when done (Stop
// leaves the tier first if Leave was not called). Its methods are safe for
// concurrent use.
//
// The ring is advisory: two relays may briefly disagree on an owner (gossip
// takes a few rounds to spread), and nothing that must be exact depends on
// it. The relay keeps serving from its cache across any change.
type Ring struct {
	cfg  Config
	log  *slog.Logger
	name string // the memberlist name: Config.Name plus an incarnation suffix

	ml    *memberlist.Memberlist
	conns atomic.Int64 // this relay's Envoy streams, as last reported

	// changed tells the consumer (the relay) that owners may have moved;
	// events tells the ring's own goroutine that memberlist saw a change.
	changed chan struct{}
	events  chan struct{}

	metaMu   sync.Mutex
	metaWire []byte // what NodeMeta returns

	// nodes is what memberlist told the event delegate, copied under its
	// lock: memberlist's own *Node values change under its lock, so they
	// are never read anywhere else.
	nodesMu sync.Mutex
	nodes   map[string]nodeInfo

	mu      sync.RWMutex
	hr      *hashRing // nil while this relay knows no member (before Start, after Stop)
	members []Member  // by name
	warned  map[string]string
	left    bool

	cancel context.CancelFunc
	wg     sync.WaitGroup
	state  atomic.Int32 // 0 new, 1 started, 2 stopped
}

// New validates cfg and builds a Ring. Nothing runs until Start.
func New(cfg Config) (*Ring, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	suffix := make([]byte, 4)
	if _, err := rand.Read(suffix); err != nil {
		return nil, fmt.Errorf("shard: member name: %w", err)
	}
	r := &Ring{
		cfg:     cfg,
		name:    cfg.Name + "-" + hex.EncodeToString(suffix),
		changed: make(chan struct{}, 1),
		events:  make(chan struct{}, 1),
		warned:  make(map[string]string),
		nodes:   make(map[string]nodeInfo),
	}
	r.log = cfg.Logger.With("relay", r.name)
	wire, err := meta{V: metaVersion, XDS: cfg.XDSAddr, Admin: cfg.AdminAddr}.encode()
	if err != nil {
		return nil, err
	}
	r.metaWire = wire
	if cfg.Registerer != nil {
		err := cfg.Registerer.Register(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "meshrelay_ring_members", Help: "Relays in this relay's view of the tier, itself included.",
		}, func() float64 { return float64(len(r.Members())) }))
		if err != nil {
			return nil, fmt.Errorf("shard: register metrics: %w", err)
		}
	}
	return r, nil
}

// Name returns this relay's member name (unique to this process).
func (r *Ring) Name() string { return r.name }

// Start creates the gossip member, joins the addresses of Config.Join that
// answer, and keeps rejoining in the background. A tier nobody answers for
// is not an error: the relay starts one of its own, and rejoins when the
// others appear. It does not block on anything but the first join.
func (r *Ring) Start(ctx context.Context) error {
	if !r.state.CompareAndSwap(0, 1) {
		return errors.New("shard: Start called twice")
	}
	mc := memberlist.DefaultLANConfig()
	if r.cfg.Gossip == "local" {
		mc = memberlist.DefaultLocalConfig()
		// Faster still than memberlist's local profile: in-process tests
		// and demos want failures noticed in a second or two.
		mc.ProbeInterval = 200 * time.Millisecond
		mc.ProbeTimeout = 100 * time.Millisecond
		mc.GossipInterval = 50 * time.Millisecond
		mc.PushPullInterval = 2 * time.Second
		mc.SuspicionMult = 2
		mc.TCPTimeout = time.Second
	}
	mc.Name = r.name
	mc.BindAddr, mc.BindPort = r.cfg.BindAddr, r.cfg.BindPort
	mc.AdvertiseAddr, mc.AdvertisePort = r.cfg.AdvertiseAddr, r.cfg.AdvertisePort
	if r.cfg.AdvertiseAddr != "" && r.cfg.AdvertisePort == 0 {
		mc.AdvertisePort = r.cfg.BindPort
	}
	if r.cfg.Transport != nil {
		mc.Transport = r.cfg.Transport
	}
	mc.SecretKey = r.cfg.SecretKey
	mc.Label = r.cfg.Cluster
	mc.Delegate = (*delegate)(r)
	mc.Events = (*events)(r)
	mc.Logger = log.New(&logWriter{log: r.log}, "", 0)
	ml, err := memberlist.Create(mc)
	if err != nil {
		return fmt.Errorf("shard: start gossip: %w", err)
	}
	r.ml = ml
	r.rebuild()

	ctx, r.cancel = context.WithCancel(context.WithoutCancel(ctx))
	r.join(ctx)
	r.wg.Add(3)
	go func() { defer r.wg.Done(); r.watch(ctx) }()
	go func() { defer r.wg.Done(); r.gossipConns(ctx) }()
	go func() { defer r.wg.Done(); r.rejoin(ctx) }()
	node := ml.LocalNode()
	r.log.Info("joined gossip", "addr", net.JoinHostPort(node.Addr.String(), strconv.Itoa(int(node.Port))),
		"members", ml.NumMembers(), "encrypted", len(r.cfg.SecretKey) > 0, "cluster", r.cfg.Cluster)
	return nil
}

// Leave tells the tier this relay is going: it drops out of every other
// relay's ring (its keys get new owners) and out of its own, so that it
// stops owning keys too. Idempotent; Stop calls it if needed.
func (r *Ring) Leave(ctx context.Context) error {
	r.mu.Lock()
	if r.ml == nil || r.left {
		r.mu.Unlock()
		return nil
	}
	r.left = true
	r.mu.Unlock()
	timeout := r.cfg.LeaveTimeout
	if d, ok := ctx.Deadline(); ok {
		timeout = min(timeout, time.Until(d))
	}
	err := r.leave(timeout)
	r.nodesMu.Lock()
	delete(r.nodes, r.name)
	r.nodesMu.Unlock()
	r.rebuild()
	if err != nil {
		return fmt.Errorf("shard: leave: %w", err)
	}
	r.log.Info("left gossip")
	return nil
}

// leave calls memberlist's Leave, which panics if gossip was shut down.
func (r *Ring) leave(timeout time.Duration) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("memberlist: %v", p)
		}
	}()
	return r.ml.Leave(timeout)
}

// Stop leaves the tier (if Leave was not called), shuts gossip down and
// returns once every goroutine of the ring has exited. Idempotent.
func (r *Ring) Stop(ctx context.Context) error {
	if !r.state.CompareAndSwap(1, 2) {
		r.state.Store(2)
		return nil
	}
	err := r.Leave(ctx)
	r.cancel()
	r.wg.Wait()
	return errors.Join(err, r.ml.Shutdown())
}

// Owner returns the xDS address of key's owner, and whether that is this
// relay. A relay that knows no member (alone, or stopped) owns every key.
func (r *Ring) Owner(key string) (addr string, self bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.hr == nil {
		return r.cfg.XDSAddr, true
	}
	m := r.hr.locate(key)
	return m.XDSAddr, m.Self
}

// Locate returns the member that owns key, and false if the ring is empty.
func (r *Ring) Locate(key string) (Member, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.hr == nil {
		return Member{}, false
	}
	return r.hr.locate(key), true
}

// Changed is signalled (without blocking, coalesced) after the member set
// changed, when owners may have moved. It has one consumer.
func (r *Ring) Changed() <-chan struct{} { return r.changed }

// Members returns the live members by name, each with its last gossiped
// connection count (this relay's own is the latest reported).
func (r *Ring) Members() []Member {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := slices.Clone(r.members)
	for i := range out {
		if out[i].Self {
			out[i].Conns = int(r.conns.Load())
		}
	}
	return out
}

// Health returns gossip's view of the tier's health: this relay's
// awareness score (memberlist's: 0 is healthy; it rises while this relay
// misses its own probes' deadlines, a sign that it, not its peers, is
// slow) and each member's state by name ("alive" or "suspect"; a member
// declared dead or gone has left the ring). Empty before Start and after
// Stop.
func (r *Ring) Health() (score int, states map[string]string) {
	if r.state.Load() != 1 {
		return 0, nil
	}
	states = make(map[string]string)
	for _, n := range r.ml.Members() {
		switch n.State {
		case memberlist.StateAlive:
			states[n.Name] = "alive"
		case memberlist.StateSuspect:
			states[n.Name] = "suspect"
		}
	}
	return r.ml.GetHealthScore(), states
}

// PeerAddrs returns the xDS addresses of the other live members.
func (r *Ring) PeerAddrs() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]string, 0, len(r.members))
	for _, m := range r.members {
		if !m.Self && m.XDSAddr != "" {
			out = append(out, m.XDSAddr)
		}
	}
	return out
}

// FairShare records this relay's Envoy stream count (gossiped within
// MetaInterval) and returns the tier's fair share per relay (the total over
// the live members divided by their number, rounded up) and the count of
// the least loaded member. ok is false while this relay knows of no other
// member.
func (r *Ring) FairShare(conns int) (share, least int, ok bool) {
	r.conns.Store(int64(min(max(conns, 0), maxConns)))
	members := r.Members()
	if len(members) < 2 {
		return 0, 0, false
	}
	total, least := 0, members[0].Conns
	for _, m := range members {
		total += m.Conns
		least = min(least, m.Conns)
	}
	return (total + len(members) - 1) / len(members), least, true
}

// rebuild recomputes the members and the hash ring from memberlist, and
// signals Changed if the member set (not just a count) changed.
func (r *Ring) rebuild() {
	r.nodesMu.Lock()
	nodes := maps.Clone(r.nodes)
	r.nodesMu.Unlock()
	members := make([]Member, 0, len(nodes))
	r.mu.Lock()
	defer r.mu.Unlock()
	for name, n := range nodes {
		m, err := decodeMeta(n.meta)
		if err != nil {
			// Not counted as a member: nobody could dial it. Said once per
			// member and error.
			if r.warned[name] != err.Error() {
				r.warned[name] = err.Error()
				r.log.Warn("ignoring gossip member with bad metadata", "member", name, "err", err)
			}
			continue
		}
		members = append(members, Member{Name: name, XDSAddr: m.XDS, AdminAddr: m.Admin, Conns: m.Conns, Self: name == r.name})
	}
	slices.SortFunc(members, func(a, b Member) int { return strings.Compare(a.Name, b.Name) })
	sameSet := slices.EqualFunc(members, r.members, func(a, b Member) bool {
		return a.Name == b.Name && a.XDSAddr == b.XDSAddr
	})
	r.members = members
	if sameSet && (r.hr != nil || len(members) == 0) {
		return
	}
	if len(members) == 0 {
		r.hr = nil
	} else {
		hr, err := newHashRing(members, r.cfg.Partitions, r.cfg.Load)
		if err != nil {
			// Validated in New; a failure here is a bug, not input.
			r.log.Error("cannot build hash ring; keeping the previous one", "err", err)
			return
		}
		r.hr = hr
	}
	names := make([]string, len(members))
	for i, m := range members {
		names[i] = m.Name
	}
	r.log.Info("ring changed", "members", names)
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

// watch rebuilds the ring after memberlist events, one at a time.
func (r *Ring) watch(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.events:
			r.rebuild()
		}
	}
}

// gossipConns spreads this relay's connection count when it changed, at
// most once per MetaInterval.
func (r *Ring) gossipConns(ctx context.Context) {
	t := time.NewTicker(r.cfg.MetaInterval)
	defer t.Stop()
	sent := int64(0)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n := r.conns.Load()
		if n == sent {
			continue
		}
		r.mu.RLock()
		left := r.left
		r.mu.RUnlock()
		if left {
			// A relay that left gossips nothing more: memberlist forgets
			// its own node a while after, and UpdateNode would
			// dereference it.
			return
		}
		wire, err := meta{V: metaVersion, XDS: r.cfg.XDSAddr, Admin: r.cfg.AdminAddr, Conns: int(n)}.encode()
		if err != nil {
			continue // cannot happen: the address fitted in New, and a count is short
		}
		r.metaMu.Lock()
		r.metaWire = wire
		r.metaMu.Unlock()
		if err := r.updateNode(); err != nil {
			r.log.Debug("gossip connection count", "err", err)
			continue
		}
		sent = n
	}
}

// updateNode gossips this relay's metadata again. memberlist panics if it
// no longer knows its own node (it left a Leave ago: a Leave racing the
// check above); that is an error here, not a crash.
func (r *Ring) updateNode() (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("memberlist: %v", p)
		}
	}()
	return r.ml.UpdateNode(r.cfg.MetaInterval)
}

// rejoin resolves Config.Join every RejoinInterval and joins every address
// that is not a live member.
func (r *Ring) rejoin(ctx context.Context) {
	t := time.NewTicker(r.cfg.RejoinInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			r.join(ctx)
		}
	}
}

// join joins the addresses of Config.Join that are not live members.
func (r *Ring) join(ctx context.Context) {
	if len(r.cfg.Join) == 0 {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	addrs, errs := r.resolve(rctx)
	cancel()
	live := make(map[string]bool)
	r.nodesMu.Lock()
	for _, n := range r.nodes {
		live[n.addr] = true
	}
	r.nodesMu.Unlock()
	var todo []string
	for _, a := range addrs {
		if !live[a] {
			todo = append(todo, a)
		}
	}
	if len(todo) > 0 {
		n, err := r.ml.Join(todo)
		if err != nil {
			errs = append(errs, err)
		}
		if n > 0 {
			r.log.Info("joined", "contacted", n, "of", len(todo))
		}
	}
	if len(errs) > 0 && len(live) < 2 {
		r.log.Warn("no other relay reachable; retrying", "join", r.cfg.Join, "err", errors.Join(errs...), "retry_in", r.cfg.RejoinInterval)
	}
}

// resolve turns Config.Join into ip:port addresses.
func (r *Ring) resolve(ctx context.Context) ([]string, []error) {
	var out []string
	var errs []error
	for _, j := range r.cfg.Join {
		host, port, err := net.SplitHostPort(j)
		if err != nil {
			host, port = j, strconv.Itoa(r.cfg.BindPort)
		}
		if net.ParseIP(host) != nil {
			out = append(out, net.JoinHostPort(host, port))
			continue
		}
		ips, err := r.cfg.Resolver.LookupHost(ctx, host)
		if err != nil {
			errs = append(errs, fmt.Errorf("resolve %s: %w", host, err))
			continue
		}
		for _, ip := range ips {
			out = append(out, net.JoinHostPort(ip, port))
		}
	}
	slices.Sort(out)
	return slices.Compact(out), errs
}

// delegate gives memberlist this relay's metadata.
type delegate Ring

func (d *delegate) NodeMeta(limit int) []byte {
	d.metaMu.Lock()
	defer d.metaMu.Unlock()
	if len(d.metaWire) > limit {
		return nil
	}
	return bytes.Clone(d.metaWire)
}
func (d *delegate) NotifyMsg([]byte)                           {}
func (d *delegate) GetBroadcasts(overhead, limit int) [][]byte { return nil }
func (d *delegate) LocalState(join bool) []byte                { return nil }
func (d *delegate) MergeRemoteState(buf []byte, join bool)     {}

// nodeInfo is a copy of what memberlist knows of a live node.
type nodeInfo struct {
	meta []byte
	addr string // ip:port of its gossip
}

// events copies memberlist's notifications and hands them to the ring's
// goroutine. They are called with memberlist's locks held: never block,
// never call back into memberlist.
type events Ring

func (e *events) NotifyJoin(n *memberlist.Node)   { e.set(n) }
func (e *events) NotifyUpdate(n *memberlist.Node) { e.set(n) }
func (e *events) NotifyLeave(n *memberlist.Node) {
	e.nodesMu.Lock()
	delete(e.nodes, n.Name)
	e.nodesMu.Unlock()
	e.poke()
}

func (e *events) set(n *memberlist.Node) {
	info := nodeInfo{meta: bytes.Clone(n.Meta), addr: n.Address()}
	e.nodesMu.Lock()
	e.nodes[n.Name] = info
	e.nodesMu.Unlock()
	e.poke()
}

func (e *events) poke() {
	select {
	case e.events <- struct{}{}:
	default:
	}
}

// logWriter routes memberlist's log lines ("[DEBUG] memberlist: …") to slog
// at their level.
type logWriter struct{ log *slog.Logger }

func (w *logWriter) Write(p []byte) (int, error) {
	line := strings.TrimSpace(string(p))
	level := slog.LevelDebug
	for prefix, l := range map[string]slog.Level{"[ERR]": slog.LevelError, "[WARN]": slog.LevelWarn, "[INFO]": slog.LevelDebug} {
		if rest, ok := strings.CutPrefix(line, prefix); ok {
			level, line = l, strings.TrimSpace(rest)
			break
		}
	}
	line = strings.TrimPrefix(strings.TrimPrefix(line, "[DEBUG]"), " ")
	w.log.Log(context.Background(), level, line, "component", "memberlist")
	return len(p), nil
}
