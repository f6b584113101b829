package aggkey

import (
	"fmt"
	"os"
	"strings"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// benchNode is a node of a plain go-control-plane fleet: an id of its own,
// one cluster, no metadata.
func benchNode(i int, cluster string) *core.Node {
	return &core.Node{Id: fmt.Sprintf("sidecar-%d.bench", i), Cluster: cluster}
}

// gateway is a node of an Istio ingress gateway pod.
func gateway(pod, app string, zone string) *core.Node {
	p := reviewsPod().with(func(p *istioPod) {
		p.proxyType, p.name, p.idNS = "router", pod, "istio-system"
		p.meta["NAMESPACE"], p.meta["WORKLOAD_NAME"] = "istio-system", app
		p.labels = map[string]any{"app": app, "istio": "ingressgateway"}
		p.locality.Zone = zone
	})
	return p.node()
}

// proxyless is a node of a proxyless gRPC client of a workload, as
// istio-agent's gRPC bootstrap gives it.
func proxyless(pod, workload string) *core.Node {
	return reviewsPod().with(func(p *istioPod) {
		p.name = pod
		p.meta["WORKLOAD_NAME"], p.meta["GENERATOR"] = workload, "grpc"
	}).node()
}

// TestFieldsProfiles: for each profile an operator would write, which
// nodes share a key and which do not.
func TestFieldsProfiles(t *testing.T) {
	istioRules := `
rules:
- name: gateways
  match: {id: "router~.*"}
  key: [namespace, metadata.LABELS.app, locality]
- name: grpc
  match: {metadata.GENERATOR: grpc}
  key: [namespace, metadata.WORKLOAD_NAME, metadata.ISTIO_VERSION]
- name: sidecars
  match: {id: "sidecar~.*"}
  key: [namespace, metadata.WORKLOAD_NAME, metadata.ISTIO_VERSION, metadata.CLUSTER_ID, locality]
`
	config := func(t *testing.T, yaml string) Profile {
		p, err := ParseKeyConfig([]byte(yaml))
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	fields := func(t *testing.T, list string) Profile {
		p, err := ParseKeyFields(list)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	reviews := reviewsPod()
	cases := []struct {
		name    string
		profile func(t *testing.T) Profile
		same    [][2]*core.Node
		apart   [][2]*core.Node
		// perNode lists nodes no rule keys: they get per-node keys.
		perNode []*core.Node
	}{{
		name:    "go-control-plane fleet by cluster",
		profile: func(t *testing.T) Profile { return fields(t, "cluster") },
		same:    [][2]*core.Node{{benchNode(1, "bench"), benchNode(2, "bench")}, {benchNode(3, ""), benchNode(4, "")}},
		apart:   [][2]*core.Node{{benchNode(1, "bench"), benchNode(1, "other")}, {benchNode(1, "bench"), benchNode(1, "")}},
	}, {
		name:    "node id by regular expression",
		profile: func(t *testing.T) Profile { return fields(t, `id~^(.*)-[0-9]+\.bench$, cluster`) },
		same:    [][2]*core.Node{{benchNode(7, "bench"), benchNode(8, "bench")}},
		apart: [][2]*core.Node{
			{benchNode(7, "bench"), {Id: "gateway-7.bench", Cluster: "bench"}},
			// An id the expression does not match is missing, not "".
			{{Id: "x", Cluster: "bench"}, {Id: "-1.bench", Cluster: "bench"}},
		},
	}, {
		name:    "Istio sidecars by namespace and workload",
		profile: func(t *testing.T) Profile { return fields(t, "namespace,metadata.WORKLOAD_NAME") },
		same: [][2]*core.Node{
			{reviews.node(), reviews.with(podIP("10.0.0.2"), func(p *istioPod) { p.name = "reviews-v1-7f9c-fghij" }).node()},
			// The namespace is istiod's: metadata NAMESPACE, else the id's.
			{reviews.node(), reviews.with(podMeta("NAMESPACE", nil)).node()},
		},
		apart: [][2]*core.Node{
			{reviews.node(), reviews.with(podMeta("WORKLOAD_NAME", "reviews-v2")).node()},
			{reviews.node(), reviews.with(podMeta("NAMESPACE", "ns2")).node()},
			// Missing and empty differ.
			{reviews.with(podMeta("WORKLOAD_NAME", nil)).node(), reviews.with(podMeta("WORKLOAD_NAME", "")).node()},
		},
	}, {
		name: "metadata paths: nested, bracketed, numbers",
		profile: func(t *testing.T) Profile {
			return fields(t, "metadata.LABELS[service.istio.io/canonical-name],metadata.LABELS.version")
		},
		same: [][2]*core.Node{{reviews.node(), reviews.with(podLabel("app", "other"), podMeta("WORKLOAD_NAME", "x")).node()}},
		apart: [][2]*core.Node{
			{reviews.node(), reviews.with(podLabel("service.istio.io/canonical-name", "ratings")).node()},
			{reviews.with(podLabel("version", 1)).node(), reviews.with(podLabel("version", "1")).node()},
			{reviews.with(podLabel("version", 1)).node(), reviews.with(podLabel("version", 2)).node()},
		},
	}, {
		name:    "rules in order: gateways, proxyless gRPC, sidecars",
		profile: func(t *testing.T) Profile { return config(t, istioRules) },
		same: [][2]*core.Node{
			{gateway("gw-1", "ingress", "b"), gateway("gw-2", "ingress", "b")},
			{proxyless("reviews-1", "reviews-v1"), proxyless("reviews-2", "reviews-v1")},
			{reviews.node(), reviews.with(podIP("10.0.0.9")).node()},
		},
		apart: [][2]*core.Node{
			{gateway("gw-1", "ingress", "b"), gateway("gw-3", "egress", "b")},
			{gateway("gw-1", "ingress", "b"), gateway("gw-4", "ingress", "c")},
			// A proxyless client of reviews-v1 is not its sidecars.
			{proxyless("reviews-1", "reviews-v1"), reviews.node()},
			{reviews.node(), reviews.with(podMeta("ISTIO_VERSION", "1.29.0")).node()},
		},
		perNode: []*core.Node{benchNode(1, "bench"), reviews.with(func(p *istioPod) { p.proxyType = "waypoint" }).node()},
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.profile(t)
			for _, pair := range tc.same {
				if a, b := p.Key(pair[0]), p.Key(pair[1]); a != b {
					t.Errorf("Key(%s) = %q, Key(%s) = %q: want one key", pair[0].GetId(), a, pair[1].GetId(), b)
				}
			}
			for _, pair := range tc.apart {
				if a, b := p.Key(pair[0]), p.Key(pair[1]); a == b {
					t.Errorf("Key(%s) = Key(%s) = %q: want two keys", pair[0].GetId(), pair[1].GetId(), a)
				}
			}
			for _, n := range tc.perNode {
				if got, want := p.Key(n), (PerNode{}).Key(n); got != want {
					t.Errorf("Key(%s) = %q, want the per-node key %q", n.GetId(), got, want)
				}
			}
		})
	}
}

// TestFieldsKeyForm: a fields key is readable, carries no '/' but the two
// of "<rule>/<namespace>/…", and names a namespace (for scoped admin
// callers) only when its rule keys by namespace.
func TestFieldsKeyForm(t *testing.T) {
	byNS, err := ParseKeyFields("namespace,metadata.WORKLOAD_NAME")
	if err != nil {
		t.Fatal(err)
	}
	byCluster, err := ParseKeyFields("cluster,locality")
	if err != nil {
		t.Fatal(err)
	}
	reviews := reviewsPod()
	crafted := reviews.with(podMeta("WORKLOAD_NAME", "a/victim/b#c:d")).node()
	crafted.Cluster = "x/victim/y"
	long := reviews.with(podMeta("WORKLOAD_NAME", strings.Repeat("w", 300))).node()
	cases := []struct {
		p      Profile
		node   *core.Node
		prefix string
		ns     string
	}{
		{byNS, reviews.node(), "fields/ns1/reviews-v1#", "ns1"},
		{byNS, crafted, "fields/ns1/a%2Fvictim%2Fb%23c%3Ad#", "ns1"},
		{byNS, reviews.with(podMeta("NAMESPACE", nil), func(p *istioPod) { p.idNS = "" }).node(), "fields:-,reviews-v1#", ""},
		{byCluster, reviews.node(), "fields:reviews.ns1,us-east1%2Fus-east1-b%2F#", ""},
		{byCluster, crafted, "fields:x%2Fvictim%2Fy,us-east1%2Fus-east1-b%2F#", ""},
		{byNS, long, "fields/ns1/" + strings.Repeat("w", maxReadable) + "~#", "ns1"},
	}
	for _, tc := range cases {
		k := string(tc.p.Key(tc.node))
		if !strings.HasPrefix(k, tc.prefix) || len(k) != len(tc.prefix)+16 {
			t.Errorf("Key(%s) = %q, want %q and a 16-digit hash", tc.node.GetId(), k, tc.prefix)
		}
		if got := Namespace(k); got != tc.ns {
			t.Errorf("Namespace(%q) = %q, want %q", k, got, tc.ns)
		}
	}
	// The hash covers the values whole: two cut to one readable part differ.
	other := reviews.with(podMeta("WORKLOAD_NAME", strings.Repeat("w", 299)+"x")).node()
	if byNS.Key(long) == byNS.Key(other) {
		t.Error("two values cut to the same readable part share a key")
	}
}

// TestFieldsRulesRefused: a profile that could not key nodes as written
// is refused at start, saying why.
func TestFieldsRulesRefused(t *testing.T) {
	cases := []struct {
		name string
		yaml string
		want string
	}{
		{"no rules", "rules: []", "at least one rule"},
		{"no key", "rules: [{name: a, key: []}]", "key lists no field"},
		{"unknown field", "rules: [{name: a, key: [clusterr]}]", `unknown field "clusterr"`},
		{"unknown config field", "rules: [{name: a, key: [cluster], keys: [id]}]", "unknown field"},
		{"bad id expression", "rules: [{name: a, key: ['id~(']}]", "id~("},
		{"bad match expression", "rules: [{name: a, match: {cluster: '['}, key: [id]}]", "match cluster"},
		{"match on an unknown field", "rules: [{name: a, match: {nodeid: x}, key: [id]}]", `unknown field "nodeid"`},
		{"empty metadata path", "rules: [{name: a, key: [metadata.]}]", "no name"},
		{"open bracket", "rules: [{name: a, key: ['metadata.LABELS[app']}]", "'['"},
		{"text after a bracket", "rules: [{name: a, key: ['metadata.LABELS[app]x']}]", "after a ']'"},
		{"empty name in a path", "rules: [{name: a, key: [metadata.LABELS..app]}]", "empty name"},
		{"field twice", "rules: [{name: a, key: [cluster, cluster]}]", "twice"},
		{"two rules of one name", "rules: [{name: a, key: [id]}, {name: a, key: [cluster]}]", "two rules"},
		{"rule without a name", "rules: [{key: [id]}]", "name"},
		{"rule named like per-node keys", "rules: [{name: node, key: [id]}]", `"node"`},
		{"rule name with a slash", "rules: [{name: a/b, key: [id]}]", "a/b"},
		{"rule name ending in a dash", "rules: [{name: a-, key: [id]}]", `"a-"`},
		{"not YAML", "rules: [", "key config"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, err := ParseKeyConfig([]byte(tc.yaml))
			if err == nil {
				t.Fatalf("ParseKeyConfig(%q) = %v, want an error", tc.yaml, p)
			}
			if !strings.HasPrefix(err.Error(), "aggkey: ") || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("ParseKeyConfig(%q) error = %q, want \"aggkey: …\" mentioning %q", tc.yaml, err, tc.want)
			}
		})
	}
	if _, err := ParseKeyFields("cluster,,id"); err == nil || !strings.Contains(err.Error(), `unknown field ""`) {
		t.Errorf(`ParseKeyFields("cluster,,id") error = %v, want one naming the empty field`, err)
	}
}

