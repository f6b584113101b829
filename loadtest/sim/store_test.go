package sim

import (
	"context"
	"errors"
	"testing"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// clusters is a CDS view of the named clusters.
func clusters(t *testing.T, names ...string) []xds.View {
	t.Helper()
	b := ledger.Tree[*xds.Resource]{}.Edit()
	for _, n := range names {
		body, err := proto.Marshal(&cluster.Cluster{Name: n})
		if err != nil {
			t.Fatal(err)
		}
		h := xds.ContentHash(xds.TypeCluster, body)
		b.Set(n, h, &xds.Resource{Type: xds.TypeCluster, Name: n, Hash: h, Body: &anypb.Any{TypeUrl: xds.TypeCluster, Value: body}})
	}
	return []xds.View{{Type: xds.TypeCluster, Full: true, Tree: b.Tree()}}
}

// loaded returns the cluster names persisted for key.
func loaded(t *testing.T, s *Store, key string) []string {
	t.Helper()
	saved, err := s.load()
	if err != nil {
		t.Fatal(err)
	}
	for _, sk := range saved {
		if sk.Key == key {
			var names []string
			for _, r := range sk.Types[0].Resources {
				names = append(names, r.Name)
			}
			return names
		}
	}
	return nil
}

// TestStoreFencing: relay/snapshot's fencing, which the relay relies on: the
// last member to claim a key writes it; a member fenced off does not
// overwrite its successor, and claims the key again only for a later term.
func TestStoreFencing(t *testing.T) {
	s := NewStore()
	old, successor := s.Client("relay-0-1", 0), s.Client("relay-1-1", 0)
	old.Save("k", 1, clusters(t, "a"))
	if !old.writeAll() {
		t.Fatal("first write failed")
	}
	successor.Save("k", 1, clusters(t, "b"))
	successor.writeAll() // claims k: old is fenced off
	old.Save("k", 1, clusters(t, "stale"))
	old.writeAll()
	if got := loaded(t, s, "k"); len(got) != 1 || got[0] != "b" {
		t.Fatalf("after the deposed member wrote: %v, want [b]", got)
	}
	old.Save("k", 1, clusters(t, "stale-again"))
	old.writeAll()
	if got := loaded(t, s, "k"); got[0] != "b" {
		t.Fatalf("a deposed member wrote again in the same term: %v", got)
	}
	old.Save("k", 2, clusters(t, "c")) // its ring changed: it owns k again
	old.writeAll()
	if got := loaded(t, s, "k"); got[0] != "c" {
		t.Fatalf("after a later term: %v, want [c]", got)
	}
	// Roots check out: the relay restores what Load returns.
	saved, _ := old.Load(context.Background())
	if saved[0].Types[0].Root != clusters(t, "c")[0].Tree.Root() {
		t.Fatal("persisted root is not the view's")
	}
}

// TestStoreDown: while down, loads fail and writes wait; they go through
// once it is back.
func TestStoreDown(t *testing.T) {
	s := NewStore()
	c := s.Client("relay-0-1", 0)
	s.SetDown(true)
	if _, err := c.Load(context.Background()); !errors.Is(err, ErrStoreDown) {
		t.Fatalf("Load while down: %v", err)
	}
	c.Save("k", 1, clusters(t, "a"))
	if c.writeAll() {
		t.Fatal("a write went through while the store was down")
	}
	s.SetDown(false)
	if !c.writeAll() {
		t.Fatal("the write kept failing once the store was back")
	}
	if got := loaded(t, s, "k"); len(got) != 1 || got[0] != "a" {
		t.Fatalf("persisted %v, want [a]", got)
	}
}
