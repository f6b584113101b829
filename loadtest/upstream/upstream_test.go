package upstream_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testScenario has, with LocalFraction 0.3, services 0 (ns-0), 2 and 5
// (ns-2) and 10 (ns-1) namespace-local; the others are public.
func testScenario() upstream.Scenario {
	return upstream.Scenario{
		Services:      12,
		Endpoints:     20,
		Namespaces:    3,
		LocalFraction: 0.3,
		Ports:         []uint32{80, 8080},
		GRPCServices:  []upstream.GRPCService{{Name: "greeter.test", Backend: "127.0.0.1:9"}},
	}
}

// startUpstream builds and starts an upstream on 127.0.0.1:0, stopped at
// cleanup.
func startUpstream(t *testing.T, sc upstream.Scenario) *upstream.Upstream {
	t.Helper()
	cfg := upstream.DefaultConfig()
	cfg.Scenario = sc
	return startConfigured(t, cfg)
}

// startConfigured builds and starts an upstream of cfg, stopped at
// cleanup.
func startConfigured(t *testing.T, cfg upstream.Config) *upstream.Upstream {
	t.Helper()
	u, err := upstream.New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if err := u.Start(context.Background()); err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		if err := u.Stop(context.Background()); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
	return u
}

func TestNewValidates(t *testing.T) {
	good := testScenario()
	tests := []struct {
		name    string
		edit    func(*upstream.Config)
		wantErr string // "" for success
	}{
		{"default", func(*upstream.Config) {}, ""},
		{"zero values get defaults", func(c *upstream.Config) {
			*c = upstream.Config{Scenario: upstream.Scenario{Services: 1, Namespaces: 1}}
		}, ""},
		{"no services", func(c *upstream.Config) { c.Scenario.Services = 0 }, "upstream: field Scenario.Services"},
		{"negative endpoints", func(c *upstream.Config) { c.Scenario.Endpoints = -1 }, "upstream: field Scenario.Endpoints"},
		{"no namespaces", func(c *upstream.Config) { c.Scenario.Namespaces = 0 }, "upstream: field Scenario.Namespaces"},
		{"local fraction above 1", func(c *upstream.Config) { c.Scenario.LocalFraction = 1.5 }, "upstream: field Scenario.LocalFraction"},
		{"port 0", func(c *upstream.Config) { c.Scenario.Ports = []uint32{0} }, "upstream: field Scenario.Ports"},
		{"duplicate port", func(c *upstream.Config) { c.Scenario.Ports = []uint32{80, 80} }, "upstream: field Scenario.Ports"},
		{"grpc without name", func(c *upstream.Config) {
			c.Scenario.GRPCServices = []upstream.GRPCService{{Backend: "127.0.0.1:1"}}
		}, "upstream: field Scenario.GRPCServices"},
		{"grpc bad backend", func(c *upstream.Config) {
			c.Scenario.GRPCServices = []upstream.GRPCService{{Name: "a.test", Backend: "127.0.0.1"}}
		}, "upstream: field Scenario.GRPCServices"},
		{"grpc duplicate", func(c *upstream.Config) {
			c.Scenario.GRPCServices = []upstream.GRPCService{{Name: "a", Backend: "h:1"}, {Name: "a", Backend: "h:2"}}
		}, "upstream: field Scenario.GRPCServices"},
		{"http without name", func(c *upstream.Config) {
			c.Scenario.HTTPServices = []upstream.HTTPService{{Listen: "127.0.0.1:1"}}
		}, "upstream: field Scenario.HTTPServices"},
		{"http bad listen", func(c *upstream.Config) {
			c.Scenario.HTTPServices = []upstream.HTTPService{{Name: "web", Listen: "127.0.0.1"}}
		}, "upstream: field Scenario.HTTPServices"},
		{"http bad backend", func(c *upstream.Config) {
			c.Scenario.HTTPServices = []upstream.HTTPService{{Name: "web", Listen: "127.0.0.1:1", Backends: []string{"127.0.0.1:0"}}}
		}, "upstream: field Scenario.HTTPServices"},
		{"http name of a grpc service", func(c *upstream.Config) {
			c.Scenario.GRPCServices = []upstream.GRPCService{{Name: "a", Backend: "h:1"}}
			c.Scenario.HTTPServices = []upstream.HTTPService{{Name: "a", Listen: "127.0.0.1:1"}}
		}, "upstream: field Scenario.HTTPServices"},
		{"inbound IPs", func(c *upstream.Config) { c.Scenario.InboundIPs = []string{"10.0.0.1", "fd00::1"} }, ""},
		{"inbound not an IP", func(c *upstream.Config) { c.Scenario.InboundIPs = []string{"10.0.0.1", "pod-1"} }, "upstream: field Scenario.InboundIPs"},
		{"inbound with a port", func(c *upstream.Config) { c.Scenario.InboundIPs = []string{"10.0.0.1:8080"} }, "upstream: field Scenario.InboundIPs"},
		{"inbound empty", func(c *upstream.Config) { c.Scenario.InboundIPs = []string{""} }, "upstream: field Scenario.InboundIPs"},
		{"inbound duplicate", func(c *upstream.Config) { c.Scenario.InboundIPs = []string{"10.0.0.1", "::ffff:10.0.0.1"} }, "upstream: field Scenario.InboundIPs"},
		{"bad listen", func(c *upstream.Config) { c.Listen = "nope" }, "upstream: field Listen"},
		{"negative max msg size", func(c *upstream.Config) { c.MaxMsgSize = -1 }, "upstream: field MaxMsgSize"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := upstream.DefaultConfig()
			cfg.Scenario = good
			tt.edit(&cfg)
			_, err := upstream.New(cfg)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("New() = %v, want success", err)
			case tt.wantErr != "" && (err == nil || !strings.HasPrefix(err.Error(), tt.wantErr)):
				t.Fatalf("New() = %v, want error starting %q", err, tt.wantErr)
			}
		})
	}
}

