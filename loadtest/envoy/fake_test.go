package envoy

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	tcpproxy "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
)

// fakeADS is a scripted ADS server that can break the protocol on purpose.
// It serves one stream, SotW or Delta, running script on it.
type fakeADS struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	t      *testing.T
	script func(f *fakeStream)

	mu   sync.Mutex
	reqs []proto.Message // every request received, in order
}

// fakeStream is the server side of one stream, for scripts.
type fakeStream struct {
	t     *testing.T
	ads   *fakeADS
	sotw  discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer
	delta discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer
	ver   int
}

func (a *fakeADS) StreamAggregatedResources(s discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	return a.serve(&fakeStream{t: a.t, ads: a, sotw: s})
}

func (a *fakeADS) DeltaAggregatedResources(s discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	return a.serve(&fakeStream{t: a.t, ads: a, delta: s})
}

func (a *fakeADS) serve(f *fakeStream) error {
	a.script(f)
	for { // drain until the client goes away
		if _, err := f.recv(); err != nil {
			return nil
		}
	}
}

func (f *fakeStream) recv() (proto.Message, error) {
	var m proto.Message
	var err error
	if f.sotw != nil {
		m, err = f.sotw.Recv()
	} else {
		m, err = f.delta.Recv()
	}
	if err == nil {
		f.ads.mu.Lock()
		f.ads.reqs = append(f.ads.reqs, m)
		f.ads.mu.Unlock()
	}
	return m, err
}

// await reads requests until one for typeURL that is not an ACK or NACK.
func (f *fakeStream) await(typeURL string) {
	f.awaitFunc(func(m proto.Message) bool {
		switch r := m.(type) {
		case *discovery.DiscoveryRequest:
			return r.GetTypeUrl() == typeURL && r.GetResponseNonce() == ""
		case *discovery.DeltaDiscoveryRequest:
			return r.GetTypeUrl() == typeURL && r.GetResponseNonce() == ""
		}
		return false
	})
}

// awaitFunc reads requests until match returns true (or the stream ends).
func (f *fakeStream) awaitFunc(match func(proto.Message) bool) {
	for {
		m, err := f.recv()
		if err != nil || match(m) {
			return
		}
	}
}

func mustAny(m proto.Message) *anypb.Any {
	a, err := anypb.New(m)
	if err != nil {
		panic(err)
	}
	return a
}

func nameOf(m proto.Message) string {
	return nameField(m)
}

// send sends resources of typeURL with nonce; removed is Delta only (SotW
// sends the resources as they are).
func (f *fakeStream) send(typeURL, nonce string, res []proto.Message, removed ...string) {
	f.ver++
	if f.sotw != nil {
		resp := &discovery.DiscoveryResponse{TypeUrl: typeURL, Nonce: nonce, VersionInfo: "v" + string(rune('0'+f.ver)),
			ControlPlane: &core.ControlPlane{Identifier: "fake-cp"}}
		for _, r := range res {
			resp.Resources = append(resp.Resources, mustAny(r))
		}
		if err := f.sotw.Send(resp); err != nil {
			f.t.Logf("fake send: %v", err)
		}
		return
	}
	resp := &discovery.DeltaDiscoveryResponse{TypeUrl: typeURL, Nonce: nonce, RemovedResources: removed,
		ControlPlane: &core.ControlPlane{Identifier: "fake-cp"}}
	for _, r := range res {
		resp.Resources = append(resp.Resources, &discovery.Resource{Name: nameOf(r), Version: "1", Resource: mustAny(r)})
	}
	if err := f.delta.Send(resp); err != nil {
		f.t.Logf("fake send: %v", err)
	}
}

// startFake serves a on bufconn and returns a client connection.
func startFake(t *testing.T, a discovery.AggregatedDiscoveryServiceServer) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, a)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	conn, err := grpc.NewClient("passthrough:///fake",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))
	if err != nil {
		t.Fatalf("grpc.NewClient: %v", err)
	}
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
		<-done
	})
	return conn
}

func tcpListener(name, clusterName string) *listener.Listener {
	return &listener.Listener{
		Name: name,
		FilterChains: []*listener.FilterChain{{Filters: []*listener.Filter{{
			Name:       "envoy.filters.network.tcp_proxy",
			ConfigType: &listener.Filter_TypedConfig{TypedConfig: mustAny(&tcpproxy.TcpProxy{StatPrefix: name, ClusterSpecifier: &tcpproxy.TcpProxy_Cluster{Cluster: clusterName}})},
		}}}},
	}
}

