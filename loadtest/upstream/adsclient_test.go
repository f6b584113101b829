package upstream_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// waitTimeout bounds every wait for a response; generous for -race on two
// cores.
const waitTimeout = 30 * time.Second

// update is one decoded response.
type update struct {
	TypeURL   string
	Resources map[string]proto.Message
	Removed   []string // Delta: removed_resources; SotW CDS/LDS: names missing from the full state
}

func (u update) names() []string { return sortedKeys(u.Resources) }

// adsClient is a fake xDS client over a real gRPC ADS stream. It keeps the
// state it was sent and checks protocol rules as it goes: response and
// resource type URLs match, nonces are never reused, and a resource's
// Generation never goes back.
type adsClient interface {
	// Subscribe sets the names wanted for typeURL (nil: wildcard) and, if
	// want is true, waits for the response, ACKs it and returns it.
	Subscribe(typeURL string, names []string, want bool) update
	// Next waits for the next response of typeURL, ACKs it and returns it.
	Next(typeURL string) update
	// NextAny waits for the next response of any type, ACKs it and returns it.
	NextAny() update
	// State returns a copy of the state received: type URL → name → resource.
	State() map[string]map[string]proto.Message
	// WaitClosed waits for the stream to end and returns its error.
	WaitClosed() error
	// SendRaw subscribes to names of typeURL without waiting for an answer.
	SendRaw(typeURL string, names []string)
	// Received returns the number of responses handled and the sum of
	// their proto.Size.
	Received() (responses, bytes int)
	// Settle returns once the server has processed every request sent so
	// far, so every type ACKed before has an open watch again (a response
	// to a later request proves it: a stream's requests are handled in
	// order). It costs one EDS round trip; EDS must be subscribed.
	Settle()
}

// stream is the part common to both protocols: a receive goroutine feeding
// a FIFO of responses, and the checks.
type stream[Resp any] struct {
	t      *testing.T
	recv   chan Resp
	errc   chan error
	fifo   []Resp
	nonces map[string]bool
	gens   map[string]uint64 // type|name → last generation
	state  map[string]map[string]proto.Message
	count  int // responses handled
	bytes  int // sum of proto.Size of responses handled
}

func newStream[Resp any](t *testing.T) *stream[Resp] {
	return &stream[Resp]{
		t:      t,
		recv:   make(chan Resp, 64),
		errc:   make(chan error, 1),
		nonces: make(map[string]bool),
		gens:   make(map[string]uint64),
		state:  make(map[string]map[string]proto.Message),
	}
}

// pump runs Recv until it fails; start it with go and wait on errc.
func (s *stream[Resp]) pump(ctx context.Context, recv func() (Resp, error)) {
	for {
		r, err := recv()
		if err != nil {
			s.errc <- err
			return
		}
		select {
		case s.recv <- r:
		case <-ctx.Done():
			s.errc <- ctx.Err()
			return
		}
	}
}

// next returns the first queued or arriving response for which match holds.
func (s *stream[Resp]) next(what string, match func(Resp) bool) Resp {
	s.t.Helper()
	for i, r := range s.fifo {
		if match(r) {
			s.fifo = slices.Delete(s.fifo, i, i+1)
			return r
		}
	}
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	for {
		select {
		case r := <-s.recv:
			if match(r) {
				return r
			}
			s.fifo = append(s.fifo, r)
		case err := <-s.errc:
			s.errc <- err
			s.t.Fatalf("waiting for %s: stream ended: %v", what, err)
		case <-timer.C:
			s.t.Fatalf("waiting for %s: no response within %v", what, waitTimeout)
		}
	}
}

func (s *stream[Resp]) waitClosed() error {
	s.t.Helper()
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	for {
		select {
		case <-s.recv:
		case err := <-s.errc:
			s.errc <- err
			return err
		case <-timer.C:
			s.t.Fatalf("stream still open after %v", waitTimeout)
		}
	}
}

func (s *stream[Resp]) checkNonce(nonce string) {
	s.t.Helper()
	if nonce == "" || s.nonces[nonce] {
		s.t.Fatalf("response nonce %q empty or reused", nonce)
	}
	s.nonces[nonce] = true
}

