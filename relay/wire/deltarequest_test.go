package wire

import (
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

func deltaRequestOf(b []byte) *DeltaRequest {
	r := new(DeltaRequest)
	_ = unmarshalDeltaRequest(mem.BufferSlice{mem.SliceBuffer(b)}, r)
	return r
}

// FuzzDeltaRequestNames: the names counted without decoding are at least
// those decoding finds (a map's repeated keys count each time) and, for a
// request as proto encodes it, exactly those; Decode never panics.
func FuzzDeltaRequestNames(f *testing.F) {
	seed, _ := proto.Marshal(&discovery.DeltaDiscoveryRequest{
		TypeUrl: "t", ResourceNamesSubscribe: []string{"a", "b"}, ResourceNamesUnsubscribe: []string{"c"},
		InitialResourceVersions: map[string]string{"d": "1", "e": "2"}, ResponseNonce: "n",
	})
	f.Add(seed)
	f.Add([]byte{})
	f.Add([]byte{0x1a, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		n := deltaRequestOf(b).Names()
		req, err := deltaRequestOf(b).Decode()
		if err != nil {
			return
		}
		decoded := len(req.GetResourceNamesSubscribe()) + len(req.GetResourceNamesUnsubscribe()) + len(req.GetInitialResourceVersions())
		if n < decoded {
			t.Fatalf("counted %d names, decoding found %d", n, decoded)
		}
		again, err := proto.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		if m := deltaRequestOf(again).Names(); m != decoded {
			t.Fatalf("re-encoded request: counted %d names, want %d", m, decoded)
		}
	})
}
