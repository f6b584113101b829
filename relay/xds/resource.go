package xds

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"weak"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	route "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcm "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tcpproxy "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	tls "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	runtimev3 "github.com/envoyproxy/go-control-plane/envoy/service/runtime/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	meshv1alpha1 "istio.io/api/mesh/v1alpha1"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds/ndspb"
)

// Resource is one xDS resource as the upstream sent it. It is immutable and
// shared: every key view and every stream that holds the same content holds
// the same *Resource, and its body is the upstream's bytes, never marshalled
// again.
type Resource struct {
	Type string
	Name string
	// Hash is the content address: SHA-256 over the type URL and the
	// serialized resource. Its String form is the resource's xDS version.
	Hash ledger.Hash
	// Body is the resource as sent on the wire. Never modify it.
	Body *anypb.Any

	refs refs
}

// refs are the names a resource points at, which the relay needs to follow
// dependencies the way Envoy does: a cluster needs its endpoints, a listener
// its route configurations, and routes point at clusters.
type refs struct {
	endpoints []string // EDS names (from a Cluster)
	routes    []string // RDS names (from a Listener or a ScopedRouteConfiguration)
	clusters  []string // cluster names (from routes and tcp_proxy filters)
}

// Size returns the size of the resource body in bytes.
func (r *Resource) Size() int { return len(r.Body.GetValue()) }

// ContentHash is the content address of a serialized resource of typeURL.
func ContentHash(typeURL string, value []byte) ledger.Hash {
	d := sha256.New()
	d.Write([]byte(typeURL))
	d.Write([]byte{0})
	d.Write(value)
	var h ledger.Hash
	d.Sum(h[:0])
	return h
}

// Store interns resources by content so that each distinct resource is held
// once, whatever the number of keys and streams that refer to it. Entries go
// away by themselves once nothing refers to the resource: the map holds weak
// pointers and a cleanup removes the entry.
//
// A Store is safe for concurrent use.
type Store struct {
	mu sync.Mutex
	m  map[ledger.Hash]weak.Pointer[Resource]
}

func NewStore() *Store { return &Store{m: make(map[ledger.Hash]weak.Pointer[Resource])} }

func (s *Store) Lookup(h ledger.Hash) *Resource {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.m[h].Value()
}

// Intern returns the resource already held for r's content, or r.
func (s *Store) Intern(r *Resource) *Resource {
	s.mu.Lock()
	defer s.mu.Unlock()
	if have := s.m[r.Hash].Value(); have != nil {
		return have
	}
	s.m[r.Hash] = weak.Make(r)
	runtime.AddCleanup(r, s.forget, r.Hash)
	return r
}

func (s *Store) forget(h ledger.Hash) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if wp, ok := s.m[h]; ok && wp.Value() == nil {
		delete(s.m, h)
	}
}

// Dropped keeps alive, within a byte budget, the resources the relay's
// views Dropped most recently (removed, or replaced by new content): the
// store holds a resource only while something refers to it, and the key
// histories keep names and hashes alone. An Envoy that moved here (or to a
// relay that asks this one) and holds a version a few changes old still
// holds those resources; a full-state response must carry those its routes
// still use until the routes change (make-before-break), so the relay
// needs their bodies. The oldest go first once the budget is spent.
//
// A Dropped is safe for concurrent use.
type Dropped struct {
	mu     sync.Mutex
	q      []*Resource // oldest first, from q[head]
	head   int
	bytes  int64
	budget int64
}

// NewDropped returns a dropped that keeps up to budget bytes (none if
// budget is not positive).
func NewDropped(budget int64) *Dropped { return &Dropped{budget: budget} }

// Keep adds rs, newest last, and lets the oldest go beyond the budget.
func (d *Dropped) Keep(rs []*Resource) {
	if d.budget <= 0 || len(rs) == 0 {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, r := range rs {
		if r == nil {
			continue
		}
		d.q = append(d.q, r)
		d.bytes += int64(r.Size())
	}
	for d.bytes > d.budget && d.head < len(d.q) {
		d.bytes -= int64(d.q[d.head].Size())
		d.q[d.head] = nil
		d.head++
	}
	if d.head > len(d.q)/2 {
		d.q = append(d.q[:0:0], d.q[d.head:]...)
		d.head = 0
	}
}

// Held returns how many resources and bytes d keeps alive.
func (d *Dropped) Held() (n int, bytes int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.q) - d.head, d.bytes
}

