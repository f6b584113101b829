// Package upstream owns a synthetic, istiod-shaped xDS control plane for
// tests, demos and benchmarks: the upstream that relays subscribe to, and
// that simulated Envoys use directly in "direct" benchmark mode.
//
// It is built on go-control-plane's real SotW and Delta ADS servers
// (pkg/server/sotw/v3, pkg/server/delta/v3) over one cache.LinearCache per
// (node group, type), multiplexed by a cache.MuxCache. A node group is a
// namespace: a Scenario's services are either visible everywhere or only in
// their own namespace, so namespaces see different views; a node whose IP
// is one of Scenario.InboundIPs also gets an inbound listener of its own,
// from listener caches of its own (group and IP). Like istiod, SotW
// CDS and LDS responses carry the full state while SotW EDS and RDS responses
// carry only the resources that changed; Delta uses content (hash) versions.
//
// Every resource carries a generation (see Generation and MetadataKey) that
// grows whenever it changes, and every mutation (MoveEndpoint, AddService,
// RemoveService, Churn) returns the Changes it published so a benchmark can
// time their arrival. Mutations are applied make-before-break: clusters and
// endpoints before the routes that use them, routes removed before clusters.
package upstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/delta/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/sotw/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/proto"
)

// ErrRemoved is returned (wrapped) by mutations that name a removed service.
var ErrRemoved = errors.New("upstream: service removed")

// DefaultMaxMsgSize is the default gRPC message size limit: a 30k-service
// SotW CDS response from istiod is 34 MB.
const DefaultMaxMsgSize = 256 << 20

// Config configures an Upstream. Start from DefaultConfig.
type Config struct {
	// Scenario is the configuration to serve. Services and Namespaces must
	// be > 0.
	Scenario Scenario
	// Listen is the TCP address to listen on. Port 0 picks a free port on
	// the first Start; later Starts reuse the port picked then. Empty means
	// "127.0.0.1:0". Ignored if Listener is set.
	Listen string
	// Listener, if set, is called by every Start for the listener to serve
	// on instead of listening on Listen (an in-memory network's, in a
	// simulation). Nil: Listen.
	Listener func() (net.Listener, error)
	// MaxMsgSize is the largest gRPC message sent or received, in bytes.
	// Zero means DefaultMaxMsgSize (256 MiB).
	MaxMsgSize int
	// Logger receives warnings and debug events (keys node, type). Nil means
	// discard.
	Logger *slog.Logger
	// OnPublish, if set, is called for every change just before it reaches
	// the caches (so before any subscriber can see it), with the
	// Upstream's lock held: it must be quick and must not call the
	// Upstream. Benchmarks use it to start timing a change without racing
	// its arrival.
	OnPublish func(Change)
	// ServerOptions are added to the gRPC server's: TLS credentials and
	// a Guard's interceptor make it istiod's port 15012. Nil: plaintext,
	// anyone served (istiod's 15010).
	ServerOptions []grpc.ServerOption
	// IncrementalDelta serves Delta streams from caches whose cost
	// follows what changed, not what each stream subscribes to, as
	// istiod's incremental EDS pushes do (see deltaCache); SotW streams
	// keep go-control-plane's LinearCache. go-control-plane's
	// LinearCache walks a stream's whole subscription on every response
	// and ACK: at 30,000 services and 100 streams, seconds of CPU per
	// change, which would make the upstream, not the relays, what a
	// benchmark at that scale measures. Default false: LinearCache for
	// both, as the benchmarks before it measured.
	IncrementalDelta bool
}

// DefaultConfig returns a Config with every default filled in and
// DefaultScenario.
func DefaultConfig() Config {
	return Config{
		Scenario:   DefaultScenario(),
		Listen:     "127.0.0.1:0",
		MaxMsgSize: DefaultMaxMsgSize,
		Logger:     slog.New(slog.DiscardHandler),
	}
}

func (c Config) withDefaults() Config {
	c.Scenario = c.Scenario.withDefaults()
	c.Scenario.Ports = slices.Clone(c.Scenario.Ports)
	c.Scenario.GRPCServices = slices.Clone(c.Scenario.GRPCServices)
	c.Scenario.HTTPServices = slices.Clone(c.Scenario.HTTPServices)
	c.Scenario.InboundIPs = slices.Clone(c.Scenario.InboundIPs)
	if c.Listen == "" {
		c.Listen = "127.0.0.1:0"
	}
	if c.MaxMsgSize == 0 {
		c.MaxMsgSize = DefaultMaxMsgSize
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c Config) validate() error {
	if err := c.Scenario.validate(); err != nil {
		return err
	}
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		return fmt.Errorf("upstream: field Listen: %w", err)
	}
	if c.MaxMsgSize < 0 {
		return fmt.Errorf("upstream: field MaxMsgSize must be >= 0, got %d", c.MaxMsgSize)
	}
	return nil
}

