package envoy

import (
	"errors"
	"fmt"
	"sync"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	route "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcm "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tcpproxy "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/anypb"
)

const (
	hcmType         = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
	tcpProxyType    = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"
	wrappedResource = "type.googleapis.com/envoy.service.discovery.v3.Resource"
)

// decoded is what the Envoy extracts from one resource.
type decoded struct {
	name    string
	version string     // Delta only
	body    *anypb.Any // nil: a heartbeat (TTL refresh) without body
	deps    []string   // names this resource subscribes to (EDS, RDS); shared, read only
	uses    []string   // clusters it uses directly; shared, read only
	gen     uint64
	hasGen  bool
	err     error  // the resource does not decode: NACK it
	hash    uint64 // contentHash of the body, if hashed
	hashed  bool
	refs    string // encodeRefs(deps, uses), if hashed (from a DecodeCache)
}

// decodeOptions says what decode must find out.
type decodeOptions struct {
	needName   bool // SotW: the name comes from the resource itself
	generation func(proto.Message) (uint64, bool)
	cache      *DecodeCache // nil: decode every resource
}

// DecodeCache remembers what decoding a resource found (its name, the
// names it refers to, its generation, or its error), by the hash of its
// bytes, so that the Envoys of a fleet that share it decode each content
// once, whichever relay sent it under whatever version: at 30,000
// clusters a thousand Envoys would otherwise decode 46 million resources
// to sync. Every Envoy sharing one must have the same Config.Generation.
// Safe for concurrent use; it holds at most maxDecoded entries (then it
// starts afresh).
type DecodeCache struct {
	mu sync.Mutex
	m  map[decodeKey]decoded
}

type decodeKey struct {
	kind     kind
	needName bool
	size     int
	hash     uint64
}

// maxDecoded bounds a DecodeCache.
const maxDecoded = 1 << 20

// NewDecodeCache returns an empty DecodeCache.
func NewDecodeCache() *DecodeCache { return &DecodeCache{m: map[decodeKey]decoded{}} }

func (c *DecodeCache) get(k decodeKey) (decoded, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	d, ok := c.m[k]
	return d, ok
}

func (c *DecodeCache) put(k decodeKey, d decoded) {
	d.body, d.version = nil, ""
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.m) >= maxDecoded {
		clear(c.m)
	}
	c.m[k] = d
}

// unwrapSotw handles SotW resources wrapped in discovery.Resource (used for
// TTLs): it returns the inner resource and the wrapper's name.
func unwrapSotw(a *anypb.Any) (inner *anypb.Any, wrapName string, wrapped bool, err error) {
	if a.GetTypeUrl() != wrappedResource {
		return a, "", false, nil
	}
	var r discovery.Resource
	if err := proto.Unmarshal(a.GetValue(), &r); err != nil {
		return nil, "", true, fmt.Errorf("decode wrapped resource: %w", err)
	}
	return r.GetResource(), r.GetName(), true, nil
}

// decode extracts the name, references and generation of one resource of
// kind k, from opt.cache if it holds them. It never panics on bad input.
func decode(k kind, a *anypb.Any, opt decodeOptions) decoded {
	if opt.cache == nil {
		return decodeBody(k, a, opt)
	}
	h := contentHash(a.GetValue())
	key := decodeKey{kind: k, needName: opt.needName, size: len(a.GetValue()), hash: h}
	d, ok := opt.cache.get(key)
	if !ok {
		d = decodeBody(k, a, opt)
		d.refs = encodeRefs(d.deps, d.uses)
		opt.cache.put(key, d)
	}
	d.body, d.hash, d.hashed = a, h, true
	return d
}

