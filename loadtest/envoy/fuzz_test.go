package envoy

import (
	"slices"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// FuzzDecode: decoding a resource of any kind from arbitrary bytes never
// panics, and what it extracts survives encodeRefs/eachRef.
func FuzzDecode(f *testing.F) {
	seeds := []proto.Message{
		edsCluster("c1"), staticCluster("s"), loadAssignment("c1", 80),
		rdsListener("l", "r"), tcpListener("t", "c1"), routeConfig("r", "c1", "c2"),
		&discovery.Resource{Name: "w", Resource: mustAny(edsCluster("w"))},
	}
	for _, m := range seeds {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		for k := range uint8(5) {
			f.Add(k, b)
		}
	}
	f.Add(uint8(0), []byte{0xff, 0xff, 0xff})
	typeURLs := []string{"type.googleapis.com/unknown.Type", ClusterType, EndpointType, ListenerType, RouteType}
	f.Fuzz(func(t *testing.T, k uint8, b []byte) {
		kd := kind(k % 5)
		a := &anypb.Any{TypeUrl: typeURLs[kd], Value: b}
		opt := decodeOptions{needName: true, generation: func(proto.Message) (uint64, bool) { return 1, true }}
		d := decode(kd, a, opt)
		// Through a DecodeCache, twice (a miss, then a hit), the same.
		opt.cache = NewDecodeCache()
		for range 2 {
			c := decode(kd, a, opt)
			if c.name != d.name || !slices.Equal(c.deps, d.deps) || !slices.Equal(c.uses, d.uses) || c.gen != d.gen ||
				c.hasGen != d.hasGen || (c.err == nil) != (d.err == nil) || c.body != a || !c.hashed || c.hash != contentHash(b) {
				t.Fatalf("decode through a cache = %+v, without = %+v", c, d)
			}
		}
		if d.err != nil {
			return
		}
		var deps, uses []string
		eachRef(encodeRefs(d.deps, d.uses), func(dep bool, s string) {
			if dep {
				deps = append(deps, s)
			} else {
				uses = append(uses, s)
			}
		})
		if len(deps) != len(d.deps) || len(uses) != len(d.uses) {
			t.Fatalf("refs round trip: %q %q, want %q %q", deps, uses, d.deps, d.uses)
		}
		for i := range deps {
			if deps[i] != d.deps[i] {
				t.Fatalf("dep %d = %q, want %q", i, deps[i], d.deps[i])
			}
		}
		for i := range uses {
			if uses[i] != d.uses[i] {
				t.Fatalf("use %d = %q, want %q", i, uses[i], d.uses[i])
			}
		}
		// The SotW wrapper path, too.
		_, _, _, _ = unwrapSotw(&anypb.Any{TypeUrl: wrappedResource, Value: b})
		// And arbitrary bytes as encoded refs.
		eachRef(string(b), func(bool, string) {})
	})
}