// Change is one resource change published by a mutation.
type Change struct {
	// TypeURL is the resource type, e.g. resource.EndpointType.
	TypeURL string
	// Name is the resource name.
	Name string
	// Generation is the resource's generation after the change (for a
	// removal, the generation of the mutation that removed it).
	Generation uint64
	// At is when the change was handed to the caches, just before the first
	// subscriber could see it.
	At time.Time
	// Groups are the node groups the change reached (those that see the
	// resource), so a benchmark knows which clients must receive it.
	Groups []string
}

// Stats are counters of an Upstream, gathered by go-control-plane server
// callbacks. They survive Stop/Start.
type Stats struct {
	// OpenStreams is the number of ADS streams (SotW and Delta) open now.
	OpenStreams int64
	// StreamsOpened counts every ADS stream opened.
	StreamsOpened uint64
	// Requests counts discovery requests received (ACKs and NACKs included).
	Requests uint64
	// Responses counts discovery responses sent.
	Responses uint64
	// BytesSent is the sum of proto.Size of every response sent.
	BytesSent uint64
	// Changes counts resource changes published by mutations.
	Changes uint64
}

// type indices of the caches of a group.
const (
	tCDS = iota
	tEDS
	tLDS
	tRDS
	numTypes
)

var typeURLs = [numTypes]string{
	tCDS: resource.ClusterType,
	tEDS: resource.EndpointType,
	tLDS: resource.ListenerType,
	tRDS: resource.RouteType,
}

// unknownKey classifies requests for type URLs the upstream does not serve
// (Istio's NDS, PCDS, debug types): they get a watch that never fires, so
// the stream stays open, as it does on istiod.
const unknownKey = "unknown"

type service struct {
	idx       int
	ns        int
	port      uint32
	local     bool
	removed   bool
	name      string // cluster and ClusterLoadAssignment name
	cluster   *clusterv3.Cluster
	cla       *endpointv3.ClusterLoadAssignment
	vhost     *routev3.VirtualHost
	endpoints []int // indices into Upstream.workloads, ascending
}

type workload struct {
	svc int
	lb  *endpointv3.LbEndpoint
}

// Upstream is a synthetic istiod-shaped ADS server. Create it with New, serve
// with Start; whoever calls Start must call Stop. All methods are safe for
// concurrent use.
type Upstream struct {
	cfg     Config
	sc      Scenario
	log     *slog.Logger
	sh      *shared
	groups  []string       // namespaces in order, then PublicGroup; immutable
	groupIx map[string]int // immutable
	all     []int          // every group index; immutable
	caches  [][numTypes]*cache.LinearCache
	deltas  [][numTypes]*deltaCache // with IncrementalDelta
	// inbound maps each of Scenario.InboundIPs to its index in the
	// listener caches of its nodes: inboundLDS[group][index] serves the
	// group's listeners and the IP's inbound listener (inboundDeltas the
	// same, with IncrementalDelta). Immutable; the caches follow every
	// listener published to their group.
	inbound       map[netip.Addr]int
	inboundLDS    [][]*cache.LinearCache
	inboundDeltas [][]*deltaCache
	mux           *cache.MuxCache
	stats         counters

	// mu guards the model below. It also serialises each mutation end to end,
	// cache updates included, so every cache sees the generations of a
	// resource in increasing order. The caches never call back into
	// Upstream, and their watch channels are buffered, so no cache update
	// blocks while mu is held.
	mu        sync.Mutex
	services  []*service
	workloads []*workload
	byPort    map[uint32][]int // live service indices per port, ascending
	http      map[string]*httpService
	nextAddr  uint64
	gen       uint64

	life   sync.Mutex // guards the fields below
	addr   string
	srv    *grpc.Server
	cancel context.CancelFunc
	done   chan struct{}
}

// Start builds an upstream of cfg and starts it: New, then Start, which
// is what every benchmark and test does first. It returns the running
// upstream; the caller stops it.
func Start(ctx context.Context, cfg Config) (*Upstream, error) {
	u, err := New(cfg)
	if err != nil {
		return nil, err
	}
	if err := u.Start(ctx); err != nil {
		return nil, err
	}
	return u, nil
}

// New builds the whole configuration of cfg.Scenario and its caches. It does
// not listen; call Start.
func New(cfg Config) (*Upstream, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	sh, err := newShared()
	if err != nil {
		return nil, err
	}
	sc := cfg.Scenario
	u := &Upstream{
		cfg:     cfg,
		sc:      sc,
		log:     cfg.Logger,
		sh:      sh,
		groupIx: make(map[string]int, sc.Namespaces+1),
		byPort:  make(map[uint32][]int, len(sc.Ports)),
		http:    make(map[string]*httpService, len(sc.HTTPServices)),
		gen:     1,
	}
	for j := 0; j < sc.Namespaces; j++ {
		u.groups = append(u.groups, NamespaceName(j))
	}
	u.groups = append(u.groups, PublicGroup)
	for gi, g := range u.groups {
		u.groupIx[g] = gi
		u.all = append(u.all, gi)
	}
	if err := u.build(newMarker(u.gen)); err != nil {
		return nil, err
	}
	return u, nil
}