// generationOf reads a test generation from a cluster's connect_timeout.
func generationOf(m proto.Message) (uint64, bool) {
	c, ok := m.(*cluster.Cluster)
	if !ok || c.GetConnectTimeout() == nil {
		return 0, false
	}
	return uint64(c.GetConnectTimeout().GetSeconds()), true
}

func clusterGen(name string, gen int64) *cluster.Cluster {
	c := staticCluster(name)
	c.ConnectTimeout = durationpb.New(time.Duration(gen) * time.Second)
	return c
}

func TestViolations(t *testing.T) {
	type msgs = []proto.Message
	// cleanStart: CDS [a], LDS [l → r], RDS [r → a]: nonces 1, 2, 3.
	cleanStart := func(f *fakeStream) {
		f.await(ClusterType)
		f.send(ClusterType, "1", msgs{staticCluster("a")})
		f.await(ListenerType)
		f.send(ListenerType, "2", msgs{rdsListener("l", "r")})
		f.await(RouteType)
		f.send(RouteType, "3", msgs{routeConfig("r", "a")})
	}
	tests := []struct {
		name   string
		only   []Protocol // nil: both
		script func(f *fakeStream)
		want   Rule // "" : no violation; wait for acks ACKs instead
		acks   uint64
	}{
		{name: "clean", script: cleanStart, acks: 3},
		{name: "route uses unknown cluster", want: RuleOrdering, script: func(f *fakeStream) {
			f.await(ClusterType)
			f.send(ClusterType, "1", msgs{staticCluster("a")})
			f.await(ListenerType)
			f.send(ListenerType, "2", msgs{rdsListener("l", "r")})
			f.await(RouteType)
			f.send(RouteType, "3", msgs{routeConfig("r", "a", "missing")})
		}},
		{name: "route uses a warming cluster", want: RuleOrdering, script: func(f *fakeStream) {
			// An EDS cluster warms until its assignment arrives: a route to
			// it before that fails in Envoy (no_cluster).
			f.await(ClusterType)
			f.send(ClusterType, "1", msgs{edsCluster("a")})
			f.await(ListenerType)
			f.send(ListenerType, "2", msgs{rdsListener("l", "r")})
			f.await(RouteType)
			f.send(RouteType, "3", msgs{routeConfig("r", "a")})
		}},
		{name: "route after its cluster warmed", script: func(f *fakeStream) {
			f.await(ClusterType)
			f.send(ClusterType, "1", msgs{edsCluster("a")})
			f.await(EndpointType)
			f.send(EndpointType, "2", msgs{loadAssignment("a", 80)})
			f.await(ListenerType)
			f.send(ListenerType, "3", msgs{rdsListener("l", "r")})
			f.await(RouteType)
			f.send(RouteType, "4", msgs{routeConfig("r", "a")})
		}, acks: 4},
		{name: "tcp listener before its cluster", want: RuleOrdering, script: func(f *fakeStream) {
			f.await(ClusterType)
			f.send(ClusterType, "1", msgs{staticCluster("a")})
			f.await(ListenerType)
			f.send(ListenerType, "2", msgs{tcpListener("l", "b")})
		}},
		{name: "cluster removed while used", want: RuleOrdering, script: func(f *fakeStream) {
			cleanStart(f)
			if f.sotw != nil {
				f.send(ClusterType, "4", msgs{staticCluster("z")}) // full state without a
			} else {
				f.send(ClusterType, "4", nil, "a")
			}
		}},
		{name: "duplicate nonce", want: RuleNonce, script: func(f *fakeStream) {
			f.await(ClusterType)
			f.send(ClusterType, "1", msgs{staticCluster("a")})
			f.await(ListenerType)
			f.send(ListenerType, "1", msgs{rdsListener("l", "r")})
		}},
		{name: "empty nonce", want: RuleNonce, script: func(f *fakeStream) {
			f.await(ClusterType)
			f.send(ClusterType, "", msgs{staticCluster("a")})
		}},
		{name: "resource of another type", want: RuleTypeURL, script: func(f *fakeStream) {
			f.await(ClusterType)
			f.send(ClusterType, "1", msgs{staticCluster("a"), rdsListener("l", "r")})
		}},
		{name: "route not subscribed", want: RuleUnsubscribed, script: func(f *fakeStream) {
			f.await(ClusterType)
			f.send(ClusterType, "1", msgs{staticCluster("a")})
			f.await(ListenerType)
			f.send(ListenerType, "2", msgs{rdsListener("l", "r")})
			f.await(RouteType)
			f.send(RouteType, "3", msgs{routeConfig("other", "a")})
		}},
		{name: "type never requested", want: RuleUnsubscribed, script: func(f *fakeStream) {
			f.await(ClusterType)
			f.send(RouteType, "1", msgs{routeConfig("r")})
		}},
		{name: "generation regression", want: RuleGeneration, script: func(f *fakeStream) {
			f.await(ClusterType)
			f.send(ClusterType, "1", msgs{clusterGen("a", 5)})
			f.send(ClusterType, "2", msgs{clusterGen("a", 5)}) // equal: fine
			f.send(ClusterType, "3", msgs{clusterGen("a", 3)})
		}},
		{name: "duplicate name", only: []Protocol{Delta}, want: RuleDuplicate, script: func(f *fakeStream) {
			f.await(ClusterType)
			f.send(ClusterType, "1", msgs{staticCluster("a"), staticCluster("a")})
		}},
		{name: "resource also removed", only: []Protocol{Delta}, want: RuleDuplicate, script: func(f *fakeStream) {
			f.await(ClusterType)
			f.send(ClusterType, "1", msgs{staticCluster("a")}, "a")
		}},
	}
	for _, tt := range tests {
		for _, p := range protocols {
			if tt.only != nil && !contains(tt.only, p) {
				continue
			}
			// Light mode drops bodies, not checks: every rule is caught
			// the same.
			for _, light := range []bool{false, true} {
				name := tt.name + "/" + p.String()
				if light {
					name += "/light"
				}
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					testViolation(t, tt.script, tt.want, tt.acks, p, light)
				})
			}
		}
	}
}

