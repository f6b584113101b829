package snapshot_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/snapshot"
	"github.com/meshrelay/meshrelay/shard"
)

// warmRelay is a relay with its store, on a real etcd.
type warmRelay struct {
	node *shard.Node
	r    *relay.Relay
	s    *snapshot.Store
	reg  *prometheus.Registry
}

func startWarmRelay(t *testing.T, etcd []string, upstreamAddr, id string) *warmRelay {
	t.Helper()
	reg := prometheus.NewRegistry()
	scfg := snapshot.DefaultConfig()
	scfg.Endpoints, scfg.Member, scfg.Registerer = etcd, id, reg
	scfg.FlushInterval = 20 * time.Millisecond
	scfg.RetryMax = 300 * time.Millisecond
	scfg.RequestTimeout = time.Second
	s, err := snapshot.New(scfg)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg := relay.DefaultConfig()
	cfg.ID, cfg.Upstream.Addr, cfg.XDS.Listener, cfg.Registerer, cfg.Gatherer, cfg.Keys.Snapshots = id, upstreamAddr, lis, reg, reg, s
	cfg.Upstream.BackoffMax = 300 * time.Millisecond
	cfg.Admin.Listen = "127.0.0.1:0"
	// The node starts the store, and stops it after the relay.
	node, err := shard.NewNode(shard.NodeConfig{Relay: cfg, Store: s})
	if err != nil {
		t.Fatal(err)
	}
	if err := node.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	w := &warmRelay{node: node, r: node.Relay(), s: s, reg: reg}
	t.Cleanup(func() { w.stop(t) })
	return w
}

func (w *warmRelay) stop(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.node.Stop(ctx); err != nil {
		t.Errorf("relay and store stop: %v", err)
	}
}

// eventually fails the test unless cond holds within 20 seconds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after 20s: %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// received records the resource names Envoys receive once armed.
type received struct {
	mu    sync.Mutex
	armed bool
	names map[string]int // "type|name" → responses that carried it
}

func (rc *received) onEvent(_ int, ev envoy.Event) {
	if ev.Kind != envoy.Received {
		return
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if !rc.armed {
		return
	}
	for _, n := range ev.Names {
		rc.names[ev.TypeURL+"|"+n]++
	}
}

func TestWarmStartWhileUpstreamIsDown(t *testing.T) {
	ctx := t.Context()
	etcd := startEtcd(t, "")
	up, sc := startUpstream(t, smallScenario())
	const keys = 3

	// A first relay syncs its Envoys and persists their keys.
	r1 := startWarmRelay(t, etcd.Endpoints(), up.Addr(), "relay-1")
	f1, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: sc, Envoys: 6, Keys: keys, Target: r1.r.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := f1.WaitSynced(wctx, up); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the relay persisted every key", func() bool {
		n, _ := r1.s.Behind()
		return n == 0 && counter(t, r1.reg, "meshrelay_snapshot_writes_total", "ok") >= keys
	})
	f1.Stop(ctx)
	r1.stop(t)
	// The upstream goes down, and changes meanwhile.
	if err := up.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	change, err := up.MoveEndpoint(0)
	if err != nil {
		t.Fatal(err)
	}

	// A relay started now serves the persisted config: to the same
	// Envoys coming back and to new ones, at once, marked stale.
	rc := &received{names: map[string]int{}}
	r2 := startWarmRelay(t, etcd.Endpoints(), up.Addr(), "relay-2")
	f2, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: sc, Envoys: 9, Keys: keys, Target: r2.r.Addr().String(), OnEvent: rc.onEvent})
	if err != nil {
		t.Fatal(err)
	}
	defer f2.Stop(context.Background())
	// Synced to the config as it was before the change: every Envoy holds
	// every cluster and endpoint of its group, and the moved endpoint at
	// its old generation.
	eventually(t, "Envoys served from the snapshot", func() bool {
		return f2.Synced(up) == 9-affected(f2, change) && holdListenersAndRoutes(f2, up)
	})
	if got := r2.r.Stats().StaleKeys; got != keys {
		t.Errorf("stale keys while the upstream is down = %d, want %d", got, keys)
	}
	if got := counter(t, r2.reg, "meshrelay_restored_keys_total", ""); got != keys {
		t.Errorf("restored keys = %v, want %d", got, keys)
	}

	// The upstream returns: the keys are confirmed, and the Envoys get
	// what changed in between, and nothing else.
	rc.mu.Lock()
	rc.armed = true
	rc.mu.Unlock()
	if err := up.Start(ctx); err != nil {
		t.Fatal(err)
	}
	wctx2, cancel2 := context.WithTimeout(ctx, 30*time.Second)
	defer cancel2()
	if err := f2.WaitSynced(wctx2, up); err != nil {
		t.Fatal(err)
	}
	eventually(t, "keys confirmed by the upstream", func() bool { return r2.r.Stats().StaleKeys == 0 })
	rc.mu.Lock()
	defer rc.mu.Unlock()
	for n := range rc.names {
		if n != change.TypeURL+"|"+change.Name {
			t.Errorf("after the upstream returned, Envoys received %s, which did not change", n)
		}
	}
	if got, want := rc.names[change.TypeURL+"|"+change.Name], affected(f2, change); got != want {
		t.Errorf("%s received %d times, want once by each of the %d Envoys that see it", change.Name, got, want)
	}
	if v := f2.Violations(); len(v) > 0 {
		t.Errorf("protocol violations: %v", v)
	}
}