// newService builds service idx (without its ClusterLoadAssignment).
func (u *Upstream) newService(idx int, mk marker) *service {
	s := &service{
		idx:   idx,
		ns:    u.sc.namespaceOf(idx),
		port:  u.sc.ServicePort(idx),
		local: u.sc.IsLocal(idx),
	}
	host := u.sc.ServiceHost(idx)
	s.name = clusterName(s.port, host)
	s.cluster = u.sh.serviceCluster(s.name, host, "svc-"+strconv.Itoa(idx), NamespaceName(s.ns), mk)
	s.vhost = u.sh.virtualHost(host, s.port, s.name)
	return s
}

func (u *Upstream) rebuildCLA(s *service, mk marker) {
	lbs := make([]*endpointv3.LbEndpoint, len(s.endpoints))
	for k, j := range s.endpoints {
		lbs[k] = u.workloads[j].lb
	}
	s.cla = u.sh.cla(s.name, lbs, mk)
}

// build creates the initial model and one LinearCache per (group, type).
func (u *Upstream) build(mk marker) error {
	sc := u.sc
	u.services = make([]*service, sc.Services)
	for i := range u.services {
		s := u.newService(i, mk)
		u.services[i] = s
		u.byPort[s.port] = append(u.byPort[s.port], i)
	}
	u.workloads = make([]*workload, sc.Endpoints)
	for j := range u.workloads {
		w := &workload{svc: j % sc.Services}
		w.lb = u.sh.lbEndpoint(endpointIP(u.nextAddr), EndpointPort, mk)
		u.nextAddr++
		u.workloads[j] = w
		s := u.services[w.svc]
		s.endpoints = append(s.endpoints, j)
	}
	visible := make([]int, len(u.groups))
	for _, s := range u.services {
		u.rebuildCLA(s, mk)
		if s.local {
			visible[s.ns]++
		} else {
			for gi := range visible {
				visible[gi]++
			}
		}
	}

	// Resources every group gets: listeners and the gRPC targets.
	lds := make(map[string]types.Resource, len(sc.Ports)+len(sc.GRPCServices))
	for _, p := range sc.Ports {
		l, err := u.sh.portListener(p, mk)
		if err != nil {
			return err
		}
		lds[l.GetName()] = l
	}
	common := [numTypes]map[string]types.Resource{tLDS: lds}
	for _, t := range []int{tCDS, tEDS, tRDS} {
		common[t] = make(map[string]types.Resource, len(sc.GRPCServices))
	}
	for _, g := range sc.GRPCServices {
		route, cluster := grpcNames(g.Name)
		l, err := u.sh.apiListener(g.Name, route, mk)
		if err != nil {
			return err
		}
		backend, _ := parseHostPort(g.Backend) // validated
		lds[g.Name] = l
		common[tRDS][route] = u.sh.grpcRouteConfig(route, g.Name, cluster, mk)
		common[tCDS][cluster] = u.sh.grpcCluster(cluster, mk)
		common[tEDS][cluster] = u.sh.cla(cluster, []*endpointv3.LbEndpoint{
			u.sh.lbEndpoint(backend.host, backend.port, mk),
		}, mk)
	}

	for _, h := range sc.HTTPServices {
		listener, route, cluster := HTTPNames(h.Name)
		if h.Listen != "" {
			at, _ := parseHostPort(h.Listen) // validated
			l, err := u.sh.httpListener(listener, at, route, mk)
			if err != nil {
				return err
			}
			lds[listener] = l
		}
		common[tRDS][route] = u.sh.grpcRouteConfig(route, "*", cluster, mk)
		common[tCDS][cluster] = u.sh.grpcCluster(cluster, mk)
		lbs, err := u.httpBackends(h.Name, h.Backends, mk)
		if err != nil {
			return err
		}
		common[tEDS][cluster] = u.sh.cla(cluster, lbs, mk)
		u.http[h.Name] = &httpService{cluster: cluster}
	}

	perGroup := make([][numTypes]map[string]types.Resource, len(u.groups))
	for gi := range perGroup {
		for _, t := range []int{tCDS, tEDS} {
			m := make(map[string]types.Resource, visible[gi]+len(common[t]))
			for k, v := range common[t] {
				m[k] = v
			}
			perGroup[gi][t] = m
		}
		rds := make(map[string]types.Resource, len(sc.Ports)+len(common[tRDS]))
		for k, v := range common[tRDS] {
			rds[k] = v
		}
		for _, p := range sc.Ports {
			rds[routeName(p)] = u.sh.routeConfig(routeName(p), u.vhosts(gi, p), mk)
		}
		perGroup[gi][tRDS] = rds
		perGroup[gi][tLDS] = lds
	}
	for _, s := range u.services {
		for _, gi := range u.visibleGroups(s) {
			perGroup[gi][tCDS][s.name] = s.cluster
			perGroup[gi][tEDS][s.name] = s.cla
		}
	}

	xl := xdsLogger{u.log}
	u.caches = make([][numTypes]*cache.LinearCache, len(u.groups))
	u.mux = &cache.MuxCache{
		Classify: func(r *cache.Request) string { return u.classify(r.GetNode(), r.GetTypeUrl()) },
		ClassifyDelta: func(r *cache.DeltaRequest) string {
			key := u.classify(r.GetNode(), r.GetTypeUrl())
			if u.cfg.IncrementalDelta && key != unknownKey {
				key += deltaSuffix
			}
			return key
		},
		Caches: make(map[string]cache.Cache, 2*len(u.groups)*(numTypes+len(sc.InboundIPs))+1),
	}
	u.mux.Caches[unknownKey] = silentCache{}
	// Each object is encoded once, however many groups serve it.
	encoded := map[types.Resource]*deltaRes{}
	deltaInitial := func(resources map[string]types.Resource) (map[string]*deltaRes, error) {
		initial := make(map[string]*deltaRes, len(resources))
		for name, res := range resources {
			dr, ok := encoded[res]
			if !ok {
				var err error
				if dr, err = newDeltaRes(name, res); err != nil {
					return nil, err
				}
				encoded[res] = dr
			}
			initial[name] = dr
		}
		return initial, nil
	}
	if u.cfg.IncrementalDelta {
		u.deltas = make([][numTypes]*deltaCache, len(u.groups))
	}
	for gi, g := range u.groups {
		for t := range numTypes {
			lc := cache.NewLinearCache(typeURLs[t], cache.WithInitialResources(perGroup[gi][t]), cache.WithLogger(xl))
			u.caches[gi][t] = lc
			u.mux.Caches[muxKey(g, typeURLs[t])] = lc
			if !u.cfg.IncrementalDelta {
				continue
			}
			initial, err := deltaInitial(perGroup[gi][t])
			if err != nil {
				return err
			}
			u.deltas[gi][t] = newDeltaCache(typeURLs[t], initial)
			u.mux.Caches[muxKey(g, typeURLs[t])+deltaSuffix] = u.deltas[gi][t]
		}
		perGroup[gi] = [numTypes]map[string]types.Resource{} // let the build maps go
	}
	return u.buildInbound(lds, mk, xl, deltaInitial)
}

