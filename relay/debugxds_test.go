package relay

import (
	"context"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statusv3 "github.com/envoyproxy/go-control-plane/envoy/service/status/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/ledger"
)

// allowEveryone authorizes every stream, as AllowAll does, but is an
// Authorizer of its own: the relay cannot know it trusts the port.
type allowEveryone struct{}

func (allowEveryone) Authorize(context.Context, *core.Node) error { return nil }

// TestDebugTypes: istiod's debug type URLs are answered by the relay
// itself on a trusted port, once per request (an ACK is not answered
// again), without the debug stream joining a key; with an Authorizer they
// are refused.
func TestDebugTypes(t *testing.T) {
	e := newEnv(t, false, nil)
	c := e.client(0)
	syncAll(c)
	e.waitLedger(t, "the client's ACKs", ledger.Convergence{Envoys: 1, Current: 1}, "")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	debugNode := &core.Node{Id: "debug~0.0.0.0~istioctl~.svc.cluster.local"}
	ads, err := discovery.NewAggregatedDiscoveryServiceClient(e.conn).StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ads.Send(&discovery.DiscoveryRequest{TypeUrl: typeDebugSyncz, Node: debugNode}); err != nil {
		t.Fatal(err)
	}
	syncz, err := ads.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var cc statusv3.ClientConfig
	if len(syncz.GetResources()) != 1 || syncz.GetResources()[0].UnmarshalTo(&cc) != nil || cc.GetNode().GetId() != node("ns1", "app", 0).GetId() {
		t.Fatalf("syncz = %v, want the one client", syncz)
	}
	// The ACK is not answered: the next answer is the next question's.
	ack := &discovery.DiscoveryRequest{TypeUrl: typeDebugSyncz, ResponseNonce: syncz.GetNonce(), VersionInfo: syncz.GetVersionInfo()}
	dump := &discovery.DiscoveryRequest{TypeUrl: typeDebugConfigDump, ResourceNames: []string{node("ns1", "app", 0).GetId()}}
	if err := ads.Send(ack); err != nil {
		t.Fatal(err)
	}
	if err := ads.Send(dump); err != nil {
		t.Fatal(err)
	}
	got, err := ads.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if got.GetTypeUrl() != typeDebugConfigDump || len(got.GetResources()) == 0 {
		t.Fatalf("after an ACK and a config_dump request, got %s with %d resources; want the dump", got.GetTypeUrl(), len(got.GetResources()))
	}
	if n := len(e.r.Clients()); n != 1 {
		t.Fatalf("the relay lists %d clients, want 1: the debug stream joined a key", n)
	}

	guarded := newEnv(t, false, func(cfg *Config) { cfg.Authorizer = allowEveryone{} })
	ads2, err := discovery.NewAggregatedDiscoveryServiceClient(guarded.conn).StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ads2.Send(&discovery.DiscoveryRequest{TypeUrl: typeDebugSyncz, Node: debugNode}); err != nil {
		t.Fatal(err)
	}
	if _, err := ads2.Recv(); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("syncz with an Authorizer: %v, want PermissionDenied", err)
	}
}