func TestNode(t *testing.T) {
	sc := testScenario()
	n := sc.Node(1, 2, 3)
	if want := "sidecar~10.129.2.3~wl-2-3.ns-1~ns-1.svc.cluster.local"; n.GetId() != want {
		t.Errorf("Node(1, 2, 3).Id = %q, want %q", n.GetId(), want)
	}
	md := n.GetMetadata().GetFields()
	wantMD := map[string]string{
		"ISTIO_VERSION":     "1.28.0",
		"NAMESPACE":         "ns-1",
		"CLUSTER_ID":        "Kubernetes",
		"INSTANCE_IPS":      "10.129.2.3",
		"INTERCEPTION_MODE": "REDIRECT",
		"MESH_ID":           "cluster.local",
		"SERVICE_ACCOUNT":   "wl-2",
		"WORKLOAD_NAME":     "wl-2",
		"NAME":              "wl-2-3",
	}
	for k, want := range wantMD {
		if got := md[k].GetStringValue(); got != want {
			t.Errorf("Node(1, 2, 3).Metadata[%s] = %q, want %q", k, got, want)
		}
	}
	labels := md["LABELS"].GetStructValue().GetFields()
	if labels["app"].GetStringValue() != "wl-2" || labels["version"].GetStringValue() != "v1" {
		t.Errorf("Node(1, 2, 3).Metadata[LABELS] = %v, want app=wl-2 version=v1", labels)
	}

	// Pods of a workload differ only in name and IP.
	other := sc.Node(1, 2, 4)
	for _, k := range []string{"NAMESPACE", "SERVICE_ACCOUNT", "WORKLOAD_NAME", "ISTIO_VERSION", "LABELS"} {
		if !proto.Equal(md[k], other.GetMetadata().GetFields()[k]) {
			t.Errorf("Node(1, 2, 3) and Node(1, 2, 4) differ in %s", k)
		}
	}
}