// apply decodes resources into the state and checks generations.
func (s *stream[Resp]) apply(typeURL string, anys []*anypb.Any, fullState bool, removed []string) update {
	s.t.Helper()
	u := update{TypeURL: typeURL, Resources: make(map[string]proto.Message, len(anys)), Removed: removed}
	for _, a := range anys {
		if a.GetTypeUrl() != typeURL {
			s.t.Fatalf("resource type %q in a %q response", a.GetTypeUrl(), typeURL)
		}
		m, err := a.UnmarshalNew()
		if err != nil {
			s.t.Fatalf("decode %s: %v", typeURL, err)
		}
		name := cache.GetResourceName(m)
		if v, ok := m.(interface{ ValidateAll() error }); !ok {
			s.t.Fatalf("%s %s has no ValidateAll", typeURL, name)
		} else if err := v.ValidateAll(); err != nil {
			s.t.Fatalf("%s %s fails Envoy's proto validation: %v", typeURL, name, err)
		}
		gen, ok := upstream.Generation(m)
		if !ok {
			s.t.Fatalf("Generation(%s %s) found none", typeURL, name)
		}
		key := typeURL + "|" + name
		if last := s.gens[key]; gen < last {
			s.t.Fatalf("Generation(%s %s) = %d, went back from %d", typeURL, name, gen, last)
		}
		s.gens[key] = gen
		u.Resources[name] = m
	}
	st := s.state[typeURL]
	if st == nil || fullState {
		if fullState {
			for name := range st {
				if _, ok := u.Resources[name]; !ok {
					u.Removed = append(u.Removed, name)
				}
			}
		}
		st = make(map[string]proto.Message, len(u.Resources))
		s.state[typeURL] = st
	}
	for name, m := range u.Resources {
		st[name] = m
	}
	for _, name := range u.Removed {
		delete(st, name)
	}
	sort.Strings(u.Removed)
	return u
}

func (s *stream[Resp]) Received() (responses, bytes int) { return s.count, s.bytes }

func (s *stream[Resp]) copyState() map[string]map[string]proto.Message {
	out := make(map[string]map[string]proto.Message, len(s.state))
	for t, m := range s.state {
		cp := make(map[string]proto.Message, len(m))
		for k, v := range m {
			cp[k] = v
		}
		out[t] = cp
	}
	return out
}