// Len returns the number of distinct resources held (including some whose
// last reference has just gone and which the next GC will drop).
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.m)
}

var errNoName = errors.New("relay: resource has no name")

// Any is a google.protobuf.Any: *anypb.Any, or one read lazily off the
// wire (its value may alias a buffer the caller frees later).
type Any interface {
	GetTypeUrl() string
	GetValue() []byte
}

// Decode turns a resource received from the upstream into a Resource. The
// input is untrusted: a type mismatch, bytes that do not parse, or a missing
// or (for Delta) mismatched name is an error and the caller NACKs. Content
// the store already holds is not parsed again, nor copied: the value is
// copied only into a new Resource, so it may alias a buffer the caller
// frees once Decode returns.
func (s *Store) Decode(typeURL string, a Any, wantName string) (*Resource, error) {
	return s.decode(typeURL, a, wantName, bytes.Clone)
}

// decode is Decode, keeping the value of new content as own makes it
// (a copy, or the value itself when the caller owns it).
func (s *Store) decode(typeURL string, a Any, wantName string, own func([]byte) []byte) (*Resource, error) {
	if a == nil || a.GetTypeUrl() == "" && a.GetValue() == nil {
		return nil, errors.New("relay: empty resource")
	}
	if a.GetTypeUrl() != typeURL {
		return nil, fmt.Errorf("relay: resource of type %s in a %s response", a.GetTypeUrl(), typeURL)
	}
	if Singleton(typeURL) {
		// Unnamed, or named anyhow (istiod's Delta names it ""): the
		// relay's one name for it.
		wantName = SingletonName
	}
	h := ContentHash(typeURL, a.GetValue())
	if r := s.Lookup(h); r != nil {
		if wantName != "" && r.Name != wantName {
			return nil, fmt.Errorf("relay: resource named %q carries %q", wantName, r.Name)
		}
		return r, nil
	}
	msg, err := newMessage(typeURL)
	if err != nil {
		return nil, err
	}
	if err := proto.Unmarshal(a.GetValue(), msg); err != nil {
		return nil, fmt.Errorf("relay: decode %s: %w", ShortType(typeURL), err)
	}
	name := nameOf(msg)
	if Singleton(typeURL) {
		name = SingletonName
	}
	if name == "" {
		return nil, errNoName
	}
	if wantName != "" && name != wantName {
		return nil, fmt.Errorf("relay: resource named %q carries %q", wantName, name)
	}
	r := &Resource{
		Type: typeURL,
		Name: name,
		Hash: h,
		Body: &anypb.Any{TypeUrl: typeURL, Value: own(a.GetValue())},
		refs: refsOf(msg),
	}
	return s.Intern(r), nil
}

// hasRefs reports whether resources of typeURL refer to others (TypeRefs;
// refsOf reads them).
func hasRefs(typeURL string) bool { return len(RefsFrom(typeURL)) > 0 }

// Restore turns a persisted resource into a Resource. Only types that refer
// to others are parsed (for their references); the others are taken as
// named, since the caller checks every (name, content hash) against a
// Merkle root the owner computed from what its upstream sent. The body is
// kept, not copied: the caller hands it over and must not change it.
func (s *Store) Restore(typeURL, name string, body []byte) (*Resource, error) {
	if hasRefs(typeURL) {
		return s.decode(typeURL, &anypb.Any{TypeUrl: typeURL, Value: body}, name, func(b []byte) []byte { return b })
	}
	if name == "" {
		return nil, errNoName
	}
	h := ContentHash(typeURL, body)
	if r := s.Lookup(h); r != nil {
		if r.Name != name {
			return nil, fmt.Errorf("relay: resource named %q carries %q", name, r.Name)
		}
		return r, nil
	}
	return s.Intern(&Resource{Type: typeURL, Name: name, Hash: h, Body: &anypb.Any{TypeUrl: typeURL, Value: body}}), nil
}

