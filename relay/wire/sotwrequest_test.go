package wire

import (
	"slices"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// FuzzSotWRequestDecode checks the relay's lazy SotW request decoder against
// the standard one on arbitrary bytes: it never panics, agrees on every
// field, and its names digest is ListDigest of the names.
func FuzzSotWRequestDecode(f *testing.F) {
	for _, r := range []*discovery.DiscoveryRequest{
		{TypeUrl: xds.TypeCluster, Node: &core.Node{Id: "sidecar~10.0.0.1~a.ns~ns.svc.cluster.local"}},
		{TypeUrl: xds.TypeEndpoint, ResourceNames: []string{"c0", "c1", "*"}, VersionInfo: "v", ResponseNonce: "3"},
		{TypeUrl: xds.TypeListener, ErrorDetail: &rpcstatus.Status{Code: 3, Message: "bad"}, ResourceNames: []string{""}},
	} {
		b, err := proto.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0x1a, 0x02, 0xff, 0xfe}) // a name that is not UTF-8
	f.Fuzz(func(t *testing.T, b []byte) {
		var got SotWRequest
		err := unmarshalSotWRequest(mem.BufferSlice{mem.SliceBuffer(b)}, &got)
		var want discovery.DiscoveryRequest
		wantErr := proto.Unmarshal(b, &want)
		if err != nil {
			if wantErr == nil {
				t.Fatalf("relay decoder: %v; proto decodes it", err)
			}
			return
		}
		names, nameErr := got.Names.Decode()
		if wantErr != nil {
			if nameErr == nil {
				t.Fatalf("relay decoder accepts what proto refuses (%v)", wantErr)
			}
			return
		}
		if nameErr != nil {
			t.Fatalf("names refused (%v) though proto decodes them", nameErr)
		}
		if !slices.Equal(names, want.GetResourceNames()) && len(names)+len(want.GetResourceNames()) > 0 {
			t.Fatalf("names = %q, want %q", names, want.GetResourceNames())
		}
		if got.Names.sum != ListDigest(want.GetResourceNames()) || got.Names.count != len(names) ||
			got.Names.hasStar != slices.Contains(names, xds.WildcardName) {
			t.Fatalf("digest/count/star disagree with the names %q", names)
		}
		want.ResourceNames = nil
		if !proto.Equal(got.Req, &want) {
			t.Fatalf("other fields = %v, want %v", got.Req, &want)
		}
	})
}
