package wire

import (
	"bytes"
	"slices"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/meshrelay/meshrelay/relay/xds"
)

func marshal(f *testing.F, m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		f.Fatal(err)
	}
	return b
}

// FuzzDeltaIn checks the lazy reader of a source's Delta responses
// against proto's on arbitrary bytes: it never panics, and wherever proto
// reads a response it reads the same fields (it may take what proto
// refuses in fields the relay does not read).
func FuzzDeltaIn(f *testing.F) {
	f.Add(marshal(f, &discovery.DeltaDiscoveryResponse{
		SystemVersionInfo: "v1", TypeUrl: xds.TypeCluster, Nonce: "3", RemovedResources: []string{"gone"},
		ControlPlane: &core.ControlPlane{Identifier: "istiod"},
		Resources: []*discovery.Resource{
			{Name: "c0", Version: "h0", Resource: &anypb.Any{TypeUrl: xds.TypeCluster, Value: []byte{0x0a, 0x02, 'c', '0'}}},
			{Name: "c1", Version: "h1", Ttl: durationpb.New(5), Aliases: []string{"x"}}, // a heartbeat
			{Name: "c2", Resource: &anypb.Any{}},
		},
	}))
	f.Add([]byte{0x12, 0x02, 0x12, 0x00})      // a resource with an empty Any
	f.Add([]byte{0x22, 0x02, 0xff, 0xfe})      // a type_url that is not UTF-8
	f.Add([]byte{0x12, 0x05, 0x1a, 0x03, 'a'}) // a resource cut short
	f.Fuzz(func(t *testing.T, b []byte) {
		var got DeltaIn
		err := unmarshalDeltaIn(mem.BufferSlice{mem.SliceBuffer(b)}, &got)
		defer got.Release()
		var want discovery.DeltaDiscoveryResponse
		if proto.Unmarshal(b, &want) != nil {
			return
		}
		if err != nil {
			t.Fatalf("lazy reader: %v; proto reads it", err)
		}
		if got.SystemVersionInfo != want.GetSystemVersionInfo() || got.TypeURL != want.GetTypeUrl() || got.Nonce != want.GetNonce() ||
			!slices.Equal(got.RemovedResources, want.GetRemovedResources()) || len(got.Resources) != len(want.GetResources()) {
			t.Fatalf("read %+v, proto %v", got, &want)
		}
		for i, r := range want.GetResources() {
			g := got.Resources[i]
			if g.Name != r.GetName() || g.Version != r.GetVersion() || (g.Body == nil) != (r.GetResource() == nil) {
				t.Fatalf("resource %d: %+v, proto %v", i, g, r)
			}
			if g.Body != nil && (g.Body.TypeUrl != r.GetResource().GetTypeUrl() || !bytes.Equal(g.Body.Value, r.GetResource().GetValue())) {
				t.Fatalf("resource %d body: %+v, proto %v", i, g.Body, r.GetResource())
			}
		}
	})
}

// FuzzSotWIn: FuzzDeltaIn for SotW responses.
func FuzzSotWIn(f *testing.F) {
	f.Add(marshal(f, &discovery.DiscoveryResponse{
		VersionInfo: "v1", TypeUrl: xds.TypeEndpoint, Nonce: "9", Canary: true,
		Resources: []*anypb.Any{{TypeUrl: xds.TypeEndpoint, Value: []byte{0x0a, 0x01, 'c'}}, {}},
	}))
	f.Add([]byte{0x12, 0x03, 0x0a, 0x01, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		var got SotWIn
		err := unmarshalSotWIn(mem.BufferSlice{mem.SliceBuffer(b)}, &got)
		defer got.Release()
		var want discovery.DiscoveryResponse
		if proto.Unmarshal(b, &want) != nil {
			return
		}
		if err != nil {
			t.Fatalf("lazy reader: %v; proto reads it", err)
		}
		if got.VersionInfo != want.GetVersionInfo() || got.TypeURL != want.GetTypeUrl() || got.Nonce != want.GetNonce() ||
			len(got.Resources) != len(want.GetResources()) {
			t.Fatalf("read %+v, proto %v", got, &want)
		}
		for i, a := range want.GetResources() {
			if got.Resources[i].TypeUrl != a.GetTypeUrl() || !bytes.Equal(got.Resources[i].Value, a.GetValue()) {
				t.Fatalf("resource %d: %+v, proto %v", i, got.Resources[i], a)
			}
		}
	})
}
