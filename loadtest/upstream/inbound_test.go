package upstream_test

import (
	"maps"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// TestInboundIPs: a node whose IP is one of Scenario.InboundIPs gets, beside
// its group's listeners, an inbound listener of its own, found by its
// INSTANCE_IPS (the first listed of several) or, without metadata, by the
// IP in its node id; another pod of the same workload does not; every
// other type is its group's. Over SotW and Delta, from LinearCaches and
// from the incremental Delta caches.
func TestInboundIPs(t *testing.T) {
	sc := testScenario()
	ip := upstream.NodeIP(1, 2, 1)
	sc.InboundIPs = []string{"fd00::9", ip}
	listed, unlisted := sc.Node(1, 2, 1), sc.Node(1, 2, 0)
	byID := &core.Node{Id: listed.GetId()}
	several := proto.Clone(unlisted).(*core.Node)
	several.Metadata.Fields["INSTANCE_IPS"] = structpb.NewStringValue("10.9.9.9, " + ip)
	nodes := []struct {
		name    string
		node    *core.Node
		inbound bool
	}{
		{"listed", listed, true},
		{"listed by id", byID, true},
		{"listed among several", several, true},
		{"unlisted", unlisted, false},
	}
	wantName := "inbound|" + ip + "|8080"
	if got := upstream.InboundListenerName(ip); got != wantName {
		t.Fatalf("InboundListenerName(%q) = %q, want %q", ip, got, wantName)
	}
	for _, incremental := range []bool{false, true} {
		cfg := upstream.DefaultConfig()
		cfg.Scenario, cfg.IncrementalDelta = sc, incremental
		u := startConfigured(t, cfg)
		conn := dial(t, u.Addr())
		snap := u.Snapshot("ns-1")
		for _, p := range protocols {
			name := p.name
			if incremental {
				name += "/incremental"
			}
			for _, n := range nodes {
				t.Run(name+"/"+n.name, func(t *testing.T) {
					got := syncAll(t, p.open(t, conn, n.node))
					l, ok := got[resource.ListenerType][wantName].(*listenerv3.Listener)
					if ok != n.inbound {
						t.Fatalf("listeners = %v, want %s among them: %v", sortedKeys(got[resource.ListenerType]), wantName, n.inbound)
					}
					if ok {
						checkInbound(t, l, ip)
						got[resource.ListenerType] = maps.Clone(got[resource.ListenerType])
						delete(got[resource.ListenerType], wantName)
					}
					if d := diffState(got, snap); d != "" {
						t.Fatalf("state after sync, the inbound listener aside: %s", d)
					}
				})
			}
		}
	}
}

// checkInbound checks the shape of an inbound listener of ip: bound (not
// binding) to ip:8080, inbound, an HTTP connection manager with an inline
// route, and a generation.
func checkInbound(t *testing.T, l *listenerv3.Listener, ip string) {
	t.Helper()
	sa := l.GetAddress().GetSocketAddress()
	if sa.GetAddress() != ip || sa.GetPortValue() != upstream.EndpointPort {
		t.Errorf("inbound listener address = %s:%d, want %s:%d", sa.GetAddress(), sa.GetPortValue(), ip, upstream.EndpointPort)
	}
	if l.GetTrafficDirection() != core.TrafficDirection_INBOUND || l.GetBindToPort().GetValue() {
		t.Errorf("inbound listener direction %v, bind_to_port %v; want INBOUND, false", l.GetTrafficDirection(), l.GetBindToPort())
	}
	hcm, err := listenerHCM(l)
	if err != nil {
		t.Fatalf("inbound listener: %v", err)
	}
	if rc := hcm.GetRouteConfig(); rc == nil || len(rc.GetVirtualHosts()) != 1 {
		t.Errorf("inbound listener route = %v, want an inline route with one virtual host", hcm.GetRouteSpecifier())
	}
	if _, ok := upstream.Generation(l); !ok {
		t.Errorf("inbound listener carries no generation")
	}
}
