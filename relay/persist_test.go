package relay

import (
	"context"
	"testing"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// savedSnapshots is a Snapshots that loads fixed keys and records saves.
type savedSnapshots struct{ keys []xds.SavedKey }

func (s *savedSnapshots) Save(string, uint64, []xds.View)              { /* not what these tests look at */ }
func (s *savedSnapshots) Load(context.Context) ([]xds.SavedKey, error) { return s.keys, nil }

// savedClusters returns a persisted cluster view of names, with its true
// root.
func savedClusters(t *testing.T, names ...string) xds.SavedType {
	t.Helper()
	st := xds.SavedType{Type: xds.TypeCluster, Full: true}
	b := ledger.Tree[struct{}]{}.Edit()
	for _, n := range names {
		body, err := proto.Marshal(&cluster.Cluster{Name: n})
		if err != nil {
			t.Fatal(err)
		}
		st.Resources = append(st.Resources, xds.SavedResource{Name: n, Body: body})
		b.Set(n, xds.ContentHash(xds.TypeCluster, body), struct{}{})
	}
	st.Root = b.Tree().Root()
	return st
}

// TestRestoreChecksRoots: a persisted view is restored only if its
// resources hash to its root; keys that share a view share one tree.
func TestRestoreChecksRoots(t *testing.T) {
	good := savedClusters(t, "a", "b")
	forged := savedClusters(t, "a", "b", "c")
	forged.Root = good.Root // the record claims a root its content does not have
	forgedOnly := savedClusters(t, "x")
	forgedOnly.Root = ledger.HashBytes([]byte("forged"))
	snaps := &savedSnapshots{keys: []xds.SavedKey{
		{Key: "k0", Types: []xds.SavedType{forged}}, // first: it must not spoil k1's
		{Key: "k1", Types: []xds.SavedType{good}},
		{Key: "k2", Types: []xds.SavedType{good}},
		{Key: "k3", Types: []xds.SavedType{forgedOnly}},
	}}
	up := newTestUpstream(t, "ns1")
	r := startRelay(t, up, func(c *Config) { c.Keys.Snapshots = snaps })
	deadline := time.Now().Add(10 * time.Second)
	for !r.Ready() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := r.Stats().RestoredKeys; got != 3 {
		t.Errorf("RestoredKeys = %d, want 3 (k3's view matches no root)", got)
	}
	k1, k2, k3 := r.cache.key("k1"), r.cache.key("k2"), r.cache.key("k3")
	if k1 == nil || k2 == nil || k3 != nil {
		t.Fatalf("restored k1 %v, k2 %v, k3 %v; want k1 and k2 only", k1 != nil, k2 != nil, k3 != nil)
	}
	v1 := k1.views.Load().Types[xds.TypeCluster].View
	v2 := k2.views.Load().Types[xds.TypeCluster].View
	if v1.Root() != good.Root || v1.Len() != 2 {
		t.Errorf("k1's clusters: root %s, %d entries; want the persisted root and 2", v1.Root(), v1.Len())
	}
	if !v1.Shares(v2) {
		t.Error("k1 and k2 persisted the same view but hold two trees")
	}
	// k0's record claims k1's root with other content: it gets the content
	// the root commits to.
	k0 := r.cache.key("k0")
	if v0 := k0.views.Load().Types[xds.TypeCluster].View; !v0.Shares(v1) {
		t.Errorf("k0 holds %d clusters, want the 2 its root commits to", v0.Len())
	}
	if !k1.views.Load().Stale {
		t.Error("a restored key is not stale before its source confirms it")
	}
}

// TestRestoredViewReplacesNothingDeclared: a view restored from a snapshot
// has no Order and may be older than anything. It is served to a client
// that holds nothing, but a client that declares other content, even
// content without an Order (a relay of a release before Orders), keeps
// it until a live view arrives. The chaos suite saw the opposite: a relay
// restarted warm became a key's owner and sent its peer the snapshot's
// content, generation 1 after 41, which the peer passed on to its Envoys.
func TestRestoredViewReplacesNothingDeclared(t *testing.T) {
	n := node("ns1", "app", 0)
	key := string(aggkey.Istio{}.Key(n))
	saved := savedClusters(t, "a", "b")
	up := newTestUpstream(t, "ns1")
	up.set("ns1", xds.TypeCluster, mkCluster("a"), mkCluster("c"))
	up.stop() // the view stays the snapshot's
	r := startRelay(t, up, func(c *Config) {
		c.Keys.Snapshots = &savedSnapshots{keys: []xds.SavedKey{{Key: key, Types: []xds.SavedType{saved}}}}
		c.Upstream.BackoffInitial, c.Upstream.BackoffMax = 50*time.Millisecond, 200*time.Millisecond // back at once
	})
	waitFor(t, "the key restored", func() bool { return r.Stats().RestoredKeys == 1 })

	fresh := newRawClient(t, dial(t, r.Addr().String()), true, n)
	fresh.subscribe(xds.TypeCluster)
	wantNames(t, fresh.recvDelta(xds.TypeCluster), "a", "b") // holds nothing: served

	moved := newRawClient(t, dial(t, r.Addr().String()), true, node("ns1", "app", 1))
	declared := map[string]string{ // plain content versions: no Order
		"a": xds.ContentHash(xds.TypeCluster, mustAny(mkCluster("a")).GetValue()).String(),
		"c": xds.ContentHash(xds.TypeCluster, mustAny(mkCluster("c")).GetValue()).String(),
	}
	moved.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster, InitialResourceVersions: declared})
	// The upstream is down: the client is sent nothing (a barrier cannot
	// pass either). Once it is back, the first response is the live view's,
	// which is what the client holds.
	up.restart()
	m := moved.recvDelta(xds.TypeCluster)
	if len(m.GetResources()) != 0 || len(m.GetRemovedResources()) != 0 {
		t.Fatalf("the client holding a and c got %v, removed %v; want nothing (the snapshot's b, or c removed, before the live view)", names(m), removedOf(m))
	}
}
