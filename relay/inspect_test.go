package relay

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

const (
	privateKey = "-----BEGIN EC PRIVATE KEY-----\nsecret-key-bytes\n-----END EC PRIVATE KEY-----"
	certChain  = "-----BEGIN CERTIFICATE-----\npublic-cert\n-----END CERTIFICATE-----"
)

func inline(s string) *core.DataSource {
	return &core.DataSource{Specifier: &core.DataSource_InlineString{InlineString: s}}
}

// nameOfAny is the name of the resource a holds.
func nameOfAny(t *testing.T, a *anypb.Any) string {
	t.Helper()
	m, err := a.UnmarshalNew()
	if err != nil {
		t.Fatal(err)
	}
	return cache.GetResourceName(m)
}

// TestInspect: a relay describes a key (counts, sizes, versions, what it
// subscribes to) and dumps what it sent a node, and a key's views, as
// Envoy's config dump: every resource at the version the client holds, the
// Secret's private key redacted.
func TestInspect(t *testing.T) {
	e := newEnv(t, true, nil)
	e.up.set("ns1", xds.TypeSecret, &tlsv3.Secret{Name: "default", Type: &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{
		CertificateChain: inline(certChain), PrivateKey: inline(privateKey)}}})
	c := e.client(0)
	got := syncAll(c)
	c.subscribe(xds.TypeSecret, "default")
	sds := c.recv()
	c.ack(sds)
	got[xds.TypeSecret] = sds
	held := map[string]string{} // type|name → content version the client holds
	for typeURL, m := range got {
		for _, r := range m.(*discovery.DeltaDiscoveryResponse).GetResources() {
			h, _, err := wire.ParseVersion(r.GetVersion())
			if err != nil {
				t.Fatal(err)
			}
			held[typeURL+"|"+r.GetName()] = h.String()
		}
	}
	ctx := context.Background()
	e.waitLedger(t, "the client's ACKs", ledger.Convergence{Envoys: 1, Current: 1}, "")
	key := string(e.r.cache.heldKeys()[0].key)

	t.Run("key detail", func(t *testing.T) {
		d, err := e.r.KeyDetail(key, 2)
		if err != nil {
			t.Fatal(err)
		}
		if d.GetEnvoys() != 1 || d.GetSource() != "upstream" || d.GetStale() || len(d.GetPeers()) != 0 {
			t.Fatalf("KeyDetail = %v, want 1 Envoy, source upstream, fresh, no peers", d)
		}
		byType := map[string]*inspectpb.TypeDetail{}
		var order []string
		for _, td := range d.GetTypes() {
			byType[td.GetType()], order = td, append(order, xds.ShortType(td.GetType()))
		}
		if want := []string{"cds", "eds", "lds", "rds", "sds"}; !slices.Equal(order, want) {
			t.Fatalf("KeyDetail types %v, want %v (push order)", order, want)
		}
		snap := e.r.cache.heldKeys()[0].views.Load()
		for typeURL, td := range byType {
			view := snap.Types[typeURL].View
			bytes := 0
			for en := range view.All() {
				bytes += en.Value.Size()
			}
			if td.GetResources() != int64(view.Len()) || td.GetBytes() != int64(bytes) || td.GetVersion() != view.Root().String() || !td.GetReady() {
				t.Errorf("%s: %v; want %d resources, %d bytes, version %s, ready", xds.ShortType(typeURL), td, view.Len(), bytes, view.Root())
			}
		}
		if cds := byType[xds.TypeCluster]; !cds.GetWildcard() {
			t.Errorf("cds: %v, want wildcard", cds)
		}
		if eds := byType[xds.TypeEndpoint]; eds.GetWildcard() || eds.GetNamesTotal() != 3 || !slices.Equal(eds.GetNames(), []string{"c0", "c1"}) {
			t.Errorf("eds: %v, want 3 names subscribed, the first 2 listed", eds)
		}
		if _, err := e.r.KeyDetail("no-such-key", 0); !errors.Is(err, ErrNotHeld) {
			t.Errorf("KeyDetail(no-such-key) err = %v, want ErrNotHeld", err)
		}
	})

	dumpOf := func(t *testing.T, req *inspectpb.ConfigDumpRequest) (map[string]string, string) {
		t.Helper()
		d, err := e.r.ConfigDump(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		var cd adminv3.ConfigDump
		if err := d.GetConfigDump().UnmarshalTo(&cd); err != nil {
			t.Fatal(err)
		}
		js, err := protojson.Marshal(&cd)
		if err != nil {
			t.Fatal(err)
		}
		versions := map[string]string{}
		for _, a := range cd.GetConfigs() {
			m, err := a.UnmarshalNew()
			if err != nil {
				t.Fatal(err)
			}
			switch m := m.(type) {
			case *adminv3.ClustersConfigDump:
				for _, c := range m.GetDynamicActiveClusters() {
					versions[xds.TypeCluster+"|"+nameOfAny(t, c.GetCluster())] = c.GetVersionInfo()
				}
			case *adminv3.EndpointsConfigDump:
				for _, c := range m.GetDynamicEndpointConfigs() {
					versions[xds.TypeEndpoint+"|"+nameOfAny(t, c.GetEndpointConfig())] = c.GetVersionInfo()
				}
			case *adminv3.ListenersConfigDump:
				for _, l := range m.GetDynamicListeners() {
					versions[xds.TypeListener+"|"+l.GetName()] = l.GetActiveState().GetVersionInfo()
				}
			case *adminv3.RoutesConfigDump:
				for _, r := range m.GetDynamicRouteConfigs() {
					versions[xds.TypeRoute+"|"+nameOfAny(t, r.GetRouteConfig())] = r.GetVersionInfo()
				}
			case *adminv3.SecretsConfigDump:
				for _, s := range m.GetDynamicActiveSecrets() {
					versions[xds.TypeSecret+"|"+s.GetName()] = s.GetVersionInfo()
				}
			default:
				t.Fatalf("unexpected section %T", m)
			}
		}
		return versions, string(js)
	}
	t.Run("node", func(t *testing.T) {
		versions, js := dumpOf(t, &inspectpb.ConfigDumpRequest{Node: node("ns1", "app", 0).GetId()})
		if !maps.Equal(versions, held) {
			t.Errorf("dump of the node = %v\nwant what it holds %v", versions, held)
		}
		if strings.Contains(js, "secret-key-bytes") || !strings.Contains(js, "[redacted]") || !strings.Contains(js, "public-cert") {
			t.Errorf("the dump does not redact the private key, or lost the certificate:\n%s", js)
		}
		only, _ := dumpOf(t, &inspectpb.ConfigDumpRequest{Node: node("ns1", "app", 0).GetId(), Types: []string{xds.TypeCluster}})
		if len(only) != 3 {
			t.Errorf("dump of CDS only = %v, want the 3 clusters", only)
		}
	})
	t.Run("key", func(t *testing.T) {
		versions, _ := dumpOf(t, &inspectpb.ConfigDumpRequest{Key: key})
		if !maps.Equal(versions, held) {
			t.Errorf("dump of the key = %v\nwant its views (what the client holds) %v", versions, held)
		}
	})
	t.Run("not held", func(t *testing.T) {
		for _, req := range []*inspectpb.ConfigDumpRequest{{Node: "nobody"}, {Key: "no-such-key"}} {
			if _, err := e.r.ConfigDump(ctx, req); !errors.Is(err, ErrNotHeld) {
				t.Errorf("ConfigDump(%v) err = %v, want ErrNotHeld", req, err)
			}
		}
		if _, err := e.r.ConfigDump(ctx, &inspectpb.ConfigDumpRequest{}); err == nil {
			t.Error("ConfigDump of nothing succeeded")
		}
	})
}
