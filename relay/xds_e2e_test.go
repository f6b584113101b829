package relay

import (
	"context"
	"encoding/json"
	"maps"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	grpcxds "google.golang.org/grpc/xds" // registers the xds:/// resolver and the xDS balancers

	synth "github.com/meshrelay/meshrelay/loadtest/upstream" // the name upstream is taken in package relay
	"github.com/meshrelay/meshrelay/relay/xds"
)

// e2eTimeout bounds every wait of the end-to-end test.
const e2eTimeout = 20 * time.Second

// TestXDSClientEndToEnd points grpc-go's own xDS client (the first client
// of the relay that this project did not write) at a relay in front of the
// synthetic istiod-shaped upstream, resolves a proxyless gRPC service
// through it and calls a real backend, once per upstream protocol.
//
// grpc-go speaks SotW ADS and asks for LDS → RDS → CDS → EDS by name, one
// type at a time, as each reference is learned.
func TestXDSClientEndToEnd(t *testing.T) {
	for _, protocol := range []Protocol{ProtocolDelta, ProtocolSotW} {
		t.Run(string(protocol), func(t *testing.T) { testXDSClientEndToEnd(t, protocol) })
	}
}

func testXDSClientEndToEnd(t *testing.T, protocol Protocol) {
	const (
		target = "greeter.test"
		ns     = 0
	)
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()

	backend := startHealthBackend(t, "backend-1")
	sc := synth.Scenario{
		Services:     20,
		Endpoints:    20,
		Namespaces:   2,
		GRPCServices: []synth.GRPCService{{Name: target, Backend: backend}},
	}
	up := startLoadtestUpstream(t, sc)
	r := startRelayTo(t, up.Addr(), func(cfg *Config) { cfg.Upstream.Protocol = protocol })

	nsName := synth.NamespaceName(ns)
	nodeID := "sidecar~127.0.0.1~grpc-client." + nsName + "~" + nsName + ".svc.cluster.local"
	cc := dialXDS(t, r.Addr().String(), nodeID, nsName, target)
	hc := healthpb.NewHealthClient(cc)

	// The first RPC needs the whole chain: LDS, RDS, CDS and EDS through the
	// relay, then a connection to the address the ClusterLoadAssignment gave.
	checkBackend(ctx, t, hc, "backend-1", backend)

	// The relay saw grpc-go's stream, over SotW, and every type settles
	// ACKed at the version it sent, without a NACK.
	waitCtx(ctx, t, "grpc client ACKs LDS, RDS, CDS and EDS at the relay", func() bool {
		return xdsClientSettled(r, nodeID)
	})
	for _, c := range r.Clients() {
		if c.NodeID == nodeID && c.Protocol != ProtocolSotW {
			t.Errorf("Clients()[%q].Protocol = %q, want %q", nodeID, c.Protocol, ProtocolSotW)
		}
	}

	// One upstream stream per key: the client is alone in its key.
	checkStreamsPerKey(t, r, up)

	// The upstream offers no way to move a GRPCService's backend (Scenario
	// fixes it at New; MoveEndpoint, AddService and RemoveService touch only
	// the ServiceEntries). So move an unrelated endpoint, visible to the
	// client's namespace, and check that the client stays settled, is sent
	// nothing new and keeps calling the same backend. (The key subscribed
	// upstream only to the names grpc-go asked for, so the moved
	// ClusterLoadAssignment does not even reach it.)
	before := xdsClientVersions(r, nodeID)
	c, err := up.MoveEndpoint(ns)
	if err != nil {
		t.Fatalf("MoveEndpoint(%d): %v", ns, err)
	}
	t.Logf("moved endpoint %d: %s %s generation %d", ns, c.TypeURL, c.Name, c.Generation)
	checkBackend(ctx, t, hc, "backend-1", backend)
	waitCtx(ctx, t, "grpc client settled after an unrelated endpoint moved", func() bool {
		return xdsClientSettled(r, nodeID)
	})
	if after := xdsClientVersions(r, nodeID); !maps.Equal(after, before) {
		t.Errorf("versions sent to the grpc client after an unrelated move = %v, want unchanged %v", after, before)
	}
	checkStreamsPerKey(t, r, up)
}

// xdsClientVersions returns the version the relay last sent nodeID, by type.
func xdsClientVersions(r *Relay, nodeID string) map[string]string {
	out := make(map[string]string)
	for _, c := range r.Clients() {
		if c.NodeID == nodeID {
			for typeURL, st := range c.Types {
				out[typeURL] = st.SentVersion
			}
		}
	}
	return out
}

// xdsClientSettled reports whether the relay has exactly one stream for
// nodeID and it has ACKed LDS, RDS, CDS and EDS at the versions last sent,
// with no NACK outstanding.
func xdsClientSettled(r *Relay, nodeID string) bool {
	found := 0
	var types map[string]TypeStatus
	for _, c := range r.Clients() {
		if c.NodeID == nodeID {
			found++
			types = c.Types
		}
	}
	if found != 1 {
		return false
	}
	for _, typeURL := range []string{xds.TypeListener, xds.TypeRoute, xds.TypeCluster, xds.TypeEndpoint} {
		st, ok := types[typeURL]
		if !ok || st.AckedVersion == "" || st.AckedVersion != st.SentVersion || st.NACK != nil {
			return false
		}
	}
	return true
}

