package upstream_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

func newUpstream(t *testing.T, sc upstream.Scenario) *upstream.Upstream {
	t.Helper()
	cfg := upstream.DefaultConfig()
	cfg.Scenario = sc
	u, err := upstream.New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return u
}

func TestChurnValidates(t *testing.T) {
	u := newUpstream(t, testScenario())
	tests := []struct {
		name string
		cfg  upstream.ChurnConfig
	}{
		{"unbounded", upstream.ChurnConfig{Rate: 10}},
		{"zero rate", upstream.ChurnConfig{Count: 1}},
		{"negative count", upstream.ChurnConfig{Rate: 10, Count: -1, Duration: time.Second}},
		{"negative duration", upstream.ChurnConfig{Rate: 10, Count: 1, Duration: -time.Second}},
		{"fraction above 1", upstream.ChurnConfig{Rate: 10, Count: 1, AddRemoveFraction: 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := u.Churn(context.Background(), tt.cfg, nil)
			if err == nil || !strings.HasPrefix(err.Error(), "upstream: field ChurnConfig.") {
				t.Fatalf("Churn(%+v) = %v, want a ChurnConfig field error", tt.cfg, err)
			}
		})
	}
}

func TestChurnBounds(t *testing.T) {
	tests := []struct {
		name    string
		cfg     upstream.ChurnConfig
		cancel  bool
		wantErr error
	}{
		{"count", upstream.ChurnConfig{Rate: 10000, Count: 5}, false, nil},
		{"duration", upstream.ChurnConfig{Rate: 100, Duration: 30 * time.Millisecond}, false, nil},
		{"context", upstream.ChurnConfig{Rate: 1, Count: 1000}, true, context.Canceled},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			u := newUpstream(t, testScenario())
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			n := 0
			err := u.Churn(ctx, tt.cfg, func(upstream.Change) {
				n++
				if tt.cancel {
					cancel()
				}
			})
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Churn() = %v, want %v", err, tt.wantErr)
			}
			if tt.cfg.Count > 0 && !tt.cancel && n != tt.cfg.Count {
				t.Errorf("Churn() made %d changes, want %d", n, tt.cfg.Count)
			}
			if tt.cancel && n != 1 {
				t.Errorf("Churn() made %d changes after cancel, want 1", n)
			}
		})
	}
}

// TestChurnChanges: every change has a generation larger than the previous
// change of the same resource, one generation per mutation, the same seed
// gives the same changes, and afterwards every group's configuration is
// consistent.
func TestChurnChanges(t *testing.T) {
	cfg := upstream.ChurnConfig{Rate: 10000, Count: 60, AddRemoveFraction: 0.4, Seed: 7}
	run := func() []upstream.Change {
		u := newUpstream(t, testScenario())
		var changes []upstream.Change
		if err := u.Churn(context.Background(), cfg, func(c upstream.Change) { changes = append(changes, c) }); err != nil {
			t.Fatalf("Churn: %v", err)
		}
		checkConsistent(t, u)
		return changes
	}
	a, b := run(), run()
	last := map[string]uint64{}
	gens := map[uint64]bool{}
	for i, c := range a {
		key := c.TypeURL + " " + c.Name
		if c.Generation <= last[key] {
			t.Fatalf("change %d: Generation(%s) = %d, want > %d", i, key, c.Generation, last[key])
		}
		last[key] = c.Generation
		gens[c.Generation] = true
		if b[i].TypeURL != c.TypeURL || b[i].Name != c.Name || b[i].Generation != c.Generation {
			t.Fatalf("change %d with the same seed = %+v, want %+v", i, b[i], c)
		}
	}
	if len(gens) != cfg.Count {
		t.Errorf("distinct generations = %d, want %d (one per mutation)", len(gens), cfg.Count)
	}
}