// holdListenersAndRoutes reports whether every Envoy holds the listeners
// and routes of its group (Synced checks clusters and endpoints, which come
// first).
func holdListenersAndRoutes(f *traffic.Fleet, up *upstream.Upstream) bool {
	groups := f.Groups()
	for i, e := range f.Envoys() {
		snap := up.Snapshot(groups[i])
		for _, typeURL := range []string{envoy.ListenerType, envoy.RouteType} {
			held := e.Resources(typeURL)
			if len(held) != len(snap[typeURL]) {
				return false
			}
			for name := range snap[typeURL] {
				if _, ok := held[name]; !ok {
					return false
				}
			}
		}
	}
	return true
}

// affected counts the fleet's Envoys in the groups a change reached.
func affected(f *traffic.Fleet, c upstream.Change) int {
	n := 0
	for _, g := range f.Groups() {
		if slices.Contains(c.Groups, g) {
			n++
		}
	}
	return n
}

// counter reads a counter of reg (with one label value, or none); 0 if
// absent.
func counter(t *testing.T, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if label == "" || (len(m.GetLabel()) > 0 && m.GetLabel()[0].GetValue() == label) {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func TestEtcdDownWhileEnvoysChurn(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	etcd, err := snapshot.StartEmbedded(ctx, snapshot.EmbeddedConfig{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	endpoints := etcd.Endpoints()
	up, sc := startUpstream(t, smallScenario())
	r := startWarmRelay(t, endpoints, up.Addr(), "relay-1")
	fleet := func(n int) *traffic.Fleet {
		f, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: sc, Envoys: n, Keys: 3, Target: r.r.Addr().String()})
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	synced := func(f *traffic.Fleet) {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := f.WaitSynced(wctx, up); err != nil {
			t.Fatal(err)
		}
	}
	f1 := fleet(6)
	defer f1.Stop(context.Background())
	synced(f1)
	eventually(t, "every key persisted", func() bool { n, _ := r.s.Behind(); return n == 0 })

	etcd.Close()
	// Config changes and Envoys come and go while etcd is away: nothing
	// Envoys see changes.
	for i := range 5 {
		if _, err := up.MoveEndpoint(i); err != nil {
			t.Fatal(err)
		}
		f2 := fleet(3)
		synced(f1)
		synced(f2)
		f2.Stop(ctx)
	}
	if v := f1.Violations(); len(v) > 0 {
		t.Errorf("protocol violations while etcd was down: %v", v)
	}
	health := get(t, "http://"+r.r.AdminAddr().String()+"/healthz")
	if !strings.Contains(health, "snapshots: behind: 3 keys") {
		t.Errorf("/healthz while etcd is down:\n%s\nwant it to say the 3 keys are not persisted", health)
	}

	// etcd returns: persistence catches up with the latest config, as a
	// relay started from it (with the upstream down) shows.
	etcd2, err := snapshot.StartEmbedded(ctx, snapshot.EmbeddedConfig{Dir: dir}) // the same socket
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(etcd2.Close)
	eventually(t, "persistence caught up", func() bool { n, _ := r.s.Behind(); return n == 0 })
	if health := get(t, "http://"+r.r.AdminAddr().String()+"/healthz"); !strings.Contains(health, "snapshots: up to date") {
		t.Errorf("/healthz after etcd returned:\n%s\nwant snapshots up to date", health)
	}
	f1.Stop(ctx)
	r.stop(t)
	if err := up.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	r2 := startWarmRelay(t, endpoints, up.Addr(), "relay-2")
	f3, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: sc, Envoys: 6, Keys: 3, Target: r2.r.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	defer f3.Stop(context.Background())
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := f3.WaitSynced(wctx, up); err != nil {
		t.Fatalf("a relay warm-started from etcd after the outage: %v", err)
	}
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// startEtcd starts an embedded etcd in dir (its own temporary one if empty)
// and stops it at the end of the test.
func startEtcd(t *testing.T, dir string) *snapshot.Embedded {
	t.Helper()
	if dir == "" {
		dir = t.TempDir()
	}
	e, err := snapshot.StartEmbedded(t.Context(), snapshot.EmbeddedConfig{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e
}

// startUpstream starts the synthetic upstream with sc and stops it at the
// end of the test.
func startUpstream(t *testing.T, sc upstream.Scenario) (*upstream.Upstream, upstream.Scenario) {
	t.Helper()
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = sc
	up, err := upstream.New(ucfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := up.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { up.Stop(context.Background()) })
	return up, sc
}

// smallScenario is the upstream of these tests: 30 services, 60
// endpoints, 3 namespaces.
func smallScenario() upstream.Scenario {
	sc := upstream.DefaultScenario()
	sc.Services, sc.Endpoints, sc.Namespaces = 30, 60, 3
	return sc
}
