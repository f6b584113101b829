package adsclient_test

import (
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/relay/adsclient"
	"github.com/meshrelay/meshrelay/relay/adsclient/adsclienttest"
	"github.com/meshrelay/meshrelay/relay/wire"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const nodeID = adsclienttest.NodeID

// controlPlane is a real go-control-plane server (adsclienttest).
type controlPlane = adsclienttest.ControlPlane

func startControlPlane(t *testing.T, addr string) *controlPlane { return adsclienttest.Start(t, addr) }

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// open opens a stream to cp presenting nodeID (unless cfg names a node),
// closed when the test ends.
func open(t *testing.T, ctx context.Context, cp *controlPlane, cfg adsclient.Config) *adsclient.Stream {
	t.Helper()
	if cfg.Node == nil {
		cfg.Node = &core.Node{Id: nodeID}
	}
	s, err := adsclient.Open(ctx, dial(t, cp.Addr), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// subscribeClusters subscribes s to every cluster.
func subscribeClusters(t *testing.T, s *adsclient.Stream) {
	t.Helper()
	if err := s.Subscribe(resource.ClusterType, true, nil); err != nil {
		t.Fatal(err)
	}
}

// protocol names a subtest by its protocol.
func protocol(delta bool) string {
	if delta {
		return "delta"
	}
	return "sotw"
}

// next returns the stream's next response, failing on its end.
func next(t *testing.T, ctx context.Context, s *adsclient.Stream) adsclient.Response {
	t.Helper()
	select {
	case r := <-s.Responses():
		return r
	case err := <-s.Err():
		t.Fatalf("stream ended: %v", err)
	case <-ctx.Done():
		t.Fatal("no response")
	}
	return nil
}

// names returns the resource names a response carries.
func names(t *testing.T, r adsclient.Response) []string {
	t.Helper()
	var out []string
	add := func(a *wire.AnyIn) {
		c := new(clusterv3.Cluster)
		if err := (&anypb.Any{TypeUrl: a.GetTypeUrl(), Value: a.GetValue()}).UnmarshalTo(c); err != nil {
			t.Fatal(err)
		}
		out = append(out, c.GetName())
	}
	switch r := r.(type) {
	case *wire.SotWIn:
		for _, a := range r.Resources {
			add(a)
		}
	case *wire.DeltaIn:
		for _, res := range r.Resources {
			add(res.Body)
		}
	case adsclient.SotWResponse:
		for _, a := range r.GetResources() {
			add(&wire.AnyIn{TypeUrl: a.GetTypeUrl(), Value: a.GetValue()})
		}
	case adsclient.DeltaResponse:
		for _, res := range r.GetResources() {
			add(&wire.AnyIn{TypeUrl: res.GetResource().GetTypeUrl(), Value: res.GetResource().GetValue()})
		}
	}
	slices.Sort(out)
	return out
}

// TestSotW: the node goes on the first request; a response is ACKed
// with its version and nonce and the subscription; the next version comes.
func TestSotW(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cp := startControlPlane(t, "127.0.0.1:0")
	cp.Set(t, "v1", "a", "b")
	s := open(t, ctx, cp, adsclient.Config{})
	subscribeClusters(t, s)
	r1 := next(t, ctx, s)
	if got := names(t, r1); !slices.Equal(got, []string{"a", "b"}) || r1.(*wire.SotWIn).VersionInfo != "v1" {
		t.Fatalf("first response: %v at %q, want [a b] at v1", got, r1.(*wire.SotWIn).VersionInfo)
	}
	if err := s.ACK(r1); err != nil {
		t.Fatal(err)
	}
	r1.Release()
	cp.Set(t, "v2", "a", "b", "c")
	r2 := next(t, ctx, s)
	if got := names(t, r2); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Fatalf("second response: %v, want [a b c]", got)
	}
	r2.Release()
	reqs := cp.SotWRequests()
	if len(reqs) < 2 {
		t.Fatalf("server read %d requests, want the subscription and the ACK", len(reqs))
	}
	// (go-control-plane's server puts the stream's node on every request
	// it passes on: the first is all that can be checked here.)
	if reqs[0].GetNode().GetId() != nodeID {
		t.Errorf("first request's node = %v, want %s", reqs[0].GetNode(), nodeID)
	}
	if ack := reqs[1]; ack.GetVersionInfo() != "v1" || ack.GetResponseNonce() != r1.GetNonce() || ack.GetErrorDetail() != nil || len(ack.GetResourceNames()) != 0 {
		t.Errorf("ACK = %v, want version v1, nonce %q, the legacy wildcard, no error", ack, r1.GetNonce())
	}
}

// TestDelta: the first request subscribes with the node; an ACK is the
// nonce; a change brings only what changed.
func TestDelta(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cp := startControlPlane(t, "127.0.0.1:0")
	cp.Set(t, "v1", "a", "b")
	s := open(t, ctx, cp, adsclient.Config{Delta: true})
	subscribeClusters(t, s)
	r1 := next(t, ctx, s)
	if got := names(t, r1); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("first response: %v, want [a b]", got)
	}
	if err := s.ACK(r1); err != nil {
		t.Fatal(err)
	}
	r1.Release()
	cp.Set(t, "v2", "a", "b", "c")
	r2 := next(t, ctx, s)
	if got := names(t, r2); !slices.Equal(got, []string{"c"}) {
		t.Fatalf("second response: %v, want [c] (only what changed)", got)
	}
	r2.Release()
	reqs := cp.DeltaRequests()
	if len(reqs) < 2 {
		t.Fatalf("server read %d requests, want the subscription and the ACK", len(reqs))
	}
	if first := reqs[0]; first.GetNode().GetId() != nodeID || !slices.Equal(first.GetResourceNamesSubscribe(), []string{"*"}) {
		t.Errorf("first request = %v, want the node and a subscription of *", first)
	}
	if ack := reqs[1]; ack.GetResponseNonce() != r1.GetNonce() || len(ack.GetResourceNamesSubscribe()) != 0 || ack.GetErrorDetail() != nil {
		t.Errorf("ACK = %v, want only nonce %q", ack, r1.GetNonce())
	}
}

// TestDecoded: with Config.Decoded, responses come whole, as the control
// plane sent them, on both protocols, and are ACKed as the lazy ones are.
func TestDecoded(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocol(delta), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cp := startControlPlane(t, "127.0.0.1:0")
			cp.Set(t, "v1", "a", "b")
			s := open(t, ctx, cp, adsclient.Config{Delta: delta, Decoded: true})
			subscribeClusters(t, s)
			r1 := next(t, ctx, s)
			if got := names(t, r1); !slices.Equal(got, []string{"a", "b"}) {
				t.Fatalf("first response: %v, want [a b]", got)
			}
			switch r := r1.(type) {
			case adsclient.SotWResponse:
				if delta || r.GetVersionInfo() != "v1" || r.GetTypeUrl() != resource.ClusterType {
					t.Fatalf("response %v on a delta=%v stream, want SotW at v1", r, delta)
				}
			case adsclient.DeltaResponse:
				if !delta || r.GetTypeUrl() != resource.ClusterType {
					t.Fatalf("response %v on a delta=%v stream", r, delta)
				}
			default:
				t.Fatalf("response of type %T, want one read whole", r1)
			}
			if err := s.ACK(r1); err != nil {
				t.Fatal(err)
			}
			// The ACK carries v1 (SotW), so the server answers v2 alone.
			if !delta {
				adsclienttest.WaitFor(t, ctx, "the ACK read", func() bool { return len(cp.SotWRequests()) >= 2 })
				if ack := cp.SotWRequests()[1]; ack.GetVersionInfo() != "v1" || ack.GetResponseNonce() != r1.GetNonce() {
					t.Fatalf("ACK = %v, want version v1 and nonce %q", ack, r1.GetNonce())
				}
			}
			cp.Set(t, "v2", "a", "b", "c")
			r2 := next(t, ctx, s)
			want := []string{"a", "b", "c"}
			if delta {
				want = []string{"c"}
			}
			if got := names(t, r2); !slices.Equal(got, want) {
				t.Fatalf("second response: %v, want %v", got, want)
			}
		})
	}
}

