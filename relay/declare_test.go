package relay

import (
	"context"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// A restored EDS view holding a name no member asks for any more: the
// first upstream stream still declares what the key holds of the type
// (and probes it), and not the dropped name. Before, dropping the name
// set the versions to an empty tree and nothing was declared.
func TestRestoredDeclarationSurvivesADrop(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Upstream = "unused:1"
	cfg.UpstreamProtocol = ProtocolDelta
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	k := newKeyState(r, "k")
	m := r.newStream(context.Background(), false, portPlain)
	m.node = fuzzNode
	k.join(m)
	k.subscribe(xds.TypeEndpoint, false, false, nil, xds.NameSet{"c0"})
	b := ledger.Tree[*xds.Resource]{}.Edit()
	for _, n := range []string{"c0", "c1"} {
		a, _ := anypb.New(mkCLA(n, 8080))
		res, err := r.store.Decode(xds.TypeEndpoint, a, n)
		if err != nil {
			t.Fatal(err)
		}
		b.Set(res.Name, res.Hash, res)
	}
	k.views.Store(&keyViews{types: map[string]*typeView{xds.TypeEndpoint: {view: b.Tree(), ready: true}}, stale: true, restored: true})
	u := newFeed(k)
	u.seedRestored()
	var reqs []proto.Message
	u.send = func(m proto.Message) error { reqs = append(reqs, proto.Clone(m)); return nil }
	u.presented, u.node, u.first, u.delta = m, m.node, true, true
	if err := u.resubscribe(); err != nil {
		t.Fatal(err)
	}
	eds := 0
	for _, q := range reqs {
		if d, ok := q.(*discovery.DeltaDiscoveryRequest); ok && d.GetTypeUrl() == xds.TypeEndpoint {
			eds++
			if len(d.GetInitialResourceVersions()) == 0 {
				t.Errorf("the restored EDS view is not declared at all")
			}
			if _, ok := d.GetInitialResourceVersions()["c1"]; ok {
				t.Errorf("c1, dropped, is declared")
			}
		}
	}
	if eds != 1 {
		t.Fatalf("%d EDS subscriptions sent, want 1", eds)
	}
}