// buildInbound creates, for each of Scenario.InboundIPs and each group,
// the listener cache of the group's nodes of that IP: lds (every group's
// listeners at build) and the IP's inbound listener. Its other types are
// served from the group's caches (classify).
func (u *Upstream) buildInbound(lds map[string]types.Resource, mk marker, xl xdsLogger,
	deltaInitial func(map[string]types.Resource) (map[string]*deltaRes, error)) error {
	ips := u.sc.inboundIPs()
	if len(ips) == 0 {
		return nil
	}
	u.inbound = make(map[netip.Addr]int, len(ips))
	own := make([]types.Resource, len(ips))
	for k, ip := range ips {
		u.inbound[ip] = k
		l, err := u.sh.inboundListener(ip.String(), EndpointPort, mk)
		if err != nil {
			return err
		}
		own[k] = l
	}
	u.inboundLDS = make([][]*cache.LinearCache, len(u.groups))
	if u.cfg.IncrementalDelta {
		u.inboundDeltas = make([][]*deltaCache, len(u.groups))
	}
	for gi, g := range u.groups {
		for k, ip := range ips {
			res := make(map[string]types.Resource, len(lds)+1)
			maps.Copy(res, lds)
			res[InboundListenerName(ip.String())] = own[k]
			lc := cache.NewLinearCache(typeURLs[tLDS], cache.WithInitialResources(res), cache.WithLogger(xl))
			u.inboundLDS[gi] = append(u.inboundLDS[gi], lc)
			key := inboundKey(g, ip)
			u.mux.Caches[key] = lc
			if !u.cfg.IncrementalDelta {
				continue
			}
			initial, err := deltaInitial(res)
			if err != nil {
				return err
			}
			dc := newDeltaCache(typeURLs[tLDS], initial)
			u.inboundDeltas[gi] = append(u.inboundDeltas[gi], dc)
			u.mux.Caches[key+deltaSuffix] = dc
		}
	}
	return nil
}