// TestRefusal: a control plane that ends the stream (refusing the
// client's credentials, say) is heard with its status and its trailer,
// also when requests are written after the end: a caller decides on the
// code (and a relay reads the key's splits in its owner's trailer).
func TestRefusal(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocol(delta), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cp := startControlPlane(t, "127.0.0.1:0")
			cp.Refuse(status.Error(codes.Unauthenticated, "token refused"))
			s := open(t, ctx, cp, adsclient.Config{Delta: delta})
			if tr := s.Trailer(); tr != nil {
				t.Fatalf("Trailer = %v before the stream ended, want nil", tr)
			}
			for _, typeURL := range []string{resource.ClusterType, resource.ListenerType, resource.RouteType, resource.EndpointType} {
				if err := s.Subscribe(typeURL, true, nil); err != nil {
					t.Fatal(err)
				}
			}
			select {
			case err := <-s.Err():
				if status.Code(err) != codes.Unauthenticated {
					t.Fatalf("the stream ended with %v, want the control plane's Unauthenticated", err)
				}
				if got := s.Trailer().Get("x-ended-by"); len(got) != 1 || got[0] != "test-control-plane" {
					t.Fatalf("Trailer = %v, want the control plane's", s.Trailer())
				}
			case r := <-s.Responses():
				t.Fatalf("a refused stream answered %v", r)
			case <-ctx.Done():
				t.Fatal("the refusal never arrived")
			}
		})
	}
}