// checkStreamsPerKey checks that the upstream holds exactly one ADS stream
// per relay key, and has never opened more.
func checkStreamsPerKey(t *testing.T, r *Relay, up *synth.Upstream) {
	t.Helper()
	rs, us := r.Stats(), up.Stats()
	if rs.Keys != 1 {
		t.Errorf("relay Stats().Keys = %d, want 1", rs.Keys)
	}
	if rs.UpstreamStreams != rs.Keys {
		t.Errorf("relay Stats().UpstreamStreams = %d, want %d (Keys)", rs.UpstreamStreams, rs.Keys)
	}
	if us.OpenStreams != int64(rs.Keys) {
		t.Errorf("upstream Stats().OpenStreams = %d, want %d (relay Keys)", us.OpenStreams, rs.Keys)
	}
	if us.StreamsOpened != uint64(rs.Keys) {
		t.Errorf("upstream Stats().StreamsOpened = %d, want %d (relay Keys): a stream was reopened", us.StreamsOpened, rs.Keys)
	}
}

// checkBackend calls Check on the xDS channel and checks that the backend
// at addr, the only one serving service, answered.
func checkBackend(ctx context.Context, t *testing.T, hc healthpb.HealthClient, service, addr string) {
	t.Helper()
	var p peer.Peer
	resp, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: service}, grpc.Peer(&p))
	if err != nil {
		t.Fatalf("Check(%q) through xds: %v", service, err)
	}
	if got := resp.GetStatus(); got != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("Check(%q).Status = %v, want SERVING", service, got)
	}
	if p.Addr == nil || p.Addr.String() != addr {
		t.Errorf("Check(%q) peer = %v, want %s", service, p.Addr, addr)
	}
}

// startHealthBackend runs a gRPC server on 127.0.0.1:0 whose health service
// reports service as SERVING, and returns its address.
func startHealthBackend(t *testing.T, service string) string {
	t.Helper()
	hs := health.NewServer()
	hs.SetServingStatus(service, healthpb.HealthCheckResponse_SERVING)
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	return serveLoopback(t, srv)
}

// serveLoopback serves srv on 127.0.0.1:0 until the test ends, and returns
// its address.
func serveLoopback(t *testing.T, srv *grpc.Server) string {
	t.Helper()
	lis := listenLoopback(t)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return lis.Addr().String()
}

// startLoadtestUpstream serves sc with the synthetic upstream on
// 127.0.0.1:0 until the test ends.
func startLoadtestUpstream(t *testing.T, sc synth.Scenario) *synth.Upstream {
	t.Helper()
	cfg := synth.DefaultConfig()
	cfg.Scenario = sc
	cfg.Listen = "127.0.0.1:0"
	up, err := synth.New(cfg)
	if err != nil {
		t.Fatalf("upstream New: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	if err := up.Start(ctx); err != nil {
		t.Fatalf("upstream Start: %v", err)
	}
	t.Cleanup(func() {
		if err := up.Stop(context.Background()); err != nil {
			t.Errorf("upstream Stop: %v", err)
		}
	})
	return up
}

// dialXDS opens an xds:///target channel whose xDS client is bootstrapped
// to the relay at relayAddr with an Istio-shaped node. The bootstrap goes
// to the resolver directly, not through GRPC_XDS_BOOTSTRAP*, so no process
// state changes: the resolver builds a private xDS client pool, and closing
// the channel (at cleanup, before the relay stops) closes the xDS client.
func dialXDS(t *testing.T, relayAddr, nodeID, namespace, target string) *grpc.ClientConn {
	t.Helper()
	bootstrap, err := json.Marshal(map[string]any{
		"xds_servers": []any{map[string]any{
			"server_uri":      relayAddr,
			"channel_creds":   []any{map[string]any{"type": "insecure"}},
			"server_features": []string{"xds_v3"},
		}},
		"node": map[string]any{
			"id": nodeID,
			"metadata": map[string]any{
				"NAMESPACE": namespace,
				"GENERATOR": "grpc", // as istio-agent writes it for proxyless gRPC
			},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	builder, err := grpcxds.NewXDSResolverWithConfigForTesting(bootstrap)
	if err != nil {
		t.Fatalf("NewXDSResolverWithConfigForTesting: %v", err)
	}
	cc, err := grpc.NewClient("xds:///"+target,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithResolvers(builder))
	if err != nil {
		t.Fatalf("grpc.NewClient(xds:///%s): %v", target, err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// waitCtx polls cond every 5 ms until it holds, failing the test when ctx
// ends first: for states only a background goroutine reaches (an ACK is
// read by the relay after the RPC it enabled may have returned).
func waitCtx(ctx context.Context, t *testing.T, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for: %s", what)
		case <-tick.C:
		}
	}
}
