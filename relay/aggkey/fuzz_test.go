package aggkey

import (
	"strings"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// FuzzKeyProfile derives keys from arbitrary nodes: no profile panics, and
// keys are deterministic (the same node, a clone, and the node after a
// round trip through the wire, whose map order differs, all get one key).
func FuzzKeyProfile(f *testing.F) {
	add := func(n *core.Node) {
		b, err := proto.Marshal(n)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	add(node("ns1", "reviews", 0))
	add(node("ns1", "reviews", 7))
	router := node("istio-system", "istio-ingressgateway", 1)
	router.Id = strings.Replace(router.Id, "sidecar~", "router~", 1)
	router.Locality = &core.Locality{Region: "us-east1", Zone: "us-east1-b", SubZone: "rack1"}
	add(router)
	v6 := node("ns2", "ratings", 2)
	v6.Metadata.Fields["INSTANCE_IPS"] = structpb.NewStringValue("fd00::1,10.0.0.9")
	v6.Metadata.Fields["LABELS"].GetStructValue().Fields["statefulset.kubernetes.io/pod-name"] = structpb.NewStringValue("ratings-2")
	v6.Metadata.Fields["PROXY_CONFIG"] = structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
		"concurrency": structpb.NewNumberValue(2), "tracing": structpb.NewNullValue()}})
	add(v6)
	add(&core.Node{Id: "envoy-1", Cluster: "front"})
	add(&core.Node{Id: "sidecar-7.bench", Cluster: "bench", UserAgentName: "envoy"})
	add(&core.Node{Id: "sidecar~10.0.0.1~pod~"})
	add(&core.Node{})

	byFields, err := ParseKeyFields("cluster,id~^(.*)-[0-9]+$,metadata.LABELS[app.kubernetes.io/name],metadata.PROXY_CONFIG,namespace,locality")
	if err != nil {
		f.Fatal(err)
	}
	byRules, err := ParseKeyConfig([]byte(`rules:
- {name: gateways, match: {id: "router~.*", metadata.LABELS.istio: ".+"}, key: [namespace, metadata.LABELS.app, locality.zone]}
- {name: bench, match: {cluster: bench}, key: ["id~^(.*)-[0-9]+\\.bench$"]}
- {name: rest, key: [user_agent_name, user_agent_version, id]}
`))
	if err != nil {
		f.Fatal(err)
	}
	profiles := []Profile{
		Istio{},
		Istio{ExtraMetadata: []string{"PROXY_CONFIG", "DNS_CAPTURE"}},
		PerNode{},
		byFields,
		byRules,
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		n := new(core.Node)
		if proto.Unmarshal(data, n) != nil {
			return
		}
		// A round trip through the wire: maps come out in another order.
		wire, err := proto.Marshal(n)
		if err != nil {
			t.Fatalf("marshal: %v", err)
		}
		again := new(core.Node)
		if err := proto.Unmarshal(wire, again); err != nil {
			t.Fatalf("unmarshal what was marshalled: %v", err)
		}
		for _, p := range profiles {
			k := p.Key(n)
			if k == "" {
				t.Fatalf("%s Key(%s) is empty", p.Name(), n.GetId())
			}
			if i := strings.LastIndexByte(string(k), '#'); i < 0 || len(k)-i-1 != 16 {
				t.Fatalf("%s Key(%s) = %q, want a 16-digit hash suffix", p.Name(), n.GetId(), k)
			}
			for what, m := range map[string]*core.Node{"again": n, "of a clone": proto.Clone(n).(*core.Node), "after a round trip": again} {
				if got := p.Key(m); got != k {
					t.Fatalf("%s Key(%s) %s = %q, want %q", p.Name(), n.GetId(), what, got, k)
				}
			}
		}
		reordered := Istio{ExtraMetadata: []string{"DNS_CAPTURE", "PROXY_CONFIG"}}
		if got, want := reordered.Key(n), profiles[1].Key(n); got != want {
			t.Fatalf("Key(%s) with ExtraMetadata reordered = %q, want %q", n.GetId(), got, want)
		}
	})
}