// TestNACK: a refused response is answered with the error and, in SotW,
// the version last ACKed, so the control plane keeps the client on it.
func TestNACK(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocol(delta), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cp := startControlPlane(t, "127.0.0.1:0")
			cp.Set(t, "v1", "a")
			s := open(t, ctx, cp, adsclient.Config{Delta: delta})
			subscribeClusters(t, s)
			r1 := next(t, ctx, s)
			if err := s.ACK(r1); err != nil {
				t.Fatal(err)
			}
			r1.Release()
			cp.Set(t, "v2", "a", "bad")
			r2 := next(t, ctx, s)
			if err := s.NACK(r2, errors.New("cluster bad: refused")); err != nil {
				t.Fatal(err)
			}
			r2.Release()
			if delta {
				adsclienttest.WaitFor(t, ctx, "the NACK read", func() bool { return len(cp.DeltaRequests()) >= 3 })
				nack := cp.DeltaRequests()[2]
				if nack.GetResponseNonce() != r2.GetNonce() || !strings.Contains(nack.GetErrorDetail().GetMessage(), "refused") {
					t.Errorf("NACK = %v, want nonce %q and the error", nack, r2.GetNonce())
				}
				return
			}
			adsclienttest.WaitFor(t, ctx, "the NACK read", func() bool { return len(cp.SotWRequests()) >= 3 })
			nack := cp.SotWRequests()[2]
			if nack.GetVersionInfo() != "v1" || nack.GetResponseNonce() != r2.GetNonce() || !strings.Contains(nack.GetErrorDetail().GetMessage(), "refused") {
				t.Errorf("NACK = %v, want version v1 (the last ACKed), nonce %q and the error", nack, r2.GetNonce())
			}
		})
	}
}

// TestReconnect: when the control plane goes, Err says so; a stream opened
// again on the same connection, once it is back, starts over: the node on
// its first request, the whole state in its first response.
func TestReconnect(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocol(delta), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cp := startControlPlane(t, "127.0.0.1:0")
			cp.Set(t, "v1", "a")
			conn := dial(t, cp.Addr)
			cfg := adsclient.Config{Delta: delta, Node: &core.Node{Id: nodeID}}
			s, err := adsclient.Open(ctx, conn, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			subscribeClusters(t, s)
			r := next(t, ctx, s)
			r.Release()
			cp.Stop()
			select {
			case err := <-s.Err():
				if err == nil {
					t.Fatal("Err yielded nil")
				}
			case <-ctx.Done():
				t.Fatal("the stream never ended with its control plane")
			}
			s.Close()

			cp2 := startControlPlane(t, cp.Addr)
			cp2.Set(t, "v2", "a", "b")
			cfg.CallOptions = []grpc.CallOption{grpc.WaitForReady(true)} // the connection is reconnecting
			s2, err := adsclient.Open(ctx, conn, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer s2.Close()
			if err := s2.Subscribe(resource.ClusterType, true, nil); err != nil {
				t.Fatal(err)
			}
			r2 := next(t, ctx, s2)
			if got := names(t, r2); !slices.Equal(got, []string{"a", "b"}) {
				t.Errorf("first response after the reconnect: %v, want [a b]", got)
			}
			r2.Release()
			var node *core.Node
			if delta {
				node = cp2.DeltaRequests()[0].GetNode()
			} else {
				node = cp2.SotWRequests()[0].GetNode()
			}
			if node.GetId() != nodeID {
				t.Errorf("the new stream's first request carried node %v, want %s", node, nodeID)
			}
		})
	}
}