func TestNodeIPUnique(t *testing.T) {
	seen := map[string][3]int{}
	for _, ns := range []int{0, 1, 127, 128, 1000} {
		for _, wl := range []int{0, 1, 255, 256, 70000} {
			for _, pod := range []int{0, 1, 255, 256} {
				ip := upstream.NodeIP(ns, wl, pod)
				if _, err := netip.ParseAddr(ip); err != nil {
					t.Fatalf("NodeIP(%d, %d, %d) = %q, not an IP: %v", ns, wl, pod, ip, err)
				}
				if prev, dup := seen[ip]; dup {
					t.Fatalf("NodeIP(%d, %d, %d) = %q, same as NodeIP%v", ns, wl, pod, ip, prev)
				}
				seen[ip] = [3]int{ns, wl, pod}
			}
		}
	}
}

func TestGroup(t *testing.T) {
	sc := testScenario()
	str := structpb.NewStringValue
	tests := []struct {
		name string
		node *core.Node
		want string
	}{
		{"from metadata", sc.Node(2, 0, 0), "ns-2"},
		{"metadata wins over id", &core.Node{
			Id:       "sidecar~10.0.0.1~p.ns-1~ns-1.svc.cluster.local",
			Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{"NAMESPACE": str("ns-0")}},
		}, "ns-0"},
		{"from id", &core.Node{Id: "sidecar~10.0.0.1~p.ns-1~ns-1.svc.cluster.local"}, "ns-1"},
		{"unknown namespace", sc.Node(3, 0, 0), upstream.PublicGroup},
		{"foreign namespace", sc.Node(0, 0, 0), "ns-0"},
		{"non-canonical", &core.Node{Id: "sidecar~10.0.0.1~p.ns-01~ns-01.svc.cluster.local"}, upstream.PublicGroup},
		{"three-part id", &core.Node{Id: "sidecar~10.0.0.1~p.ns-1"}, upstream.PublicGroup},
		{"grpc client", &core.Node{Id: "grpc-client"}, upstream.PublicGroup},
		{"nil node", nil, upstream.PublicGroup},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := sc.Group(tt.node); got != tt.want {
				t.Errorf("Group(%v) = %q, want %q", tt.node.GetId(), got, tt.want)
			}
		})
	}
}

func TestGeneration(t *testing.T) {
	mark := func(g float64) *core.Metadata {
		return &core.Metadata{FilterMetadata: map[string]*structpb.Struct{upstream.MetadataKey: {
			Fields: map[string]*structpb.Value{"generation": structpb.NewNumberValue(g)},
		}}}
	}
	cla := &endpointv3.ClusterLoadAssignment{ClusterName: "c", Endpoints: []*endpointv3.LocalityLbEndpoints{{
		Metadata:    mark(7),
		LbEndpoints: []*endpointv3.LbEndpoint{{Metadata: mark(3)}, {Metadata: mark(5)}},
	}}}
	anyCluster, err := anypb.New(&clusterv3.Cluster{Name: "c", Metadata: mark(4)})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		msg    proto.Message
		want   uint64
		wantOK bool
	}{
		{"cluster", &clusterv3.Cluster{Metadata: mark(2)}, 2, true},
		{"listener", &listenerv3.Listener{Metadata: mark(9)}, 9, true},
		{"route configuration", &routev3.RouteConfiguration{Metadata: mark(11)}, 11, true},
		{"load assignment takes the largest", cla, 7, true},
		{"endpoint only", &endpointv3.ClusterLoadAssignment{Endpoints: []*endpointv3.LocalityLbEndpoints{{
			LbEndpoints: []*endpointv3.LbEndpoint{{Metadata: mark(6)}},
		}}}, 6, true},
		{"any", anyCluster, 4, true},
		{"no metadata", &clusterv3.Cluster{}, 0, false},
		{"fractional", &clusterv3.Cluster{Metadata: mark(1.5)}, 0, false},
		{"other type", &core.Node{}, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := upstream.Generation(tt.msg)
			if got != tt.want || ok != tt.wantOK {
				t.Errorf("Generation(%T) = %d, %v, want %d, %v", tt.msg, got, ok, tt.want, tt.wantOK)
			}
		})
	}
}