// deltaSuffix marks the mux keys of the incremental Delta caches.
const deltaSuffix = "|delta"

func muxKey(group, typeURL string) string { return group + "|" + typeURL }

// inboundKey is the mux key of the listener cache of group's nodes of
// ip, one of Scenario.InboundIPs.
func inboundKey(group string, ip netip.Addr) string {
	return muxKey(group+"|"+ip.String(), typeURLs[tLDS])
}

func (u *Upstream) classify(node *core.Node, typeURL string) string {
	if !slices.Contains(typeURLs[:], typeURL) {
		return unknownKey
	}
	group := u.sc.Group(node)
	if typeURL == typeURLs[tLDS] && len(u.inbound) > 0 {
		for _, ip := range nodeIPs(node) {
			if _, ok := u.inbound[ip]; ok {
				return inboundKey(group, ip)
			}
		}
	}
	return muxKey(group, typeURL)
}

// visibleGroups returns the groups that see s.
func (u *Upstream) visibleGroups(s *service) []int {
	if s.local {
		return []int{s.ns}
	}
	return u.all
}

// vhosts returns the virtual hosts group gi sees on port, in service order.
func (u *Upstream) vhosts(gi int, port uint32) []*routev3.VirtualHost {
	idxs := u.byPort[port]
	out := make([]*routev3.VirtualHost, 0, len(idxs))
	for _, i := range idxs {
		s := u.services[i]
		if !s.local || s.ns == gi {
			out = append(out, s.vhost)
		}
	}
	return out
}

// Groups returns the node groups: "ns-0" … in order, then PublicGroup.
func (u *Upstream) Groups() []string { return slices.Clone(u.groups) }

// Snapshot returns what the upstream serves to group now: type URL → name →
// resource, consistent across types (a node of one of
// Scenario.InboundIPs also gets its inbound listener). The resources are
// shared with the caches and must not be modified. It returns nil for an
// unknown group.
func (u *Upstream) Snapshot(group string) map[string]map[string]proto.Message {
	gi, ok := u.groupIx[group]
	if !ok {
		return nil
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	out := make(map[string]map[string]proto.Message, numTypes)
	for t, lc := range u.caches[gi] {
		res := lc.GetResources()
		m := make(map[string]proto.Message, len(res))
		for name, r := range res {
			m[name] = r
		}
		out[typeURLs[t]] = m
	}
	return out
}

// Generation returns the generation of the latest mutation: every
// resource served now carries it or an older one, and every later change
// a larger one. Safe for concurrent use.
func (u *Upstream) Generation() uint64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.gen
}

func (u *Upstream) groupNames(groups []int) []string {
	out := make([]string, len(groups))
	for i, gi := range groups {
		out[i] = u.groups[gi]
	}
	return out
}

// nextMarker starts a mutation. Must hold mu.
func (u *Upstream) nextMarker() marker {
	u.gen++
	return newMarker(u.gen)
}

// publish updates (res != nil) or deletes resource name of type t in groups.
// Must hold mu.
func (u *Upstream) publish(t int, groups []int, name string, res types.Resource, mk marker) (Change, error) {
	var dr *deltaRes
	if u.cfg.IncrementalDelta && res != nil {
		var err error
		if dr, err = newDeltaRes(name, res); err != nil {
			return Change{}, err
		}
	}
	c := Change{TypeURL: typeURLs[t], Name: name, Generation: mk.gen, At: time.Now(), Groups: u.groupNames(groups)}
	if u.cfg.OnPublish != nil {
		u.cfg.OnPublish(c)
	}
	for _, gi := range groups {
		lc := u.caches[gi][t]
		var err error
		if res == nil {
			err = lc.DeleteResource(name)
		} else {
			err = lc.UpdateResource(name, res)
		}
		if err != nil {
			return c, fmt.Errorf("upstream: publish %s %s to %s: %w", typeURLs[t], name, u.groups[gi], err)
		}
		if u.deltas != nil {
			u.deltas[gi][t].set(name, dr)
		}
		if t != tLDS || u.inboundLDS == nil {
			continue
		}
		// The group's nodes of an inbound IP get its listeners too.
		for k, lc := range u.inboundLDS[gi] {
			if res == nil {
				err = lc.DeleteResource(name)
			} else {
				err = lc.UpdateResource(name, res)
			}
			if err != nil {
				return c, fmt.Errorf("upstream: publish %s %s to %s (%s): %w", typeURLs[t], name, u.groups[gi], u.sc.InboundIPs[k], err)
			}
			if u.inboundDeltas != nil {
				u.inboundDeltas[gi][k].set(name, dr)
			}
		}
	}
	u.stats.changes.Add(1)
	return c, nil
}

