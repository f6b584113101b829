package aggkey

import (
	"fmt"
	"strings"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshrelay/meshrelay/relay/auth"
)

// node builds an Istio-shaped node of workload wl, pod i, in namespace ns.
func node(ns, wl string, i int) *core.Node {
	md, err := structpb.NewStruct(map[string]any{
		"NAMESPACE":     ns,
		"WORKLOAD_NAME": wl,
		"ISTIO_VERSION": "1.28.0",
		"CLUSTER_ID":    "Kubernetes",
		"INSTANCE_IPS":  fmt.Sprintf("10.0.%d.%d", i/250, i%250+1),
		"LABELS":        map[string]any{"app": wl, "version": "v1"},
	})
	if err != nil {
		panic(err)
	}
	return &core.Node{
		Id:       fmt.Sprintf("sidecar~10.0.%d.%d~%s-%d.%s~%s.svc.cluster.local", i/250, i%250+1, wl, i, ns, ns),
		Metadata: md,
	}
}

// saNode is an Istio sidecar's node with namespace and service account.
func saNode(ns, sa string, i int) *core.Node {
	n := node(ns, sa, i)
	n.Metadata.Fields["SERVICE_ACCOUNT"] = structpb.NewStringValue(sa)
	return n
}

func TestKeyNamespace(t *testing.T) {
	for _, tc := range []struct {
		key, want string
	}{
		{string(Istio{}.Key(saNode("ns1", "app", 0))), "ns1"},
		{string(WithIdentity(Istio{}.Key(node("ns2", "db", 3)), &auth.Identity{TrustDomain: "cluster.local", Namespace: "ns2", ServiceAccount: "db"})), "ns2"},
		{string(PerNode{}.Key(node("ns3", "app", 1))), "ns3"},
		{"router/istio-system/ingressgateway#0011", "istio-system"},
		{"sidecar/ns1/#0011", "ns1"},
		{"sidecar/ns1/app", "ns1"},
		// Not a namespace: another shape, or not a Kubernetes name.
		{"", ""},
		{"#0011", ""},
		{"sidecar/#0011", ""},
		{"sidecar//app#0011", ""},
		{"/ns1/app#0011", ""},
		{"x/ns1/ns2/app#0011", ""},
		{"sidecar/NS1/app#0011", ""},
		{"sidecar/-ns1/app#0011", ""},
		{"sidecar/" + strings.Repeat("n", 64) + "/app#0011", ""},
		{"node/router~10.0.0.1~gw~.svc.cluster.local#0011", ""},
		{"node/ns1/app#0011", ""},
		{"node/not-istio#0011", ""},
		{"node/sidecar~1.2.3.4~p.ns1~ns1.svc.cluster.local/x#0011", ""},
	} {
		if got := Namespace(tc.key); got != tc.want {
			t.Errorf("Namespace(%q) = %q, want %q", tc.key, got, tc.want)
		}
	}
}

// FuzzKeyNamespace: whatever a node says of itself, if istiod reads a
// namespace from it (the one the TLS port checks its identity against),
// the namespace read from its istio-profile key is that one or none; the
// namespace of its per-node key is its id's or none.
func FuzzKeyNamespace(f *testing.F) {
	f.Add("sidecar", "10.0.0.1", "app-0.ns1", "ns1.svc.cluster.local", "ns1", "app")
	f.Add("node", "1.2.3.4", "p", "ns1.svc", "ns2", "a~b~c~d.evil")
	f.Add("x/ns1", "::1", "p.ns2", "ns2.svc.cluster.local", "", "")
	f.Add("router", "10.0.0.2", "gw", ".svc.cluster.local", "istio-system", "gw/x")
	f.Add("0", "0", "0", "0", "", "")
	f.Fuzz(func(t *testing.T, typ, ip, pod, domain, ns, workload string) {
		n := &core.Node{Id: typ + "~" + ip + "~" + pod + "~" + domain, Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{}}}
		if ns != "" {
			n.Metadata.Fields["NAMESPACE"] = structpb.NewStringValue(ns)
		}
		if workload != "" {
			n.Metadata.Fields["WORKLOAD_NAME"] = structpb.NewStringValue(workload)
		}
		k := Istio{}.Key(n)
		if got, cn := Namespace(string(k)), auth.ConfigNamespace(n); got != "" && cn != "" && got != cn {
			t.Fatalf("Namespace(%q) = %q; the node's config namespace is %q", k, got, cn)
		}
		id := &auth.Identity{TrustDomain: "cluster.local", Namespace: "x", ServiceAccount: "y"}
		if got := Namespace(string(WithIdentity(k, id))); got != Namespace(string(k)) {
			t.Fatalf("the identity changed the key's namespace: %q, was %q", got, Namespace(string(k)))
		}
		pk := PerNode{}.Key(n)
		idNS := auth.ConfigNamespace(&core.Node{Id: n.GetId()})
		if got := Namespace(string(pk)); got != "" && got != idNS {
			t.Fatalf("Namespace(%q) = %q; the node id's namespace is %q", pk, got, idNS)
		}
	})
}
