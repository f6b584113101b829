package relay

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// viewOf builds a view from resources, decoded and interned as the upstream
// client does.
func viewOf(t testing.TB, r *Relay, typeURL string, res ...types.Resource) ledger.Tree[*xds.Resource] {
	t.Helper()
	b := ledger.Tree[*xds.Resource]{}.Edit()
	for _, m := range res {
		a, err := anypb.New(m)
		if err != nil {
			t.Fatal(err)
		}
		x, err := r.store.Decode(typeURL, a, "")
		if err != nil {
			t.Fatal(err)
		}
		b.Set(x.Name, x.Hash, x)
	}
	return b.Tree()
}

// TestPushOrder drives one stream's sync directly, with a key whose four
// types all changed at once (as when a slow client catches up): updates go
// out CDS → EDS → LDS → RDS, then removals, each held until nothing the
// client holds refers to it.
func TestPushOrder(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocolName(delta), func(t *testing.T) {
			r := newTestRelay(t)
			k := newKeyState(r.cache, "k")
			s := r.srv.newStream(context.Background(), delta, portPlain)
			s.key = k
			var sent []string
			s.send = func(o *wire.Response) error {
				kind := "+"
				if (len(o.Updated) == 0 || len(o.Removed) > 0) && !o.Full {
					kind = "-" // a Delta removal may carry one held resource again (carrier)
				}
				if !delta && xds.FullStateSotW(o.TypeURL) && len(o.Updated) == 0 {
					kind = "-" // SotW removes by omission
				}
				sent = append(sent, kind+xds.ShortType(o.TypeURL))
				return nil
			}
			publish := func(cs, es, ls, rs []types.Resource) {
				k.mu.Lock()
				k.update(func(next *views.Set) {
					for typeURL, res := range map[string][]types.Resource{xds.TypeCluster: cs, xds.TypeEndpoint: es, xds.TypeListener: ls, xds.TypeRoute: rs} {
						next.Types[typeURL] = &views.Type{View: viewOf(t, r, typeURL, res...), Ready: true, Full: true}
					}
				})
				k.mu.Unlock()
			}
			s.subs[xds.TypeRoute] = &typeSub{typeURL: xds.TypeRoute, names: xds.NewNameSet([]string{"r80"}), awaitFirst: true}
			s.subs[xds.TypeListener] = &typeSub{typeURL: xds.TypeListener, wildcard: true, awaitFirst: true}
			s.subs[xds.TypeEndpoint] = &typeSub{typeURL: xds.TypeEndpoint, names: xds.NewNameSet([]string{"c0", "c1"}), awaitFirst: true}
			s.subs[xds.TypeCluster] = &typeSub{typeURL: xds.TypeCluster, wildcard: true, awaitFirst: true}

			publish(
				[]types.Resource{mkCluster("c0"), mkCluster("c1")},
				[]types.Resource{mkCLA("c0", 1), mkCLA("c1", 1)},
				[]types.Resource{mkListener("l80", "r80")},
				[]types.Resource{mkRoute("r80", "c0", "c1")})
			if err := s.sync(); err != nil {
				t.Fatal(err)
			}
			if want := []string{"+cds", "+eds", "+lds", "+rds"}; !slices.Equal(sent, want) {
				t.Fatalf("first sync sent %v, want %v", sent, want)
			}

			// c1 goes away everywhere, a listener changes, c0 changes.
			sent = nil
			publish(
				[]types.Resource{mkCluster("c0", "changed")},
				[]types.Resource{mkCLA("c0", 2)},
				[]types.Resource{mkListener("l80", "r80"), mkListener("l81", "r80")},
				[]types.Resource{mkRoute("r80", "c0")})
			if err := s.sync(); err != nil {
				t.Fatal(err)
			}
			want := []string{"+cds", "+eds", "+lds", "+rds", "-cds", "-eds"}
			if !delta {
				// SotW cannot remove EDS; the CDS removal is a full-state
				// response after the route update.
				want = []string{"+cds", "+eds", "+lds", "+rds", "-cds"}
			}
			if !slices.Equal(sent, want) {
				t.Fatalf("second sync sent %v, want %v", sent, want)
			}
			if got := fmt.Sprint(s.subs[xds.TypeCluster].known.Len()); got != "1" {
				t.Fatalf("client holds %s clusters after the removal, want 1", got)
			}
		})
	}
}

// TestRefIndexNotPoisoned: references computed from a tree a client
// declared (content unknown to the relay) are not remembered for its root,
// which the same content held by the relay shares.
func TestRefIndexNotPoisoned(t *testing.T) {
	r := newTestRelay(t)
	held := viewOf(t, r, xds.TypeRoute, mkRoute("r80", "c0", "c1"))
	declared := ledger.Tree[*xds.Resource]{}.Edit()
	for e := range held.All() {
		declared.Set(e.Name, e.Hash, nil) // as declared() builds it, content unknown
	}
	d := declared.Tree()
	if d.Root() != held.Root() {
		t.Fatal("declared and held trees should share a root")
	}
	if got := r.cache.refIndex.Names(d, xds.RefClusters); len(got) != 0 {
		t.Fatalf("references of unknown content = %v, want none", got)
	}
	if got := r.cache.refIndex.Names(held, xds.RefClusters); len(got) != 2 {
		t.Fatalf("references of the held route = %v, want c0 and c1", got)
	}
}