// TestFieldsMetadataValues: values of every kind key apart by kind and
// value, and a struct or list keys by its content, whatever its maps'
// order.
func TestFieldsMetadataValues(t *testing.T) {
	p, err := ParseKeyFields("metadata.V")
	if err != nil {
		t.Fatal(err)
	}
	key := func(v *structpb.Value) Key {
		return p.Key(&core.Node{Id: "n", Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{"V": v}}})
	}
	st := func(kv ...string) *structpb.Value {
		m := map[string]any{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		s, _ := structpb.NewStruct(m)
		return structpb.NewStructValue(s)
	}
	values := []*structpb.Value{
		structpb.NewStringValue("1"), structpb.NewNumberValue(1), structpb.NewBoolValue(true), structpb.NewStringValue("true"),
		structpb.NewNullValue(), structpb.NewStringValue(""), st("a", "1"), st("a", "2"),
	}
	seen := map[Key]int{}
	for i, v := range values {
		k := key(v)
		if j, ok := seen[k]; ok {
			t.Errorf("values %d (%v) and %d (%v) share key %q", j, values[j], i, v, k)
		}
		seen[k] = i
	}
	if a, b := key(st("a", "1", "b", "2")), key(st("b", "2", "a", "1")); a != b {
		t.Errorf("one struct, two keys: %q, %q", a, b)
	}
}

