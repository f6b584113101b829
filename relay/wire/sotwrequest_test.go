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
		if got.Names.Digest() != ListDigest(want.GetResourceNames()) || got.Names.count != len(names) ||
			got.Names.hasStar != slices.Contains(names, xds.WildcardName) {
			t.Fatalf("digest/count/star disagree with the names %q", names)
		}
		want.ResourceNames = nil
		if !proto.Equal(got.Req, &want) {
			t.Fatalf("other fields = %v, want %v", got.Req, &want)
		}
	})
}

// A request that arrived in several buffers is read as one; its names are
// held until Release and refused after it.
func TestSotWRequestBuffers(t *testing.T) {
	b, err := proto.Marshal(&discovery.DiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResourceNames: []string{"c0", "c1", "c2"}, ResponseNonce: "7"})
	if err != nil {
		t.Fatal(err)
	}
	pool := mem.DefaultBufferPool()
	var data mem.BufferSlice
	for chunk := range slices.Chunk(b, 5) { // a request split as frames split it
		data = append(data, mem.Copy(chunk, pool))
	}
	var r SotWRequest
	if err := unmarshalSotWRequest(data, &r); err != nil {
		t.Fatal(err)
	}
	data.Free() // as gRPC does when Unmarshal returns
	if names, err := r.Names.Decode(); err != nil || !slices.Equal(names, []string{"c0", "c1", "c2"}) {
		t.Fatalf("Decode = %q, %v; want c0 c1 c2", names, err)
	}
	if r.Req.GetResponseNonce() != "7" || r.Names.Size() != len(b) {
		t.Fatalf("nonce %q size %d, want 7 and %d", r.Req.GetResponseNonce(), r.Names.Size(), len(b))
	}
	r.Release()
	r.Names.list = nil // as if never decoded
	if _, err := r.Names.Decode(); err == nil {
		t.Fatal("Decode after Release succeeded, want an error")
	}
	r.Release() // twice is harmless
	defer func() {
		if recover() == nil {
			t.Fatal("the digest of a released request's names was computed from nothing")
		}
	}()
	r.Names.summed = false // as if never summed
	r.Names.Digest()
}

// A list is the same as another when its names are: as sent again (the
// bytes match, nothing is hashed name by name), or in another order (the
// digests match); one name more or another name is not.
func TestNameListSame(t *testing.T) {
	read := func(names ...string) *NameList {
		t.Helper()
		b, err := proto.Marshal(&discovery.DiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResourceNames: names, ResponseNonce: "1"})
		if err != nil {
			t.Fatal(err)
		}
		var r SotWRequest
		if err := unmarshalSotWRequest(mem.BufferSlice{mem.SliceBuffer(b)}, &r); err != nil {
			t.Fatal(err)
		}
		return &r.Names
	}
	abc := read("a", "b", "c").ID()
	for _, tc := range []struct {
		names  []string
		same   bool
		summed bool // the digest had to be computed
	}{
		{[]string{"a", "b", "c"}, true, false},
		{[]string{"c", "a", "b"}, true, true},
		{[]string{"a", "b"}, false, true},
		{[]string{"a", "b", "c", "d"}, false, true},
		{[]string{"a", "b", "x"}, false, true},
	} {
		nl, id := read(tc.names...), abc
		if got := nl.Same(&id); got != tc.same || nl.summed != tc.summed {
			t.Errorf("%q.Same(a b c) = %v (summed %v), want %v (summed %v)", tc.names, got, nl.summed, tc.same, tc.summed)
		}
		if tc.same {
			// The order it came in is remembered: sent again so, it
			// matches on its bytes.
			again := read(tc.names...)
			if !again.Same(&id) || again.summed {
				t.Errorf("%q sent again: Same = false or summed, want a match on its bytes", tc.names)
			}
		}
	}
	// A decoded list has no bytes: it matches by digest.
	id := abc
	if nl := NamesOf([]string{"b", "c", "a"}); !nl.Same(&id) {
		t.Error("NamesOf(b c a).Same(a b c) = false, want true")
	}
}
