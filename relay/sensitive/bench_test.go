package sensitive_test

import (
	"testing"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/sensitive"
)

// BenchmarkIn checks sets of 2,000 Istio-shaped clusters (what istiod
// sends a sidecar for 2,000 services): "sds" as istiod builds them (mTLS by
// SDS, nothing secret), "no-tls" without transport sockets, "inline-key"
// with a private key inline in the TLS context. One op is one cluster. "decode" is the obvious way for comparison: unmarshal, then
// walk every set field.
func BenchmarkIn(b *testing.B) {
	const n = 2000
	sets := map[string][][]byte{}
	for i := range n {
		sets["sds"] = append(sets["sds"], marshal(b, istioCluster(b, i, nil)))
		sets["inline-key"] = append(sets["inline-key"], marshal(b, istioCluster(b, i, inlineKeyTLS())))
		plain := istioCluster(b, i, nil)
		plain.TransportSocketMatches = nil
		sets["no-tls"] = append(sets["no-tls"], marshal(b, plain))
	}
	url := typeURL(&cluster.Cluster{})
	for _, set := range []string{"no-tls", "sds", "inline-key"} {
		bodies := sets[set]
		size := 0
		for _, body := range bodies {
			size += len(body)
		}
		b.Run("scan/"+set, func(b *testing.B) {
			b.SetBytes(int64(size / n))
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				found, err := sensitive.In(url, bodies[i%n])
				if err != nil || found != (set == "inline-key") {
					b.Fatalf("In = %v, %v", found, err)
				}
				i++
			}
		})
		b.Run("decode/"+set, func(b *testing.B) {
			b.SetBytes(int64(size / n))
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				c := &cluster.Cluster{}
				if err := proto.Unmarshal(bodies[i%n], c); err != nil {
					b.Fatal(err)
				}
				if reference(b, c.ProtoReflect(), 0) != (set == "inline-key") {
					b.Fatal("reference disagrees")
				}
				i++
			}
		})
	}
}