// TestREADMEKeyConfig: the example rules of docs/architecture.md
// ("Aggregation keys") load, and key its gateways, proxyless clients and
// sidecars by their own rules.
func TestREADMEKeyConfig(t *testing.T) {
	b, err := os.ReadFile("../../docs/architecture.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "`--key-config FILE` holds rules")
	if !ok {
		t.Fatal("docs/architecture.md: no --key-config example")
	}
	_, rest, _ = strings.Cut(rest, "```yaml\n")
	example, _, ok := strings.Cut(rest, "```")
	if !ok {
		t.Fatal("docs/architecture.md: the --key-config example has no yaml block")
	}
	p, err := ParseKeyConfig([]byte(example))
	if err != nil {
		t.Fatalf("docs/architecture.md's --key-config example: %v", err)
	}
	for n, rule := range map[*core.Node]string{
		gateway("gw-1", "ingress", "b"):      "gateways/istio-system/",
		proxyless("reviews-1", "reviews-v1"): "grpc/ns1/",
		reviewsPod().node():                  "sidecars/ns1/",
		benchNode(1, "bench"):                "node/",
	} {
		if k := p.Key(n); !strings.HasPrefix(string(k), rule) {
			t.Errorf("Key(%s) = %q, want %s…", n.GetId(), k, rule)
		}
	}
}