// TestSyncMatchesSnapshot: SotW and Delta streams, Envoy-style (CDS and LDS
// wildcard, EDS and RDS named), receive exactly Snapshot(group).
func TestSyncMatchesSnapshot(t *testing.T) {
	sc := testScenario()
	u := startUpstream(t, sc)
	conn := dial(t, u.Addr())
	nodes := []struct {
		node  *core.Node
		group string
	}{
		{sc.Node(0, 0, 0), "ns-0"},
		{sc.Node(1, 4, 0), "ns-1"},
		{sc.Node(7, 0, 0), upstream.PublicGroup},
	}
	for _, p := range protocols {
		for _, n := range nodes {
			t.Run(p.name+"/"+n.group, func(t *testing.T) {
				got := syncAll(t, p.open(t, conn, n.node))
				if d := diffState(got, u.Snapshot(n.group)); d != "" {
					t.Fatalf("state after sync: %s", d)
				}
			})
		}
	}
}

// TestSubscriptionModes checks LinearCache through the real server for
// wildcard (legacy and explicit "*") and named subscriptions of every type,
// in both protocols.
func TestSubscriptionModes(t *testing.T) {
	sc := testScenario()
	u := startUpstream(t, sc)
	conn := dial(t, u.Addr())
	snap := u.Snapshot("ns-0")
	named := map[string][]string{
		resource.ClusterType:  {sc.ClusterName(1), "cluster-greeter.test", "no-such-cluster"},
		resource.EndpointType: {sc.ClusterName(0), sc.ClusterName(3), "no-such-cla"},
		resource.ListenerType: {"0.0.0.0_80", "greeter.test"},
		resource.RouteType:    {"8080", "no-such-route"},
	}
	for _, p := range protocols {
		for _, typeURL := range []string{resource.ClusterType, resource.EndpointType, resource.ListenerType, resource.RouteType} {
			short := typeURL[strings.LastIndex(typeURL, ".")+1:]
			for _, mode := range []string{"legacy-wildcard", "explicit-wildcard", "named"} {
				t.Run(p.name+"/"+short+"/"+mode, func(t *testing.T) {
					c := p.open(t, conn, sc.Node(0, 0, 0))
					var names, want []string
					switch mode {
					case "legacy-wildcard":
						want = sortedKeys(snap[typeURL])
					case "explicit-wildcard":
						names, want = []string{"*"}, sortedKeys(snap[typeURL])
					case "named":
						names = named[typeURL]
						for _, n := range names {
							if _, ok := snap[typeURL][n]; ok {
								want = append(want, n)
							}
						}
						slices.Sort(want)
					}
					got := c.Subscribe(typeURL, names, true)
					if !slices.Equal(got.names(), want) {
						t.Fatalf("Subscribe(%s, %v) returned %v, want %v", short, names, got.names(), want)
					}
				})
			}
		}
	}
}

// TestNamespaceViews: with LocalFraction > 0, namespaces see different
// clusters, and the public group sees only what every namespace sees.
func TestNamespaceViews(t *testing.T) {
	sc := testScenario()
	u := startUpstream(t, sc)
	conn := dial(t, u.Addr())
	if got, want := u.Groups(), []string{"ns-0", "ns-1", "ns-2", upstream.PublicGroup}; !slices.Equal(got, want) {
		t.Fatalf("Groups() = %v, want %v", got, want)
	}
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			views := map[string][]string{}
			for ns := range 3 {
				c := p.open(t, conn, sc.Node(ns, 0, 0))
				views[upstream.NamespaceName(ns)] = c.Subscribe(resource.ClusterType, nil, true).names()
			}
			public := sortedKeys(u.Snapshot(upstream.PublicGroup)[resource.ClusterType])
			if slices.Equal(views["ns-0"], views["ns-1"]) {
				t.Fatalf("ns-0 and ns-1 see the same clusters %v", views["ns-0"])
			}
			for g, v := range views {
				if got, want := slices.Contains(v, sc.ClusterName(0)), g == "ns-0"; got != want {
					t.Errorf("%s sees local service 0 of ns-0 = %v, want %v", g, got, want)
				}
				for _, name := range public {
					if !slices.Contains(v, name) {
						t.Errorf("%s does not see public cluster %s", g, name)
					}
				}
				if want := sortedKeys(u.Snapshot(g)[resource.ClusterType]); !slices.Equal(v, want) {
					t.Errorf("%s got clusters %v, want %v", g, v, want)
				}
			}
		})
	}
}