// publishRoutes rebuilds RouteConfiguration "<port>" for groups. Must hold mu.
func (u *Upstream) publishRoutes(port uint32, groups []int, mk marker) (Change, error) {
	name := routeName(port)
	c := Change{TypeURL: typeURLs[tRDS], Name: name, Generation: mk.gen, At: time.Now(), Groups: u.groupNames(groups)}
	if u.cfg.OnPublish != nil {
		u.cfg.OnPublish(c)
	}
	for _, gi := range groups {
		rc := u.sh.routeConfig(name, u.vhosts(gi, port), mk)
		if err := u.caches[gi][tRDS].UpdateResource(name, rc); err != nil {
			return c, fmt.Errorf("upstream: publish route %s to %s: %w", name, u.groups[gi], err)
		}
		if u.deltas != nil {
			dr, err := newDeltaRes(name, rc)
			if err != nil {
				return c, err
			}
			u.deltas[gi][tRDS].set(name, dr)
		}
	}
	u.stats.changes.Add(1)
	return c, nil
}

// MoveEndpoint gives WorkloadEntry i a new address. Its service's
// ClusterLoadAssignment changes, with a new generation, in every group that
// sees it. It returns ErrRemoved (wrapped) if the service was removed.
func (u *Upstream) MoveEndpoint(i int) (Change, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.moveEndpointLocked(i)
}

func (u *Upstream) moveEndpointLocked(i int) (Change, error) {
	if i < 0 || i >= len(u.workloads) {
		return Change{}, fmt.Errorf("upstream: move endpoint %d: out of range [0, %d)", i, len(u.workloads))
	}
	w := u.workloads[i]
	s := u.services[w.svc]
	if s.removed {
		return Change{}, fmt.Errorf("upstream: move endpoint %d: service %d: %w", i, w.svc, ErrRemoved)
	}
	mk := u.nextMarker()
	w.lb = u.sh.lbEndpoint(endpointIP(u.nextAddr), EndpointPort, mk)
	u.nextAddr++
	u.rebuildCLA(s, mk)
	return u.publish(tEDS, u.visibleGroups(s), s.name, s.cla, mk)
}

// AddService adds a ServiceEntry (with index Services, Services+1, … in
// order of addition) backed by one new WorkloadEntry. It publishes, in
// this order, the cluster, its ClusterLoadAssignment and the
// RouteConfiguration of its port (with the new virtual host), each in every
// group that sees the service.
func (u *Upstream) AddService() ([]Change, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.addServiceLocked()
}

func (u *Upstream) addServiceLocked() ([]Change, error) {
	mk := u.nextMarker()
	idx := len(u.services)
	s := u.newService(idx, mk)
	j := len(u.workloads)
	u.workloads = append(u.workloads, &workload{
		svc: idx,
		lb:  u.sh.lbEndpoint(endpointIP(u.nextAddr), EndpointPort, mk),
	})
	u.nextAddr++
	s.endpoints = []int{j}
	u.rebuildCLA(s, mk)
	u.services = append(u.services, s)
	u.byPort[s.port] = append(u.byPort[s.port], idx)

	groups := u.visibleGroups(s)
	changes := make([]Change, 0, 3)
	c, err := u.publish(tCDS, groups, s.name, s.cluster, mk)
	if err != nil {
		return changes, err
	}
	changes = append(changes, c)
	if c, err = u.publish(tEDS, groups, s.name, s.cla, mk); err != nil {
		return changes, err
	}
	changes = append(changes, c)
	if c, err = u.publishRoutes(s.port, groups, mk); err != nil {
		return changes, err
	}
	return append(changes, c), nil
}

// RemoveService removes ServiceEntry i: first the virtual host from the
// RouteConfiguration of its port, then its cluster and its
// ClusterLoadAssignment, in every group that saw it. Its WorkloadEntries
// stay, orphaned: MoveEndpoint on them returns ErrRemoved.
func (u *Upstream) RemoveService(i int) ([]Change, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.removeServiceLocked(i)
}

func (u *Upstream) removeServiceLocked(i int) ([]Change, error) {
	if i < 0 || i >= len(u.services) {
		return nil, fmt.Errorf("upstream: remove service %d: out of range [0, %d)", i, len(u.services))
	}
	s := u.services[i]
	if s.removed {
		return nil, fmt.Errorf("upstream: remove service %d: %w", i, ErrRemoved)
	}
	mk := u.nextMarker()
	s.removed = true
	if k, ok := slices.BinarySearch(u.byPort[s.port], i); ok {
		u.byPort[s.port] = slices.Delete(u.byPort[s.port], k, k+1)
	}
	groups := u.visibleGroups(s)
	changes := make([]Change, 0, 3)
	c, err := u.publishRoutes(s.port, groups, mk)
	if err != nil {
		return changes, err
	}
	changes = append(changes, c)
	if c, err = u.publish(tCDS, groups, s.name, nil, mk); err != nil {
		return changes, err
	}
	changes = append(changes, c)
	if c, err = u.publish(tEDS, groups, s.name, nil, mk); err != nil {
		return changes, err
	}
	s.cluster, s.cla, s.vhost = nil, nil, nil
	return append(changes, c), nil
}