// testViolation runs one case of TestViolations: script on a fake
// upstream, then either want recorded or, with want "", acks ACKs and no
// violation.
func testViolation(t *testing.T, script func(*fakeStream), want Rule, acks uint64, p Protocol, light bool) {
	ads := &fakeADS{t: t, script: script}
	conn := startFake(t, ads)
	e := newTestEnvoy(t, conn, p, func(c *Config) {
		c.Generation, c.Light = generationOf, light
		if light {
			c.DecodeCache = NewDecodeCache()
		}
	})
	if want == "" {
		waitFor(t, e, "ACKs", func(v View) bool { return v.Stats().ACKs >= acks })
		noViolations(t, e)
		if got := e.ControlPlane(); got != "fake-cp" {
			t.Errorf("ControlPlane() = %q, want %q", got, "fake-cp")
		}
		checkNodeOnlyFirst(t, ads)
		return
	}
	waitFor(t, e, "a "+string(want)+" violation", func(v View) bool {
		return hasRule(v.e.Violations(), want)
	})
	for _, err := range e.Violations() {
		t.Logf("recorded: %v", err)
	}
}

// checkNodeOnlyFirst: only the first request of the stream carries the node.
func checkNodeOnlyFirst(t *testing.T, ads *fakeADS) {
	t.Helper()
	ads.mu.Lock()
	defer ads.mu.Unlock()
	for i, m := range ads.reqs {
		var node *core.Node
		switch r := m.(type) {
		case *discovery.DiscoveryRequest:
			node = r.GetNode()
		case *discovery.DeltaDiscoveryRequest:
			node = r.GetNode()
		}
		if (i == 0) != (node != nil) {
			t.Errorf("request %d node = %v, want it on the first request only", i, node)
		}
	}
}

func hasRule(errs []error, rule Rule) bool {
	for _, err := range errs {
		var v *Violation
		if errors.As(err, &v) && v.Rule == rule {
			return true
		}
	}
	return false
}

func contains(ps []Protocol, p Protocol) bool {
	for _, q := range ps {
		if q == p {
			return true
		}
	}
	return false
}