// TestMoveEndpoint: moving a WorkloadEntry updates exactly its
// ClusterLoadAssignment, with a higher generation, and only in groups that
// see the service.
func TestMoveEndpoint(t *testing.T) {
	sc := testScenario()
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			u := startUpstream(t, sc)
			conn := dial(t, u.Addr())
			c0 := p.open(t, conn, sc.Node(0, 0, 0))
			c1 := p.open(t, conn, sc.Node(1, 0, 0))
			syncAll(t, c0)
			syncAll(t, c1)

			// Endpoint 12 backs service 0, local to ns-0: c1 must not see it.
			// Endpoint 1 backs service 1, public.
			for _, ep := range []int{12, 1} {
				svc := ep % sc.Services
				name := sc.ClusterName(svc)
				old, _ := upstream.Generation(c0.State()[resource.EndpointType][name])
				ch, err := u.MoveEndpoint(ep)
				if err != nil {
					t.Fatalf("MoveEndpoint(%d): %v", ep, err)
				}
				if ch.TypeURL != resource.EndpointType || ch.Name != name || ch.Generation <= old {
					t.Fatalf("MoveEndpoint(%d) = %+v, want EDS %s with generation > %d", ep, ch, name, old)
				}
				got := c0.Next(resource.EndpointType)
				if !slices.Equal(got.names(), []string{name}) || len(got.Removed) != 0 {
					t.Fatalf("EDS update after MoveEndpoint(%d) = %v removed %v, want only %s", ep, got.names(), got.Removed, name)
				}
				if g, _ := upstream.Generation(got.Resources[name]); g != ch.Generation {
					t.Fatalf("Generation(%s) = %d, want %d", name, g, ch.Generation)
				}
			}
			// c1 (ns-1) gets the public move only.
			got := c1.Next(resource.EndpointType)
			if want := []string{sc.ClusterName(1)}; !slices.Equal(got.names(), want) {
				t.Fatalf("ns-1 EDS update = %v, want %v", got.names(), want)
			}
			for _, c := range []struct {
				c     adsClient
				group string
			}{{c0, "ns-0"}, {c1, "ns-1"}} {
				if d := diffState(c.c.State(), u.Snapshot(c.group)); d != "" {
					t.Errorf("%s state after moves: %s", c.group, d)
				}
			}
			if _, err := u.MoveEndpoint(sc.Endpoints + 100); err == nil {
				t.Errorf("MoveEndpoint(%d) succeeded, want out of range", sc.Endpoints+100)
			}
		})
	}
}