// checkConsistent checks references in every group: listeners name existing
// routes, virtual hosts route to existing clusters, every cluster has its
// load assignment and no assignment is orphaned.
func checkConsistent(t *testing.T, u *upstream.Upstream) {
	t.Helper()
	for _, g := range u.Groups() {
		snap := u.Snapshot(g)
		for name, m := range snap[resource.ListenerType] {
			hcm, err := listenerHCM(m.(*listenerv3.Listener))
			if err != nil {
				t.Fatalf("%s listener %s: %v", g, name, err)
			}
			if snap[resource.RouteType][hcm.GetRds().GetRouteConfigName()] == nil {
				t.Errorf("%s listener %s names missing route %q", g, name, hcm.GetRds().GetRouteConfigName())
			}
		}
		for name, m := range snap[resource.RouteType] {
			for _, vh := range m.(*routev3.RouteConfiguration).GetVirtualHosts() {
				for _, r := range vh.GetRoutes() {
					if snap[resource.ClusterType][r.GetRoute().GetCluster()] == nil {
						t.Errorf("%s route %s vhost %s routes to missing cluster %q", g, name, vh.GetName(), r.GetRoute().GetCluster())
					}
				}
			}
		}
		for name, m := range snap[resource.ClusterType] {
			if snap[resource.EndpointType][m.(*clusterv3.Cluster).GetEdsClusterConfig().GetServiceName()] == nil {
				t.Errorf("%s cluster %s has no load assignment", g, name)
			}
		}
		for name := range snap[resource.EndpointType] {
			if snap[resource.ClusterType][name] == nil {
				t.Errorf("%s load assignment %s has no cluster", g, name)
			}
		}
		for typeURL, res := range snap {
			for name, m := range res {
				if _, ok := upstream.Generation(m); !ok {
					t.Errorf("%s %s %s: Generation found none", g, typeURL, name)
				}
				if err := m.(interface{ ValidateAll() error }).ValidateAll(); err != nil {
					t.Errorf("%s %s %s: %v", g, typeURL, name, err)
				}
			}
		}
	}
}

func TestInitialConfigConsistent(t *testing.T) {
	checkConsistent(t, newUpstream(t, testScenario()))
}

// TestRun: the runner prints its address, serves, churns and stops on
// cancel.
func TestRun(t *testing.T) {
	cfg := upstream.DefaultConfig()
	cfg.Scenario = testScenario()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	lines := make(chan string)
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		defer close(lines)
		s := bufio.NewScanner(pr)
		for s.Scan() {
			lines <- s.Text()
		}
	}()
	runErr := make(chan error, 1)
	go func() {
		runErr <- upstream.Run(ctx, cfg, upstream.ChurnConfig{Rate: 1000, Count: 5, Seed: 1}, pw)
		pw.Close()
	}()

	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	var first string
	select {
	case first = <-lines:
	case err := <-runErr:
		t.Fatalf("Run returned early: %v", err)
	case <-timer.C:
		t.Fatalf("Run printed nothing within %v", waitTimeout)
	}
	const prefix = "upstream: listening on "
	addr, _, ok := strings.Cut(strings.TrimPrefix(first, prefix), " ")
	if !strings.HasPrefix(first, prefix) || !ok {
		t.Fatalf("first line = %q, want %q…", first, prefix)
	}
	c := newSotwClient(t, dial(t, addr), testScenario().Node(0, 0, 0))
	if got := c.Subscribe(resource.ClusterType, nil, true); len(got.Resources) == 0 {
		t.Fatalf("CDS from Run's upstream is empty")
	}
	cancel()
	var out []string
	for l := range lines { // ends when Run closes the pipe
		out = append(out, l)
	}
	<-readerDone
	if err := <-runErr; err != nil {
		t.Fatalf("Run() = %v, want nil after cancel", err)
	}
	if len(out) == 0 || out[len(out)-1] != "upstream: stopped" {
		t.Errorf("Run output ends %q, want %q", out, "upstream: stopped")
	}
}

// TestChurnerReplays checks what a restarted upstream process relies on:
// two upstreams stepped alike by Churners of the same seed serve the same
// resources at the same generations.
func TestChurnerReplays(t *testing.T) {
	a, b := newUpstream(t, testScenario()), newUpstream(t, testScenario())
	ca, cb := a.NewChurner(7, 0.3), b.NewChurner(7, 0.3)
	for i := range 60 {
		if _, err := ca.Step(); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if _, err := cb.Step(); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
	}
	if ca.Steps() != 60 {
		t.Errorf("Steps() = %d, want 60", ca.Steps())
	}
	for _, g := range a.Groups() {
		sa, sb := a.Snapshot(g), b.Snapshot(g)
		for typeURL, res := range sa {
			if len(res) != len(sb[typeURL]) {
				t.Fatalf("%s %s: %d resources against %d", g, typeURL, len(res), len(sb[typeURL]))
			}
			for name, m := range res {
				ga, _ := upstream.Generation(m)
				gb, _ := upstream.Generation(sb[typeURL][name])
				if ga != gb {
					t.Errorf("%s %s %s: generation %d against %d", g, typeURL, name, ga, gb)
				}
			}
		}
	}
}