// Start listens on cfg.Listen (or, after a Stop, on the address it listened
// on before) and serves ADS, SotW and Delta, with go-control-plane's servers
// in goroutines it owns. It does not block; ctx bounds only the start-up.
// Whoever calls Start must call Stop. Start on a started Upstream returns an
// error.
func (u *Upstream) Start(ctx context.Context) error {
	u.life.Lock()
	defer u.life.Unlock()
	if u.done != nil {
		return errors.New("upstream: already started")
	}
	addr := u.addr
	if addr == "" {
		addr = u.cfg.Listen
	}
	var lis net.Listener
	var err error
	if u.cfg.Listener != nil {
		lis, err = u.cfg.Listener()
	} else {
		var lc net.ListenConfig
		lis, err = lc.Listen(ctx, "tcp", addr)
	}
	if err != nil {
		return fmt.Errorf("upstream: listen %s: %w", addr, err)
	}
	u.addr = lis.Addr().String()

	srvCtx, cancel := context.WithCancel(context.Background())
	xl := xdsLogger{u.log}
	u.stats.mu.Lock()
	u.stats.serving++
	serving := u.stats.serving
	u.stats.mu.Unlock()
	cb := &callbacks{c: &u.stats, serving: serving, log: u.log}
	ads := &adsServer{
		sotw:  sotw.NewServer(srvCtx, u.mux, cb, sotw.WithOrderedADS(), sotw.WithLogger(xl)),
		delta: delta.NewServer(srvCtx, u.mux, cb, delta.WithLogger(xl)),
	}
	srv := grpc.NewServer(append([]grpc.ServerOption{
		grpc.MaxRecvMsgSize(u.cfg.MaxMsgSize),
		grpc.MaxSendMsgSize(u.cfg.MaxMsgSize),
		grpc.WaitForHandlers(true),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: time.Second, PermitWithoutStream: true}),
	}, u.cfg.ServerOptions...)...)
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, ads)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(lis); err != nil {
			u.log.Warn("upstream: serve ended", "addr", lis.Addr().String(), "err", err)
		}
	}()
	u.srv, u.cancel, u.done = srv, cancel, done
	u.log.Info("upstream: serving", "addr", u.addr)
	return nil
}

// Stop closes the listener and every stream at once, as a crashing istiod
// would, and returns after every goroutine Start started has exited. It is
// idempotent and returns nil. After Stop, Start serves the same content
// (same resources, generations and versions) on the same address. ctx is
// not needed: grpc's hard stop closes every connection, so it is bounded.
func (u *Upstream) Stop(_ context.Context) error {
	u.life.Lock()
	defer u.life.Unlock()
	if u.done == nil {
		return nil
	}
	u.srv.Stop() // closes connections, waits for handlers (WaitForHandlers)
	u.cancel()
	<-u.done
	u.srv, u.cancel, u.done = nil, nil, nil
	u.log.Info("upstream: stopped", "addr", u.addr)
	return nil
}

// Addr returns the address the upstream listens on, or listened on last;
// "" before the first Start.
func (u *Upstream) Addr() string {
	u.life.Lock()
	defer u.life.Unlock()
	return u.addr
}

// Stats returns the counters now.
func (u *Upstream) Stats() Stats {
	return Stats{
		OpenStreams:   u.stats.open.Load(),
		StreamsOpened: u.stats.opened.Load(),
		Requests:      u.stats.requests.Load(),
		Responses:     u.stats.responses.Load(),
		BytesSent:     u.stats.bytes.Load(),
		Changes:       u.stats.changes.Load(),
	}
}

// StreamsByNode returns, for every node id, the number of ADS streams open
// now whose first request presented that node (streams whose first
// request carried no node are not counted).
func (u *Upstream) StreamsByNode() map[string]int {
	u.stats.mu.Lock()
	defer u.stats.mu.Unlock()
	out := map[string]int{}
	for _, n := range u.stats.nodes {
		out[n]++
	}
	return out
}

// adsServer serves the AggregatedDiscoveryService with go-control-plane's
// SotW and Delta servers, as its pkg/server/v3 does. (pkg/server/v3 itself
// imports the separate ratelimit module, which this module does not
// require.)
type adsServer struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	sotw  sotw.Server
	delta delta.Server
}

func (a *adsServer) StreamAggregatedResources(s discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	return a.sotw.StreamHandler(s, resource.AnyType)
}

func (a *adsServer) DeltaAggregatedResources(s discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	return a.delta.DeltaStreamHandler(s, resource.AnyType)
}