// TestRemoveService: the route drops the virtual host first, then the
// cluster goes (SotW: full CDS state without it; Delta: removed_resources),
// then (Delta) its ClusterLoadAssignment.
func TestRemoveService(t *testing.T) {
	sc := testScenario()
	const svc = 1 // public, port 8080
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			u := startUpstream(t, sc)
			c := p.open(t, dial(t, u.Addr()), sc.Node(0, 0, 0))
			syncAll(t, c)
			c.Settle() // every watch open: the order on the wire is the order of publication
			name := sc.ClusterName(svc)

			changes, err := u.RemoveService(svc)
			if err != nil {
				t.Fatalf("RemoveService(%d): %v", svc, err)
			}
			var gotChanges []string
			for _, ch := range changes {
				gotChanges = append(gotChanges, ch.TypeURL+" "+ch.Name)
			}
			wantChanges := []string{resource.RouteType + " 8080", resource.ClusterType + " " + name, resource.EndpointType + " " + name}
			if !slices.Equal(gotChanges, wantChanges) {
				t.Fatalf("RemoveService(%d) changes = %v, want %v", svc, gotChanges, wantChanges)
			}

			rds := c.NextAny()
			if rds.TypeURL != resource.RouteType || !slices.Equal(rds.names(), []string{"8080"}) {
				t.Fatalf("first update = %s %v, want the route 8080", rds.TypeURL, rds.names())
			}
			for _, vh := range rds.Resources["8080"].(*routev3.RouteConfiguration).GetVirtualHosts() {
				if slices.Contains(vh.GetDomains(), sc.ServiceHost(svc)) {
					t.Fatalf("route 8080 still has a virtual host for %s", sc.ServiceHost(svc))
				}
			}
			cds := c.NextAny()
			if cds.TypeURL != resource.ClusterType || !slices.Equal(cds.Removed, []string{name}) {
				t.Fatalf("second update = %s removed %v, want cluster %s removed", cds.TypeURL, cds.Removed, name)
			}
			if p.name == "delta" {
				if len(cds.Resources) != 0 {
					t.Errorf("delta CDS update carries %v, want only the removal", cds.names())
				}
				eds := c.NextAny()
				if eds.TypeURL != resource.EndpointType || !slices.Equal(eds.Removed, []string{name}) {
					t.Fatalf("third update = %s removed %v, want load assignment %s removed", eds.TypeURL, eds.Removed, name)
				}
			} else {
				// SotW cannot remove EDS resources; Envoy drops the
				// assignment with its cluster, and so does this check.
				got := c.State()
				delete(got[resource.EndpointType], name)
				if d := diffState(got, u.Snapshot("ns-0")); d != "" {
					t.Fatalf("state after removal: %s", d)
				}
			}
			if _, err := u.RemoveService(svc); !errors.Is(err, upstream.ErrRemoved) {
				t.Errorf("RemoveService(%d) again = %v, want ErrRemoved", svc, err)
			}
			if _, err := u.MoveEndpoint(svc); !errors.Is(err, upstream.ErrRemoved) {
				t.Errorf("MoveEndpoint(%d) of a removed service = %v, want ErrRemoved", svc, err)
			}
		})
	}
}

// TestAddService: the cluster arrives before the route that uses it, and a
// SotW EDS request for the new cluster gets only the new assignment.
func TestAddService(t *testing.T) {
	sc := testScenario()
	const svc = 12 // the next index: ns-0, port 80, public
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			u := startUpstream(t, sc)
			c := p.open(t, dial(t, u.Addr()), sc.Node(0, 0, 0))
			syncAll(t, c)
			c.Settle() // every watch open: the order on the wire is the order of publication
			name := sc.ClusterName(svc)

			changes, err := u.AddService()
			if err != nil {
				t.Fatalf("AddService(): %v", err)
			}
			if len(changes) != 3 || changes[0].Name != name || changes[2].TypeURL != resource.RouteType {
				t.Fatalf("AddService() = %+v, want CDS, EDS %s then RDS", changes, name)
			}
			cds := c.NextAny()
			if cds.TypeURL != resource.ClusterType || cds.Resources[name] == nil {
				t.Fatalf("first update = %s %v, want the new cluster %s", cds.TypeURL, cds.names(), name)
			}
			if g, _ := upstream.Generation(cds.Resources[name]); g != changes[0].Generation {
				t.Errorf("Generation(%s) = %d, want %d", name, g, changes[0].Generation)
			}
			rds := c.NextAny()
			if rds.TypeURL != resource.RouteType || !slices.Equal(rds.names(), []string{"80"}) {
				t.Fatalf("second update = %s %v, want route 80", rds.TypeURL, rds.names())
			}
			eds := c.Subscribe(resource.EndpointType, edsNames(t, c.State()[resource.ClusterType]), true)
			if !slices.Equal(eds.names(), []string{name}) {
				t.Fatalf("EDS response for the new cluster = %v, want only %s", eds.names(), name)
			}
			if d := diffState(c.State(), u.Snapshot("ns-0")); d != "" {
				t.Fatalf("state after AddService: %s", d)
			}
		})
	}
}