// stuckServer writes responses and never reads a request, as a control
// plane busy writing does.
type stuckServer struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	responses int
}

func (s stuckServer) StreamAggregatedResources(stream discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	for i := range s.responses {
		c, _ := anypb.New(&clusterv3.Cluster{Name: "c"})
		if err := stream.Send(&discovery.DiscoveryResponse{TypeUrl: resource.ClusterType, VersionInfo: "v", Nonce: string(rune('a' + i%26)), Resources: []*anypb.Any{c}}); err != nil {
			return err
		}
	}
	<-stream.Context().Done()
	return nil
}

// TestFlowControl: requests the control plane does not read queue up to
// MaxQueued, then Send fails, never blocking; meanwhile every response it
// writes is still read. (A client that blocked writing would stop reading,
// and with a server that writes before it reads, both would wait forever.)
func TestFlowControl(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	const responses = 200
	srv := grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, stuckServer{responses: responses})
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	defer func() { srv.Stop(); <-done }()

	s, err := adsclient.Open(ctx, dial(t, lis.Addr().String()), adsclient.Config{Node: &core.Node{Id: nodeID}, MaxQueued: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// Each request is a megabyte of names: a few fill the stream's
	// flow-control window, and the rest queue.
	big := make([]string, 1024)
	for i := range big {
		big[i] = strings.Repeat("x", 1000)
	}
	full := false
	for i := 0; i < 10_000 && !full; i++ {
		err := s.Send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType, ResourceNames: big})
		switch {
		case errors.Is(err, adsclient.ErrQueueFull):
			full = true
		case err != nil:
			t.Fatal(err)
		}
	}
	if !full {
		t.Fatal("Send never reported a full queue to a control plane that reads nothing")
	}
	for range responses {
		next(t, ctx, s).Release()
	}
}

// recordServer reads every request of a SotW stream and answers none.
type recordServer struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	got chan *discovery.DiscoveryRequest
}

func (s recordServer) StreamAggregatedResources(stream discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	for {
		r, err := stream.Recv()
		if err != nil {
			return nil
		}
		s.got <- r
	}
}

// TestNodeOnFirstRequestOnly: whatever request comes first (Send,
// Subscribe or an ACK) carries the node; none after it does.
func TestNodeOnFirstRequestOnly(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rec := recordServer{got: make(chan *discovery.DiscoveryRequest, 16)}
	srv := grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, rec)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	defer func() { srv.Stop(); <-done }()
	s, err := adsclient.Open(ctx, dial(t, lis.Addr().String()), adsclient.Config{Node: &core.Node{Id: nodeID}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Send(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType}); err != nil {
		t.Fatal(err)
	}
	if err := s.Subscribe(resource.EndpointType, false, []string{"b", "a", "b"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&discovery.DeltaDiscoveryRequest{}); err == nil {
		t.Error("Send(a Delta request) on a SotW stream = nil, want an error")
	}
	for i := range 2 {
		var r *discovery.DiscoveryRequest
		select {
		case r = <-rec.got:
		case <-ctx.Done():
			t.Fatalf("request %d never arrived", i)
		}
		if (r.GetNode() != nil) != (i == 0) {
			t.Errorf("request %d node = %v, want it on the first request only", i, r.GetNode())
		}
		if i == 1 && !slices.Equal(r.GetResourceNames(), []string{"a", "b"}) {
			t.Errorf("subscription names = %q, want [a b] (sorted, once each)", r.GetResourceNames())
		}
	}
}