func newMessage(typeURL string) (proto.Message, error) {
	switch typeURL {
	case TypeCluster:
		return &cluster.Cluster{}, nil
	case TypeEndpoint:
		return &endpoint.ClusterLoadAssignment{}, nil
	case TypeListener:
		return &listener.Listener{}, nil
	case TypeRoute:
		return &route.RouteConfiguration{}, nil
	case TypeScopedRoute:
		return &route.ScopedRouteConfiguration{}, nil
	case TypeSecret:
		return &tls.Secret{}, nil
	case TypeRuntime:
		return &runtimev3.Runtime{}, nil
	case TypeExtension:
		return &core.TypedExtensionConfig{}, nil
	case TypeNameTable:
		return &ndspb.NameTable{}, nil
	case TypeProxyConfig:
		return &meshv1alpha1.ProxyConfig{}, nil
	}
	return nil, fmt.Errorf("relay: type %s is not cached", typeURL)
}

func nameOf(m proto.Message) string {
	switch v := m.(type) {
	case *endpoint.ClusterLoadAssignment:
		return v.GetClusterName()
	case interface{ GetName() string }:
		return v.GetName()
	}
	return ""
}

func refsOf(m proto.Message) refs {
	var r refs
	switch v := m.(type) {
	case *cluster.Cluster:
		if v.GetType() == cluster.Cluster_EDS {
			name := v.GetEdsClusterConfig().GetServiceName()
			if name == "" {
				name = v.GetName()
			}
			r.endpoints = []string{name}
		}
	case *listener.Listener:
		chains := v.GetFilterChains()
		if d := v.GetDefaultFilterChain(); d != nil {
			chains = append(chains[:len(chains):len(chains)], d)
		}
		for _, fc := range chains {
			for _, f := range fc.GetFilters() {
				r.addFilter(f.GetTypedConfig())
			}
		}
		r.addFilter(v.GetApiListener().GetApiListener())
	case *route.RouteConfiguration:
		r.addRouteConfig(v)
	case *route.ScopedRouteConfiguration:
		r.routes = appendNew(nil, v.GetRouteConfigurationName())
	}
	return r
}

// addFilter records what an HTTP connection manager or tcp_proxy filter
// config points at. Other filters, and configs that do not parse, point at
// nothing the relay follows.
func (r *refs) addFilter(a *anypb.Any) {
	if a == nil {
		return
	}
	switch a.GetTypeUrl() {
	case "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager":
		var m hcm.HttpConnectionManager
		if a.UnmarshalTo(&m) != nil {
			return
		}
		if n := m.GetRds().GetRouteConfigName(); n != "" {
			r.routes = appendNew(r.routes, n)
		}
		for _, s := range m.GetScopedRoutes().GetScopedRouteConfigurationsList().GetScopedRouteConfigurations() {
			r.routes = appendNew(r.routes, s.GetRouteConfigurationName())
		}
		if rc := m.GetRouteConfig(); rc != nil {
			r.addRouteConfig(rc)
		}
	case "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy":
		var m tcpproxy.TcpProxy
		if a.UnmarshalTo(&m) != nil {
			return
		}
		if c := m.GetCluster(); c != "" {
			r.clusters = appendNew(r.clusters, c)
		}
		for _, w := range m.GetWeightedClusters().GetClusters() {
			r.clusters = appendNew(r.clusters, w.GetName())
		}
	}
}

func (r *refs) addRouteConfig(rc *route.RouteConfiguration) {
	seen := make(map[string]struct{}, len(r.clusters))
	for _, c := range r.clusters {
		seen[c] = struct{}{}
	}
	add := func(name string) {
		if _, ok := seen[name]; name != "" && !ok {
			seen[name] = struct{}{}
			r.clusters = append(r.clusters, name)
		}
	}
	for _, vh := range rc.GetVirtualHosts() {
		for _, rt := range vh.GetRoutes() {
			a := rt.GetRoute()
			add(a.GetCluster())
			for _, w := range a.GetWeightedClusters().GetClusters() {
				add(w.GetName())
			}
		}
	}
}

// appendNew appends v unless it is empty or already there.
func appendNew(s []string, v string) []string {
	if v == "" {
		return s
	}
	for _, have := range s {
		if have == v {
			return s
		}
	}
	return append(s, v)
}