// TestStopStart: a killed and restarted upstream serves the same content on
// the same address, and generations keep growing.
func TestStopStart(t *testing.T) {
	sc := testScenario()
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			u := startUpstream(t, sc)
			addr := u.Addr()
			before := syncAll(t, p.open(t, dial(t, addr), sc.Node(0, 0, 0)))
			// A client on its own connection sees the stream fail.
			c := p.open(t, dial(t, addr), sc.Node(0, 0, 0))
			c.Subscribe(resource.ClusterType, nil, true)

			if err := u.Stop(context.Background()); err != nil {
				t.Fatalf("Stop: %v", err)
			}
			if err := c.WaitClosed(); err == nil {
				t.Fatalf("stream ended without error after Stop")
			}
			if got := u.Stats().OpenStreams; got != 0 {
				t.Errorf("Stats().OpenStreams after Stop = %d, want 0", got)
			}
			if err := u.Start(context.Background()); err != nil {
				t.Fatalf("Start after Stop: %v", err)
			}
			if u.Addr() != addr {
				t.Fatalf("Addr() after restart = %q, want %q", u.Addr(), addr)
			}
			c2 := p.open(t, dial(t, addr), sc.Node(0, 0, 0))
			after := syncAll(t, c2)
			if d := diffState(after, before); d != "" {
				t.Fatalf("content after restart: %s", d)
			}
			name := sc.ClusterName(1)
			old, _ := upstream.Generation(after[resource.EndpointType][name])
			if _, err := u.MoveEndpoint(1); err != nil {
				t.Fatalf("MoveEndpoint(1): %v", err)
			}
			if g, _ := upstream.Generation(c2.Next(resource.EndpointType).Resources[name]); g <= old {
				t.Fatalf("Generation(%s) after restart and move = %d, want > %d", name, g, old)
			}
		})
	}
}

func TestStartStopLifecycle(t *testing.T) {
	u, err := upstream.New(upstream.DefaultConfig())
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ctx := context.Background()
	if err := u.Stop(ctx); err != nil {
		t.Fatalf("Stop before Start = %v, want nil", err)
	}
	if err := u.Start(ctx); err != nil {
		t.Fatalf("Start: %v", err)
	}
	if err := u.Start(ctx); err == nil {
		t.Fatalf("second Start succeeded, want error")
	}
	for i := range 2 {
		if err := u.Stop(ctx); err != nil {
			t.Fatalf("Stop #%d = %v, want nil", i+1, err)
		}
	}
}

// TestDeltaReconnectInitialVersions: a Delta client that reconnects with
// initial_resource_versions gets only what changed, and removals made while
// it was away (istio #41494). Resource versions are content hashes, so they
// survive a restart (Contour #6250).
func TestDeltaReconnectInitialVersions(t *testing.T) {
	testDeltaReconnect(t, startUpstream)
}

// testDeltaReconnect is TestDeltaReconnectInitialVersions on an upstream
// that start starts.
func testDeltaReconnect(t *testing.T, start func(*testing.T, upstream.Scenario) *upstream.Upstream) {
	sc := testScenario()
	u := start(t, sc)
	c := newDeltaClient(t, dial(t, u.Addr()), sc.Node(0, 0, 0))
	c.Subscribe(resource.ClusterType, nil, true)
	known := c.Versions(resource.ClusterType)

	if err := u.Stop(context.Background()); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if err := u.Start(context.Background()); err != nil {
		t.Fatalf("Start: %v", err)
	}
	removed, err := u.RemoveService(3)
	if err != nil {
		t.Fatalf("RemoveService(3): %v", err)
	}
	known[sc.ClusterName(4)] = "stale"

	c2 := newDeltaClient(t, dial(t, u.Addr()), sc.Node(0, 0, 0))
	c2.send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType, InitialResourceVersions: known})
	got := c2.Next(resource.ClusterType)
	if want := []string{sc.ClusterName(4)}; !slices.Equal(got.names(), want) {
		t.Errorf("reconnect resources = %v, want %v", got.names(), want)
	}
	if want := []string{removed[1].Name}; !slices.Equal(got.Removed, want) {
		t.Errorf("reconnect removed = %v, want %v", got.Removed, want)
	}
}

