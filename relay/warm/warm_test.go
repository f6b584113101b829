package warm

import (
	"testing"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// savedClusters is a persisted CDS view of EDS clusters, as Load returns it,
// with the root its owner computed.
func savedClusters(t *testing.T, names ...string) xds.SavedType {
	t.Helper()
	st := xds.SavedType{Type: xds.TypeCluster}
	b := ledger.Tree[*xds.Resource]{}.Edit()
	for _, n := range names {
		body, err := proto.Marshal(&cluster.Cluster{Name: n, ClusterDiscoveryType: &cluster.Cluster_Type{Type: cluster.Cluster_EDS}})
		if err != nil {
			t.Fatal(err)
		}
		st.Resources = append(st.Resources, xds.SavedResource{Name: n, Body: body})
		b.Set(n, xds.ContentHash(xds.TypeCluster, body), nil)
	}
	st.Root = b.Tree().Root()
	return st
}

// TestRestorerSharesAndChecks: keys that persisted the same view get one
// tree, whose resources are the store's; a view whose bytes are not what
// its root commits to is refused, and does not spoil a good copy that
// claims the same root; references are counted from what was restored.
func TestRestorerSharesAndChecks(t *testing.T) {
	good := savedClusters(t, "c0", "c1")
	again := savedClusters(t, "c0", "c1") // another key's copy: its own byte slices
	damaged := savedClusters(t, "c0", "c1")
	damaged.Resources[1].Body = append([]byte(nil), damaged.Resources[1].Body...)
	damaged.Resources[1].Body[len(damaged.Resources[1].Body)-1] ^= 1 // a byte off: not what the root commits to
	forged := savedClusters(t, "c0", "c1")
	forged.Resources[1].Name = "c9" // the body says c1

	store := xds.NewStore()
	rs := NewRestorer(store)
	rs.Prebuild([]xds.SavedKey{
		{Key: "bad", Types: []xds.SavedType{damaged, forged}},
		{Key: "a", Types: []xds.SavedType{good}},
		{Key: "b", Types: []xds.SavedType{again}},
	})
	ta, ok := rs.Tree(good)
	if !ok || ta.Root() != good.Root || ta.Len() != 2 {
		t.Fatalf("Tree(good) = %d resources at %v, %v; want both, at the persisted root", ta.Len(), ta.Root(), ok)
	}
	tb, ok := rs.Tree(again)
	if !ok {
		t.Fatal("the second key's copy of the view was not restored")
	}
	for e := range ta.All() {
		other, _ := tb.Get(e.Name)
		if e.Value == nil || e.Value != other.Value || store.Lookup(e.Hash) != e.Value {
			t.Errorf("resource %s: the two keys hold %p and %p, the store %p: want one, the store's", e.Name, e.Value, other.Value, store.Lookup(e.Hash))
		}
	}
	if _, ok := rs.Tree(xds.SavedType{Type: xds.TypeCluster, Root: ledger.HashBytes([]byte("never persisted"))}); ok {
		t.Error("Tree of a root nobody persisted: found")
	}
	refs := rs.RefCounts(xds.TypeCluster, xds.RefEndpoints, ta)
	if len(refs) != 2 || refs["c0"] != 1 || refs["c1"] != 1 {
		t.Errorf("RefCounts = %v, want c0 and c1 once each (an EDS cluster names its own endpoints)", refs)
	}
	calls := 0
	missing := func() []string { calls++; return []string{"c1"} }
	if m := rs.MissingOf("sig", missing); len(m) != 1 || m[0] != "c1" {
		t.Errorf("MissingOf = %v, want [c1]", m)
	}
	rs.MissingOf("sig", missing)
	if calls != 1 {
		t.Errorf("MissingOf computed %d times for one pair of views, want once", calls)
	}
}