// TestUnsubscribeGrace: one response after the unsubscription was sent may
// still carry the name (it crossed the request on the wire); the next may
// not. Either is ignored, and its ACK does not name what it ignored (a
// history rebuilt from the events must not count it as held).
func TestUnsubscribeGrace(t *testing.T) {
	for _, p := range protocols {
		t.Run(p.String(), func(t *testing.T) {
			t.Parallel()
			ads := &fakeADS{t: t, script: func(f *fakeStream) {
				f.await(ClusterType)
				f.send(ClusterType, "1", []proto.Message{staticCluster("a")})
				f.await(ListenerType)
				f.send(ListenerType, "2", []proto.Message{rdsListener("l", "r")})
				f.await(RouteType)
				f.send(RouteType, "3", []proto.Message{routeConfig("r", "a")})
				f.awaitFunc(func(m proto.Message) bool {
					switch r := m.(type) {
					case *discovery.DiscoveryRequest:
						return r.GetTypeUrl() == RouteType && len(r.GetResourceNames()) == 0
					case *discovery.DeltaDiscoveryRequest:
						return r.GetTypeUrl() == RouteType && len(r.GetResourceNamesUnsubscribe()) == 1
					}
					return false
				})
				f.send(RouteType, "4", []proto.Message{routeConfig("r", "a")}) // tolerated
				f.send(RouteType, "5", []proto.Message{routeConfig("r", "a")}) // a violation
			}}
			conn := startFake(t, ads)
			var mu sync.Mutex
			acked := map[string][]string{} // nonce → names
			e := newTestEnvoy(t, conn, p, func(c *Config) {
				c.OnEvent = func(ev Event) {
					if ev.Kind == ACKed {
						mu.Lock()
						acked[ev.Nonce] = ev.Names
						mu.Unlock()
					}
				}
			})
			waitFor(t, e, "r", func(v View) bool { return v.Has(RouteType, "r") })
			e.Unsubscribe(RouteType, []string{"r"})
			waitFor(t, e, "5 responses", func(v View) bool { return v.Stats().Responses == 5 })
			vs := e.Violations()
			if len(vs) != 1 || !hasRule(vs, RuleUnsubscribed) || !strings.Contains(vs[0].Error(), `"5"`) {
				t.Errorf("Violations() = %v, want one unsubscribed violation, on nonce 5", vs)
			}
			if (View{e}).Has(RouteType, "r") {
				t.Errorf("r still held after Unsubscribe")
			}
			// The ACK of 5 is sent (and its event given) after 5 is read.
			for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
				mu.Lock()
				_, ok := acked["5"]
				mu.Unlock()
				if ok {
					break
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if got := acked["3"]; len(got) != 1 || got[0] != "r" {
				t.Errorf("ACK of nonce 3 names %q, want [r]", got)
			}
			for _, n := range []string{"4", "5"} {
				if got, ok := acked[n]; !ok || len(got) != 0 {
					t.Errorf("ACK of nonce %s names %q (sent: %v), want none: r was ignored", n, got, ok)
				}
			}
		})
	}
}

// TestPauseStopsReading: a paused Envoy stops calling Recv (at most the read
// already waiting completes); after Resume it reads the rest.
func TestPauseStopsReading(t *testing.T) {
	for _, p := range protocols {
		t.Run(p.String(), func(t *testing.T) {
			t.Parallel()
			pushed, sent := make(chan struct{}), make(chan struct{})
			ads := &fakeADS{t: t, script: func(f *fakeStream) {
				f.await(ClusterType)
				f.send(ClusterType, "1", []proto.Message{staticCluster("a")})
				<-pushed
				for _, n := range []string{"2", "3", "4"} { // without waiting for ACKs
					f.send(ClusterType, n, []proto.Message{staticCluster("a")})
				}
				close(sent)
			}}
			conn := startFake(t, ads)
			e := newTestEnvoy(t, conn, p, func(c *Config) { c.ReadDelay = time.Millisecond })
			waitFor(t, e, "the first response", func(v View) bool { return v.Stats().Responses == 1 })
			e.Pause()
			close(pushed)
			<-sent
			if got := e.Stats().Responses; got > 2 {
				t.Errorf("paused Envoy read %d responses, want at most 2 (one Recv may have been waiting)", got)
			}
			e.Resume()
			waitFor(t, e, "all 4 responses", func(v View) bool { return v.Stats().Responses == 4 && v.Stats().ACKs == 4 })
			noViolations(t, e)
		})
	}
}
