package configdump_test

import (
	"strings"
	"testing"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/configdump"
	"github.com/meshrelay/meshrelay/relay/xds"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// entry makes a view's entry of m, named name, as the relay holds it.
func entry(t *testing.T, name string, m proto.Message) ledger.Entry[*xds.Resource] {
	t.Helper()
	a, err := anypb.New(m)
	if err != nil {
		t.Fatal(err)
	}
	h := xds.ContentHash(a.GetTypeUrl(), a.GetValue())
	return ledger.Entry[*xds.Resource]{Name: name, Hash: h, Value: &xds.Resource{Type: a.GetTypeUrl(), Name: name, Hash: h, Body: a}}
}

// TestBuild: each type lands where Envoy's /config_dump puts it, with
// the view's version and each resource's content hash as its version; a
// declared entry the relay does not hold, and a type the dump has no
// place for, are left out; a Secret's key never shows.
func TestBuild(t *testing.T) {
	c := entry(t, "outbound|80||a", &cluster.Cluster{Name: "outbound|80||a"})
	l := entry(t, "0.0.0.0_80", &listener.Listener{Name: "0.0.0.0_80"})
	s := entry(t, "default", &tlsv3.Secret{Name: "default", Type: &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{
		PrivateKey: &core.DataSource{Specifier: &core.DataSource_InlineString{InlineString: "private-key-bytes"}},
	}}})
	declared := ledger.Entry[*xds.Resource]{Name: "outbound|80||b", Hash: c.Hash} // no value: not held
	dump, err := configdump.Build([]configdump.Type{
		{URL: xds.TypeCluster, Version: "v-cds", Entries: []ledger.Entry[*xds.Resource]{c, declared}},
		{URL: xds.TypeListener, Version: "v-lds", Entries: []ledger.Entry[*xds.Resource]{l}},
		{URL: xds.TypeSecret, Version: "v-sds", Entries: []ledger.Entry[*xds.Resource]{s}},
		{URL: "type.googleapis.com/envoy.service.runtime.v3.Runtime", Version: "v-rt"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(dump.GetConfigs()) != 3 {
		t.Fatalf("%d configs, want clusters, listeners and secrets", len(dump.GetConfigs()))
	}
	var cds adminv3.ClustersConfigDump
	var lds adminv3.ListenersConfigDump
	var sds adminv3.SecretsConfigDump
	for i, m := range []proto.Message{&cds, &lds, &sds} {
		if err := dump.GetConfigs()[i].UnmarshalTo(m); err != nil {
			t.Fatalf("config %d: %v", i, err)
		}
	}
	if cds.GetVersionInfo() != "v-cds" || len(cds.GetDynamicActiveClusters()) != 1 || cds.GetDynamicActiveClusters()[0].GetVersionInfo() != c.Hash.String() {
		t.Errorf("clusters = %v, want the one held cluster at version %s of view v-cds", &cds, c.Hash)
	}
	if ls := lds.GetDynamicListeners(); lds.GetVersionInfo() != "v-lds" || len(ls) != 1 || ls[0].GetName() != "0.0.0.0_80" || ls[0].GetActiveState().GetVersionInfo() != l.Hash.String() {
		t.Errorf("listeners = %v, want 0.0.0.0_80 active at %s of view v-lds", &lds, l.Hash)
	}
	if ss := sds.GetDynamicActiveSecrets(); len(ss) != 1 || ss[0].GetName() != "default" {
		t.Errorf("secrets = %v, want default", &sds)
	}
	if j := protojson.Format(dump); strings.Contains(j, "private-key-bytes") || !strings.Contains(j, "[redacted]") {
		t.Errorf("the dump shows a private key, or redacts nothing:\n%s", j)
	}
}