// dial connects to addr; the connection is closed at cleanup.
func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(upstream.DefaultMaxMsgSize)),
	)
	if err != nil {
		t.Fatalf("grpc.NewClient(%q): %v", addr, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// startStream opens a stream with open and runs its receive goroutine until
// cleanup, which cancels the stream and waits for the goroutine.
func startStream[Resp any](t *testing.T, s *stream[Resp], open func(ctx context.Context) (func() (Resp, error), error)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	recv, err := open(ctx)
	if err != nil {
		cancel()
		t.Fatalf("open stream: %v", err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.pump(ctx, recv)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

// sotwClient speaks SotW ADS.
type sotwClient struct {
	*stream[*discovery.DiscoveryResponse]
	str       discovery.AggregatedDiscoveryService_StreamAggregatedResourcesClient
	node      *core.Node
	sentNode  bool
	names     map[string][]string // per type, nil for wildcard
	lastNonce map[string]string
}

func newSotwClient(t *testing.T, conn *grpc.ClientConn, node *core.Node) *sotwClient {
	t.Helper()
	c := &sotwClient{
		stream:    newStream[*discovery.DiscoveryResponse](t),
		node:      node,
		names:     make(map[string][]string),
		lastNonce: make(map[string]string),
	}
	startStream(t, c.stream, func(ctx context.Context) (func() (*discovery.DiscoveryResponse, error), error) {
		str, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
		c.str = str
		return func() (*discovery.DiscoveryResponse, error) { return str.Recv() }, err
	})
	return c
}

func (c *sotwClient) send(typeURL string, names []string, version, nonce string) {
	c.t.Helper()
	req := &discovery.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: names, VersionInfo: version, ResponseNonce: nonce}
	if !c.sentNode {
		req.Node, c.sentNode = c.node, true
	}
	if err := c.str.Send(req); err != nil {
		c.t.Fatalf("send %s request: %v", typeURL, err)
	}
}

// SendRaw sends a request for a type without waiting; for types the test
// does not expect answered.
func (c *sotwClient) SendRaw(typeURL string, names []string) { c.send(typeURL, names, "", "") }

func (c *sotwClient) Subscribe(typeURL string, names []string, want bool) update {
	c.t.Helper()
	c.names[typeURL] = slices.Clone(names)
	c.send(typeURL, names, "", c.lastNonce[typeURL])
	if !want {
		return update{}
	}
	return c.Next(typeURL)
}

func (c *sotwClient) handle(r *discovery.DiscoveryResponse) update {
	c.t.Helper()
	c.checkNonce(r.GetNonce())
	c.count++
	c.bytes += proto.Size(r)
	c.lastNonce[r.GetTypeUrl()] = r.GetNonce()
	full := r.GetTypeUrl() == resource.ClusterType || r.GetTypeUrl() == resource.ListenerType
	u := c.apply(r.GetTypeUrl(), r.GetResources(), full, nil)
	c.send(r.GetTypeUrl(), c.names[r.GetTypeUrl()], r.GetVersionInfo(), r.GetNonce()) // ACK
	return u
}

func (c *sotwClient) Next(typeURL string) update {
	c.t.Helper()
	return c.handle(c.next(typeURL, func(r *discovery.DiscoveryResponse) bool { return r.GetTypeUrl() == typeURL }))
}

func (c *sotwClient) NextAny() update {
	c.t.Helper()
	return c.handle(c.next("any response", func(*discovery.DiscoveryResponse) bool { return true }))
}

// Settle re-requests EDS with an empty version, which the server always
// answers (with no resources when nothing changed).
func (c *sotwClient) Settle() {
	c.t.Helper()
	c.send(resource.EndpointType, c.names[resource.EndpointType], "", c.lastNonce[resource.EndpointType])
	c.Next(resource.EndpointType)
}

func (c *sotwClient) State() map[string]map[string]proto.Message { return c.copyState() }

func (c *sotwClient) WaitClosed() error { return c.waitClosed() }

// deltaClient speaks Delta ADS.
type deltaClient struct {
	*stream[*discovery.DeltaDiscoveryResponse]
	str      discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	node     *core.Node
	sentNode bool
	subs     map[string]map[string]bool // per type; nil entry: not subscribed yet
	versions map[string]string          // type|name → last resource version
}

func newDeltaClient(t *testing.T, conn *grpc.ClientConn, node *core.Node) *deltaClient {
	t.Helper()
	c := &deltaClient{
		stream:   newStream[*discovery.DeltaDiscoveryResponse](t),
		node:     node,
		subs:     make(map[string]map[string]bool),
		versions: make(map[string]string),
	}
	startStream(t, c.stream, func(ctx context.Context) (func() (*discovery.DeltaDiscoveryResponse, error), error) {
		str, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
		c.str = str
		return func() (*discovery.DeltaDiscoveryResponse, error) { return str.Recv() }, err
	})
	return c
}

func (c *deltaClient) send(req *discovery.DeltaDiscoveryRequest) {
	c.t.Helper()
	if !c.sentNode {
		req.Node, c.sentNode = c.node, true
	}
	if err := c.str.Send(req); err != nil {
		c.t.Fatalf("send %s delta request: %v", req.GetTypeUrl(), err)
	}
}

// SendRaw subscribes to names of typeURL without waiting.
func (c *deltaClient) SendRaw(typeURL string, names []string) {
	c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesSubscribe: names})
}

// Versions returns the resource versions received for typeURL.
func (c *deltaClient) Versions(typeURL string) map[string]string {
	out := map[string]string{}
	for k, v := range c.versions {
		if t, name, _ := strings.Cut(k, "|"); t == typeURL {
			out[name] = v
		}
	}
	return out
}

// Subscribe: nil names is the legacy wildcard on the first request of a
// type; later calls subscribe and unsubscribe the difference.
func (c *deltaClient) Subscribe(typeURL string, names []string, want bool) update {
	c.t.Helper()
	cur, known := c.subs[typeURL]
	req := &discovery.DeltaDiscoveryRequest{TypeUrl: typeURL}
	next := make(map[string]bool, len(names))
	for _, n := range names {
		next[n] = true
		if !cur[n] {
			req.ResourceNamesSubscribe = append(req.ResourceNamesSubscribe, n)
		}
	}
	for n := range cur {
		if !next[n] {
			req.ResourceNamesUnsubscribe = append(req.ResourceNamesUnsubscribe, n)
		}
	}
	if known && len(req.ResourceNamesSubscribe) == 0 && len(req.ResourceNamesUnsubscribe) == 0 {
		c.t.Fatalf("Subscribe(%s): no change", typeURL)
	}
	c.subs[typeURL] = next
	c.send(req)
	if !want {
		return update{}
	}
	return c.Next(typeURL)
}

func (c *deltaClient) handle(r *discovery.DeltaDiscoveryResponse) update {
	c.t.Helper()
	c.checkNonce(r.GetNonce())
	c.count++
	c.bytes += proto.Size(r)
	for _, res := range r.GetResources() {
		c.versions[r.GetTypeUrl()+"|"+res.GetName()] = res.GetVersion()
	}
	anys := make([]*anypb.Any, 0, len(r.GetResources()))
	for _, res := range r.GetResources() {
		if res.GetVersion() == "" {
			c.t.Fatalf("delta resource %s without version", res.GetName())
		}
		anys = append(anys, res.GetResource())
	}
	u := c.apply(r.GetTypeUrl(), anys, false, slices.Clone(r.GetRemovedResources()))
	for _, res := range r.GetResources() {
		if _, ok := u.Resources[res.GetName()]; !ok {
			c.t.Fatalf("delta resource named %q holds another resource", res.GetName())
		}
	}
	c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: r.GetTypeUrl(), ResponseNonce: r.GetNonce()}) // ACK
	return u
}