// TestUnknownTypeKeepsStream: a type the upstream does not serve (Istio's
// NDS) is never answered and does not end the stream.
func TestUnknownTypeKeepsStream(t *testing.T) {
	sc := testScenario()
	u := startUpstream(t, sc)
	conn := dial(t, u.Addr())
	const nds = "type.googleapis.com/istio.networking.nds.v1.NameTable"
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			c := p.open(t, conn, sc.Node(0, 0, 0))
			c.SendRaw(nds, nil)
			if got := c.Subscribe(resource.ClusterType, nil, true); len(got.Resources) == 0 {
				t.Fatalf("CDS after NDS request returned nothing")
			}
			if n, _ := c.Received(); n != 1 {
				t.Fatalf("responses received = %d, want 1 (CDS only)", n)
			}
		})
	}
}

// TestStats: the counters match what clients received.
func TestStats(t *testing.T) {
	sc := testScenario()
	u := startUpstream(t, sc)
	conn := dial(t, u.Addr())
	var responses, bytes int
	for _, p := range protocols {
		c := p.open(t, conn, sc.Node(0, 0, 0))
		syncAll(t, c)
		n, b := c.Received()
		responses += n
		bytes += b
	}
	s := u.Stats()
	if s.OpenStreams != 2 || s.StreamsOpened != 2 {
		t.Errorf("Stats() streams = %d open, %d opened, want 2, 2", s.OpenStreams, s.StreamsOpened)
	}
	if s.Responses != uint64(responses) || s.BytesSent != uint64(bytes) {
		t.Errorf("Stats() = %d responses, %d bytes, want %d, %d", s.Responses, s.BytesSent, responses, bytes)
	}
	if s.Requests < 8 {
		t.Errorf("Stats().Requests = %d, want >= 8", s.Requests)
	}
	node := sc.Node(0, 0, 0).GetId()
	if got := u.StreamsByNode(); len(got) != 1 || got[node] != 2 {
		t.Errorf("StreamsByNode() = %v, want {%s: 2}", got, node)
	}
	if _, err := u.MoveEndpoint(1); err != nil {
		t.Fatalf("MoveEndpoint(1): %v", err)
	}
	if got := u.Stats().Changes; got != 1 {
		t.Errorf("Stats().Changes = %d, want 1", got)
	}
}

// TestConcurrentChurnWithClients runs churn from several goroutines while
// clients follow; the clients fail on any generation going back, and end up
// with Snapshot's endpoints.
func TestConcurrentChurnWithClients(t *testing.T) {
	sc := testScenario()
	u := startUpstream(t, sc)
	conn := dial(t, u.Addr())
	clients := map[string]adsClient{}
	for _, p := range protocols {
		clients[p.name] = p.open(t, conn, sc.Node(0, 0, 0))
		syncAll(t, clients[p.name])
	}
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for i := range 3 {
		wg.Go(func() {
			errs <- u.Churn(context.Background(), upstream.ChurnConfig{Rate: 5000, Count: 30, Seed: int64(i)}, nil)
		})
	}
	wg.Go(func() {
		for range 20 {
			u.Snapshot("ns-0")
		}
		errs <- nil
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("Churn: %v", err)
		}
	}
	want := u.Snapshot("ns-0")
	for name, c := range clients {
		// Bounded: each Next waits at most waitTimeout, and there were at most
		// 90 changes.
		for i := 0; diffState(c.State(), want) != ""; i++ {
			if i > 90 {
				t.Fatalf("%s: state differs after 90 updates: %s", name, diffState(c.State(), want))
			}
			c.Next(resource.EndpointType)
		}
	}
}

// ExampleScenario_Node shows the Istio-shaped node convention.
func ExampleScenario_Node() {
	sc := upstream.Scenario{Services: 10, Namespaces: 2}
	n := sc.Node(1, 3, 0)
	fmt.Println(n.GetId())
	fmt.Println(sc.Group(n), sc.Group(sc.Node(5, 0, 0)))
	// Output:
	// sidecar~10.129.3.0~wl-3-0.ns-1~ns-1.svc.cluster.local
	// ns-1 public
}
