package upstream_test

import (
	"context"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// startIncremental is startUpstream with Config.IncrementalDelta.
func startIncremental(t *testing.T, sc upstream.Scenario) *upstream.Upstream {
	t.Helper()
	cfg := upstream.DefaultConfig()
	cfg.Scenario, cfg.IncrementalDelta = sc, true
	return startConfigured(t, cfg)
}

var allTypes = []string{resource.ClusterType, resource.EndpointType, resource.ListenerType, resource.RouteType}

// catchUp reads c's responses until its state is want's, at most limit
// of them (each wait bounded by waitTimeout), and returns them. Like
// Envoy, a Delta client subscribes to the endpoints of the clusters it
// holds as they come and go.
func catchUp(t *testing.T, c adsClient, want func() string, limit int) []update {
	t.Helper()
	var got []update
	for want() != "" {
		if len(got) == limit {
			t.Fatalf("after %d responses: %s", limit, want())
		}
		if dc, ok := c.(*deltaClient); ok {
			if eds := edsNames(t, dc.State()[resource.ClusterType]); !slices.Equal(eds, sortedKeys(dc.subs[resource.EndpointType])) {
				dc.Subscribe(resource.EndpointType, eds, false)
			}
		}
		got = append(got, c.NextAny())
	}
	return got
}

// TestIncrementalDeltaFollowsLinear runs the same churn (every kind of
// mutation, same seed) on two upstreams, one with IncrementalDelta, with
// an Envoy-like Delta client of three groups on each: after every step
// each client holds exactly its group's snapshot, with the versions the
// LinearCache gives, and a moved endpoint reaches the incremental clients
// as that one resource alone.
func TestIncrementalDeltaFollowsLinear(t *testing.T) {
	sc := testScenario()
	plain, inc := startUpstream(t, sc), startIncremental(t, sc)
	nodes := map[string]int{"ns-0": 0, "ns-2": 2, upstream.PublicGroup: 7}
	type pair struct{ plain, inc adsClient }
	clients := map[string]pair{}
	for g, ns := range nodes {
		p := pair{newDeltaClient(t, dial(t, plain.Addr()), sc.Node(ns, 0, 0)), newDeltaClient(t, dial(t, inc.Addr()), sc.Node(ns, 0, 0))}
		syncAll(t, p.plain)
		syncAll(t, p.inc)
		clients[g] = p
	}
	sameVersions := func(g string, p pair) {
		t.Helper()
		for _, typeURL := range allTypes {
			a, b := p.plain.(*deltaClient).Versions(typeURL), p.inc.(*deltaClient).Versions(typeURL)
			if !maps.Equal(a, b) {
				t.Fatalf("%s %s: incremental versions %v, LinearCache's %v", g, typeURL, b, a)
			}
		}
	}
	for g, p := range clients {
		if d := diffState(p.inc.State(), inc.Snapshot(g)); d != "" {
			t.Fatalf("%s after sync: %s", g, d)
		}
		sameVersions(g, p)
	}
	chP, chI := plain.NewChurner(7, 0.3), inc.NewChurner(7, 0.3)
	for step := range 40 {
		cp, err := chP.Step()
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		ci, err := chI.Step()
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		if len(cp) != len(ci) || cp[0].Name != ci[0].Name {
			t.Fatalf("step %d: the churns differ: %v and %v", step, cp, ci)
		}
		for g, p := range clients {
			catchUp(t, p.plain, func() string { return diffState(p.plain.State(), plain.Snapshot(g)) }, 8)
			got := catchUp(t, p.inc, func() string { return diffState(p.inc.State(), inc.Snapshot(g)) }, 8)
			if len(ci) == 1 && ci[0].TypeURL == resource.EndpointType && len(got) > 0 {
				if names := got[0].names(); !slices.Equal(names, []string{ci[0].Name}) || len(got) != 1 {
					t.Errorf("step %d, %s: a moved endpoint came as %d responses, the first with %v; want one with %s alone",
						step, g, len(got), names, ci[0].Name)
				}
			}
			sameVersions(g, p)
		}
	}
}

// TestIncrementalDeltaSubscriptions: wildcard (legacy and explicit) and
// named subscriptions of every type, a named unsubscribe and resubscribe,
// and a name unsubscribed from a wildcard, each answered as the protocol
// says.
func TestIncrementalDeltaSubscriptions(t *testing.T) {
	sc := testScenario()
	u := startIncremental(t, sc)
	conn := dial(t, u.Addr())
	snap := u.Snapshot("ns-0")
	for _, typeURL := range allTypes {
		short := typeURL[strings.LastIndex(typeURL, ".")+1:]
		t.Run(short, func(t *testing.T) {
			all := sortedKeys(snap[typeURL])
			c := newDeltaClient(t, conn, sc.Node(0, 0, 0))
			if got := c.Subscribe(typeURL, nil, true); !slices.Equal(got.names(), all) {
				t.Fatalf("legacy wildcard: %v, want %v", got.names(), all)
			}
			c2 := newDeltaClient(t, conn, sc.Node(0, 0, 0))
			if got := c2.Subscribe(typeURL, []string{"*"}, true); !slices.Equal(got.names(), all) {
				t.Fatalf("explicit wildcard: %v, want %v", got.names(), all)
			}
			// A name unsubscribed from a wildcard is sent again (it still
			// exists).
			c2.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesUnsubscribe: all[:1]})
			if got := c2.Next(typeURL); !slices.Equal(got.names(), all[:1]) {
				t.Fatalf("unsubscribed from a wildcard: %v, want %v", got.names(), all[:1])
			}
			c3 := newDeltaClient(t, conn, sc.Node(0, 0, 0))
			named := append(slices.Clone(all[:min(2, len(all))]), "no-such-name")
			if got := c3.Subscribe(typeURL, named, true); !slices.Equal(got.names(), all[:min(2, len(all))]) {
				t.Fatalf("named %v: %v", named, got.names())
			}
			// Unsubscribed, then subscribed again: sent again.
			c3.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesUnsubscribe: all[:1]})
			c3.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesSubscribe: all[:1]})
			if got := c3.Next(typeURL); !slices.Equal(got.names(), all[:1]) {
				t.Fatalf("resubscribed: %v, want %v", got.names(), all[:1])
			}
		})
	}
}

// TestIncrementalDeltaReconnect is TestDeltaReconnectInitialVersions with
// IncrementalDelta: a reconnect declaring what it holds is sent only what
// differs, and told what was removed.
func TestIncrementalDeltaReconnect(t *testing.T) {
	testDeltaReconnect(t, startIncremental)
}

// TestIncrementalDeltaConcurrentChurn churns from several goroutines while
// Delta clients of the incremental caches follow (the race detector
// watches the caches' locking); they end with Snapshot's state.
func TestIncrementalDeltaConcurrentChurn(t *testing.T) {
	sc := testScenario()
	u := startIncremental(t, sc)
	conn := dial(t, u.Addr())
	var clients []adsClient
	for range 3 {
		c := newDeltaClient(t, conn, sc.Node(0, 0, 0))
		syncAll(t, c)
		clients = append(clients, c)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for i := range 3 {
		wg.Go(func() {
			errs <- u.Churn(context.Background(), upstream.ChurnConfig{Rate: 5000, Count: 30, Seed: int64(i)}, nil)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("Churn: %v", err)
		}
	}
	want := u.Snapshot("ns-0")
	for _, c := range clients {
		catchUp(t, c, func() string { return diffState(c.State(), want) }, 200)
	}
}