// decodeBody is decode without a cache.
func decodeBody(k kind, a *anypb.Any, opt decodeOptions) decoded {
	var d decoded
	d.body = a
	var msg proto.Message
	switch k {
	case kindCluster:
		var c cluster.Cluster
		if err := proto.Unmarshal(a.GetValue(), &c); err != nil {
			d.err = fmt.Errorf("decode cluster: %w", err)
			return d
		}
		d.name = c.GetName()
		if c.GetType() == cluster.Cluster_EDS {
			svc := c.GetEdsClusterConfig().GetServiceName()
			if svc == "" {
				svc = c.GetName()
			}
			d.deps = []string{svc}
		}
		msg = &c
	case kindListener:
		var l listener.Listener
		if err := proto.Unmarshal(a.GetValue(), &l); err != nil {
			d.err = fmt.Errorf("decode listener: %w", err)
			return d
		}
		d.name = l.GetName()
		if err := listenerRefs(&l, &d); err != nil {
			d.err = fmt.Errorf("listener %q: %w", l.GetName(), err)
			return d
		}
		msg = &l
	case kindRoute:
		var r route.RouteConfiguration
		if err := proto.Unmarshal(a.GetValue(), &r); err != nil {
			d.err = fmt.Errorf("decode route configuration: %w", err)
			return d
		}
		d.name = r.GetName()
		d.uses = routeClusters(&r, nil)
		msg = &r
	case kindEndpoint:
		if !opt.needName && opt.generation == nil {
			return d
		}
		var c endpoint.ClusterLoadAssignment
		if err := proto.Unmarshal(a.GetValue(), &c); err != nil {
			d.err = fmt.Errorf("decode cluster load assignment: %w", err)
			return d
		}
		d.name = c.GetClusterName()
		msg = &c
	default:
		if !opt.needName && opt.generation == nil {
			return d
		}
		m, err := anypb.UnmarshalNew(a, proto.UnmarshalOptions{})
		if errors.Is(err, protoregistry.NotFound) {
			return d // a type this binary does not know: no name, no generation
		}
		if err != nil {
			d.err = fmt.Errorf("decode %s: %w", a.GetTypeUrl(), err)
			return d
		}
		d.name = nameField(m)
		msg = m
	}
	if opt.generation != nil {
		d.gen, d.hasGen = opt.generation(msg)
	}
	return d
}

// nameField returns the string field "name" (or "cluster_name") of m.
func nameField(m proto.Message) string {
	r := m.ProtoReflect()
	fields := r.Descriptor().Fields()
	for _, fn := range []protoreflect.Name{"name", "cluster_name"} {
		if f := fields.ByName(fn); f != nil && f.Kind() == protoreflect.StringKind && f.Cardinality() != protoreflect.Repeated {
			return r.Get(f).String()
		}
	}
	return ""
}

// listenerRefs collects the RDS names and the clusters a listener uses.
func listenerRefs(l *listener.Listener, d *decoded) error {
	chains := l.GetFilterChains()
	if dc := l.GetDefaultFilterChain(); dc != nil {
		chains = append(chains[:len(chains):len(chains)], dc)
	}
	for _, fc := range chains {
		for _, f := range fc.GetFilters() {
			if err := filterRefs(f.GetTypedConfig(), d); err != nil {
				return fmt.Errorf("filter %q: %w", f.GetName(), err)
			}
		}
	}
	if api := l.GetApiListener().GetApiListener(); api != nil {
		if err := filterRefs(api, d); err != nil {
			return fmt.Errorf("api_listener: %w", err)
		}
	}
	return nil
}

func filterRefs(tc *anypb.Any, d *decoded) error {
	switch tc.GetTypeUrl() {
	case hcmType:
		var h hcm.HttpConnectionManager
		if err := proto.Unmarshal(tc.GetValue(), &h); err != nil {
			return fmt.Errorf("decode http_connection_manager: %w", err)
		}
		if n := h.GetRds().GetRouteConfigName(); n != "" {
			d.deps = append(d.deps, n)
		}
		if rc := h.GetRouteConfig(); rc != nil {
			d.uses = routeClusters(rc, d.uses)
		}
	case tcpProxyType:
		var t tcpproxy.TcpProxy
		if err := proto.Unmarshal(tc.GetValue(), &t); err != nil {
			return fmt.Errorf("decode tcp_proxy: %w", err)
		}
		if c := t.GetCluster(); c != "" {
			d.uses = append(d.uses, c)
		}
		for _, w := range t.GetWeightedClusters().GetClusters() {
			d.uses = append(d.uses, w.GetName())
		}
	}
	return nil
}

// routeClusters appends the clusters a route configuration names
// (cluster_header and cluster_specifier_plugin are resolved at request time
// and are not checked).
func routeClusters(rc *route.RouteConfiguration, out []string) []string {
	for _, vh := range rc.GetVirtualHosts() {
		for _, r := range vh.GetRoutes() {
			a := r.GetRoute()
			if a == nil {
				continue
			}
			if c := a.GetCluster(); c != "" {
				out = append(out, c)
			}
			for _, w := range a.GetWeightedClusters().GetClusters() {
				out = append(out, w.GetName())
			}
			for _, m := range a.GetRequestMirrorPolicies() {
				if c := m.GetCluster(); c != "" {
					out = append(out, c)
				}
			}
		}
	}
	return out
}