func (c *deltaClient) Next(typeURL string) update {
	c.t.Helper()
	return c.handle(c.next(typeURL, func(r *discovery.DeltaDiscoveryResponse) bool { return r.GetTypeUrl() == typeURL }))
}

func (c *deltaClient) NextAny() update {
	c.t.Helper()
	return c.handle(c.next("any delta response", func(*discovery.DeltaDiscoveryResponse) bool { return true }))
}

// Settle unsubscribes and resubscribes one EDS name, which the server
// answers with that resource.
func (c *deltaClient) Settle() {
	c.t.Helper()
	names := sortedKeys(c.subs[resource.EndpointType])
	if len(names) == 0 {
		c.t.Fatalf("Settle: EDS not subscribed")
	}
	c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNamesUnsubscribe: names[:1]})
	c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.EndpointType, ResourceNamesSubscribe: names[:1]})
	if got := c.Next(resource.EndpointType); !slices.Equal(got.names(), names[:1]) {
		c.t.Fatalf("Settle: EDS response = %v, want %v", got.names(), names[:1])
	}
}

func (c *deltaClient) State() map[string]map[string]proto.Message { return c.copyState() }

func (c *deltaClient) WaitClosed() error { return c.waitClosed() }

// protocol opens a client of one xDS variant.
type protocol struct {
	name string
	open func(t *testing.T, conn *grpc.ClientConn, node *core.Node) adsClient
}

var protocols = []protocol{
	{"sotw", func(t *testing.T, conn *grpc.ClientConn, node *core.Node) adsClient {
		return newSotwClient(t, conn, node)
	}},
	{"delta", func(t *testing.T, conn *grpc.ClientConn, node *core.Node) adsClient {
		return newDeltaClient(t, conn, node)
	}},
}

// syncAll subscribes like Envoy: CDS (wildcard), EDS for the clusters, LDS
// (wildcard), RDS for the listeners' routes, and returns the state.
func syncAll(t *testing.T, c adsClient) map[string]map[string]proto.Message {
	t.Helper()
	cds := c.Subscribe(resource.ClusterType, nil, true)
	c.Subscribe(resource.EndpointType, edsNames(t, cds.Resources), true)
	lds := c.Subscribe(resource.ListenerType, nil, true)
	c.Subscribe(resource.RouteType, rdsNames(t, lds.Resources), true)
	return c.State()
}

func edsNames(t *testing.T, clusters map[string]proto.Message) []string {
	t.Helper()
	var out []string
	for name, m := range clusters {
		c, ok := m.(*clusterv3.Cluster)
		if !ok {
			t.Fatalf("CDS resource %s is a %T", name, m)
		}
		if c.GetType() != clusterv3.Cluster_EDS {
			continue
		}
		n := c.GetEdsClusterConfig().GetServiceName()
		if n == "" {
			n = c.GetName()
		}
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func rdsNames(t *testing.T, listeners map[string]proto.Message) []string {
	t.Helper()
	seen := map[string]bool{}
	for name, m := range listeners {
		hcm, err := listenerHCM(m.(*listenerv3.Listener))
		if err != nil {
			t.Fatalf("listener %s: %v", name, err)
		}
		if r := hcm.GetRds().GetRouteConfigName(); r != "" {
			seen[r] = true
		}
	}
	return sortedKeys(seen)
}

// listenerHCM returns the HTTP connection manager of an API listener or of
// the first filter chain.
func listenerHCM(l *listenerv3.Listener) (*hcmv3.HttpConnectionManager, error) {
	var a *anypb.Any
	if api := l.GetApiListener(); api != nil {
		a = api.GetApiListener()
	} else {
		for _, fc := range l.GetFilterChains() {
			for _, f := range fc.GetFilters() {
				if tc := f.GetTypedConfig(); tc != nil {
					a = tc
				}
			}
		}
	}
	if a == nil {
		return nil, errors.New("no HTTP connection manager")
	}
	hcm := &hcmv3.HttpConnectionManager{}
	if err := a.UnmarshalTo(hcm); err != nil {
		return nil, fmt.Errorf("decode %s as HttpConnectionManager: %w", a.GetTypeUrl(), err)
	}
	return hcm, nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// diffState describes how got differs from want, or returns "".
func diffState(got, want map[string]map[string]proto.Message) string {
	for _, typeURL := range []string{resource.ClusterType, resource.EndpointType, resource.ListenerType, resource.RouteType} {
		g, w := got[typeURL], want[typeURL]
		if gk, wk := sortedKeys(g), sortedKeys(w); !slices.Equal(gk, wk) {
			return fmt.Sprintf("%s names = %v, want %v", typeURL, gk, wk)
		}
		for name, wm := range w {
			if !proto.Equal(g[name], wm) {
				return fmt.Sprintf("%s %s differs from Snapshot", typeURL, name)
			}
		}
	}
	return ""
}