type counters struct {
	// nodes maps each open stream to the node id its first request
	// carried; serving counts starts, as stream ids restart with each
	// server.
	mu      sync.Mutex
	nodes   map[streamKey]string
	serving uint64

	open      atomic.Int64
	opened    atomic.Uint64
	requests  atomic.Uint64
	responses atomic.Uint64
	bytes     atomic.Uint64
	changes   atomic.Uint64
}

// callbacks implements go-control-plane's sotw.Callbacks and
// delta.Callbacks. The servers call them synchronously on stream goroutines.
type callbacks struct {
	c       *counters
	serving uint64 // which Start this server belongs to
	log     *slog.Logger
}

var (
	_ sotw.Callbacks  = (*callbacks)(nil)
	_ delta.Callbacks = (*callbacks)(nil)
)

// streamKey names a stream across servers: the Start that served it,
// the kind of server, the server's stream id.
type streamKey struct {
	serving uint64
	delta   bool
	id      int64
}

// node records the node of a stream's first request.
func (cb *callbacks) node(delta bool, id int64, node *core.Node) {
	if node.GetId() == "" {
		return
	}
	cb.c.mu.Lock()
	defer cb.c.mu.Unlock()
	k := streamKey{cb.serving, delta, id}
	if _, ok := cb.c.nodes[k]; !ok {
		if cb.c.nodes == nil {
			cb.c.nodes = map[streamKey]string{}
		}
		cb.c.nodes[k] = node.GetId()
	}
}

func (cb *callbacks) forget(delta bool, id int64) {
	cb.c.mu.Lock()
	defer cb.c.mu.Unlock()
	delete(cb.c.nodes, streamKey{cb.serving, delta, id})
}

func (cb *callbacks) opened() {
	cb.c.open.Add(1)
	cb.c.opened.Add(1)
}

func (cb *callbacks) closed(id int64, node *core.Node) {
	cb.c.open.Add(-1)
	cb.log.Debug("upstream: stream closed", "stream", id, "node", node.GetId())
}

func (cb *callbacks) OnStreamOpen(context.Context, int64, string) error {
	cb.opened()
	return nil
}

func (cb *callbacks) OnStreamClosed(id int64, node *core.Node) {
	cb.forget(false, id)
	cb.closed(id, node)
}

func (cb *callbacks) OnStreamRequest(id int64, req *discovery.DiscoveryRequest) error {
	cb.node(false, id, req.GetNode())
	cb.c.requests.Add(1)
	return nil
}

func (cb *callbacks) OnStreamResponse(_ context.Context, _ int64, _ *discovery.DiscoveryRequest, resp *discovery.DiscoveryResponse) {
	cb.c.responses.Add(1)
	cb.c.bytes.Add(uint64(proto.Size(resp)))
}

func (cb *callbacks) OnDeltaStreamOpen(context.Context, int64, string) error {
	cb.opened()
	return nil
}

func (cb *callbacks) OnDeltaStreamClosed(id int64, node *core.Node) {
	cb.forget(true, id)
	cb.closed(id, node)
}

func (cb *callbacks) OnStreamDeltaRequest(id int64, req *discovery.DeltaDiscoveryRequest) error {
	cb.node(true, id, req.GetNode())
	cb.c.requests.Add(1)
	return nil
}

func (cb *callbacks) OnStreamDeltaResponse(_ int64, _ *discovery.DeltaDiscoveryRequest, resp *discovery.DeltaDiscoveryResponse) {
	cb.c.responses.Add(1)
	cb.c.bytes.Add(uint64(proto.Size(resp)))
}

// silentCache answers no request: a watch on a type the upstream does not
// serve stays open forever instead of failing the stream (a MuxCache without
// a cache for a key returns an error, which closes the whole ADS stream).
type silentCache struct{}

func (silentCache) CreateWatch(*cache.Request, cache.Subscription, chan cache.Response) (func(), error) {
	return func() {}, nil
}

func (silentCache) CreateDeltaWatch(*cache.DeltaRequest, cache.Subscription, chan cache.DeltaResponse) (func(), error) {
	return func() {}, nil
}

func (silentCache) Fetch(context.Context, *cache.Request) (cache.Response, error) {
	return nil, errors.New("upstream: fetch not supported")
}

// xdsLogger adapts slog to go-control-plane's logger. Its debug and info
// messages are dropped: they format whole subscriptions (30k names) per
// request.
type xdsLogger struct{ l *slog.Logger }

func (xdsLogger) Debugf(string, ...any) {}

func (xdsLogger) Infof(string, ...any) {}

func (x xdsLogger) Warnf(format string, args ...any) {
	x.l.Warn("go-control-plane: " + fmt.Sprintf(format, args...))
}

func (x xdsLogger) Errorf(format string, args ...any) {
	x.l.Error("go-control-plane: " + fmt.Sprintf(format, args...))
}
