package aggkey

import (
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// istioPod describes an Istio proxy's node: what istio-agent puts in the
// node id and metadata. reviewsPod is one pod of the reviews-v1 workload;
// the tests change one thing at a time.
type istioPod struct {
	proxyType string
	ip        string // in the node id
	name      string
	idNS      string // the namespace in the node id's DNS domain
	meta      map[string]any
	labels    map[string]any // metadata LABELS; nil leaves them out
	locality  *core.Locality
}

func reviewsPod() istioPod {
	return istioPod{
		proxyType: "sidecar",
		ip:        "10.0.0.1",
		name:      "reviews-v1-7f9c-abcde",
		idNS:      "ns1",
		meta: map[string]any{
			"NAMESPACE":         "ns1",
			"WORKLOAD_NAME":     "reviews-v1",
			"NAME":              "reviews-v1-7f9c-abcde",
			"ISTIO_VERSION":     "1.28.0",
			"CLUSTER_ID":        "Kubernetes",
			"NETWORK":           "net1",
			"MESH_ID":           "cluster.local",
			"SERVICE_ACCOUNT":   "bookinfo-reviews",
			"INTERCEPTION_MODE": "REDIRECT",
			"INSTANCE_IPS":      "10.0.0.1",
		},
		labels: map[string]any{
			"app":                             "reviews",
			"version":                         "v1",
			"pod-template-hash":               "7f9c",
			"service.istio.io/canonical-name": "reviews",
		},
		locality: &core.Locality{Region: "us-east1", Zone: "us-east1-b"},
	}
}

func (p istioPod) id() string {
	return fmt.Sprintf("%s~%s~%s.%s~%s.svc.cluster.local", p.proxyType, p.ip, p.name, p.idNS, p.idNS)
}

// node builds the pod's node afresh: no two calls share any memory.
func (p istioPod) node() *core.Node {
	fields := make(map[string]any, len(p.meta)+1)
	for k, v := range p.meta {
		fields[k] = v
	}
	if p.labels != nil {
		labels := make(map[string]any, len(p.labels))
		for k, v := range p.labels {
			labels[k] = v
		}
		fields["LABELS"] = labels
	}
	md, err := structpb.NewStruct(fields)
	if err != nil {
		panic(err)
	}
	n := &core.Node{Id: p.id(), Metadata: md, Cluster: "reviews.ns1"}
	if p.locality != nil {
		n.Locality = &core.Locality{Region: p.locality.Region, Zone: p.locality.Zone, SubZone: p.locality.SubZone}
	}
	return n
}

// with returns a copy of p changed by each fn; p itself is not changed.
func (p istioPod) with(fns ...func(*istioPod)) istioPod {
	c := p
	c.meta = make(map[string]any, len(p.meta))
	for k, v := range p.meta {
		c.meta[k] = v
	}
	if p.labels != nil {
		c.labels = make(map[string]any, len(p.labels))
		for k, v := range p.labels {
			c.labels[k] = v
		}
	}
	if p.locality != nil {
		l := core.Locality{Region: p.locality.Region, Zone: p.locality.Zone, SubZone: p.locality.SubZone}
		c.locality = &l
	}
	for _, fn := range fns {
		fn(&c)
	}
	return c
}

// podMeta sets metadata field to value, or deletes it if value is nil.
func podMeta(field string, value any) func(*istioPod) {
	return func(p *istioPod) {
		if value == nil {
			delete(p.meta, field)
		} else {
			p.meta[field] = value
		}
	}
}

// podLabel sets a label, or deletes it if value is nil.
func podLabel(name string, value any) func(*istioPod) {
	return func(p *istioPod) {
		if value == nil {
			delete(p.labels, name)
		} else {
			p.labels[name] = value
		}
	}
}

func podIP(ip string) func(*istioPod) { return func(p *istioPod) { p.ip = ip } }

// TestIstioKeySameWorkload: pods of one workload share a key, whatever
// differs between them that does not change istiod's output.
func TestIstioKeySameWorkload(t *testing.T) {
	base := reviewsPod()
	want := Istio{}.Key(base.node())
	otherAgent := base.node()
	otherAgent.Cluster, otherAgent.UserAgentName = "reviews-v1.ns1", "envoy"
	cases := []struct {
		name string
		node *core.Node
	}{
		{"the same pod built again", base.node()},
		{"another pod: name, IP, NAME", base.with(func(p *istioPod) {
			p.name, p.ip = "reviews-v1-7f9c-xyz12", "10.0.3.77"
			p.meta["NAME"], p.meta["INSTANCE_IPS"] = "reviews-v1-7f9c-xyz12", "10.0.3.77"
		}).node()},
		{"statefulset.kubernetes.io/pod-name differs", base.with(podLabel("statefulset.kubernetes.io/pod-name", "reviews-2")).node()},
		{"apps.kubernetes.io/pod-index differs", base.with(podLabel("apps.kubernetes.io/pod-index", "2")).node()},
		{"several IPv4 addresses", base.with(podMeta("INSTANCE_IPS", "10.0.0.9,10.0.1.9")).node()},
		{"IPv4-mapped IPv6 address", base.with(podMeta("INSTANCE_IPS", "::ffff:10.0.0.9")).node()},
		{"no INSTANCE_IPS: the id's IPv4 address", base.with(podMeta("INSTANCE_IPS", nil), podIP("10.0.9.9")).node()},
		{"namespace from the id, not metadata", base.with(podMeta("NAMESPACE", nil)).node()},
		{"metadata namespace wins over the id's", base.with(func(p *istioPod) { p.idNS = "other" }).node()},
		{"node cluster and user agent differ", otherAgent},
		{"metadata the profile does not read", base.with(podMeta("PROXY_CONFIG", map[string]any{"concurrency": 2.0})).node()},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := (Istio{}).Key(tc.node); got != want {
				t.Errorf("Key(%s) = %q, want %q (the base pod's)", tc.node.GetId(), got, want)
			}
		})
	}
}

// TestIstioKeyFields: every field Istio documents changes the key.
func TestIstioKeyFields(t *testing.T) {
	base := reviewsPod()
	extra := Istio{ExtraMetadata: []string{"SIDECAR_SCOPE_HINT", "PROXY_CONFIG"}}
	cases := []struct {
		name    string
		profile Istio
		pod     istioPod
	}{
		{"proxy type", Istio{}, base.with(func(p *istioPod) { p.proxyType = "router" })},
		{"namespace in metadata", Istio{}, base.with(podMeta("NAMESPACE", "ns2"))},
		{"namespace in the node id", Istio{}, base.with(podMeta("NAMESPACE", nil), func(p *istioPod) { p.idNS = "ns3" })},
		{"WORKLOAD_NAME", Istio{}, base.with(podMeta("WORKLOAD_NAME", "reviews-v2"))},
		{"no WORKLOAD_NAME", Istio{}, base.with(podMeta("WORKLOAD_NAME", nil))},
		{"a label's value", Istio{}, base.with(podLabel("version", "v2"))},
		{"a label added", Istio{}, base.with(podLabel("sidecar.istio.io/inject", "true"))},
		{"a label removed", Istio{}, base.with(podLabel("pod-template-hash", nil))},
		{"no LABELS", Istio{}, base.with(func(p *istioPod) { p.labels = nil })},
		{"ISTIO_VERSION", Istio{}, base.with(podMeta("ISTIO_VERSION", "1.29.0"))},
		{"CLUSTER_ID", Istio{}, base.with(podMeta("CLUSTER_ID", "east"))},
		{"NETWORK", Istio{}, base.with(podMeta("NETWORK", "net2"))},
		{"MESH_ID", Istio{}, base.with(podMeta("MESH_ID", "mesh2"))},
		{"SERVICE_ACCOUNT", Istio{}, base.with(podMeta("SERVICE_ACCOUNT", "bookinfo-ratings"))},
		{"INTERCEPTION_MODE", Istio{}, base.with(podMeta("INTERCEPTION_MODE", "TPROXY"))},
		{"GENERATOR", Istio{}, base.with(podMeta("GENERATOR", "grpc"))},
		{"ENABLE_HBONE", Istio{}, base.with(podMeta("ENABLE_HBONE", "true"))},
		{"REQUESTED_NETWORK_VIEW", Istio{}, base.with(podMeta("REQUESTED_NETWORK_VIEW", "net1,net2"))},
		{"locality region", Istio{}, base.with(func(p *istioPod) { p.locality.Region = "europe-west1" })},
		{"locality zone", Istio{}, base.with(func(p *istioPod) { p.locality.Zone = "us-east1-c" })},
		{"locality sub-zone", Istio{}, base.with(func(p *istioPod) { p.locality.SubZone = "rack7" })},
		{"no locality", Istio{}, base.with(func(p *istioPod) { p.locality = nil })},
		{"IP family v6", Istio{}, base.with(podIP("fd00::1"), podMeta("INSTANCE_IPS", "fd00::1"))},
		{"IP family dual", Istio{}, base.with(podMeta("INSTANCE_IPS", "10.0.0.1,fd00::1"))},
		{"extra metadata string", extra, base.with(podMeta("SIDECAR_SCOPE_HINT", "true"))},
		{"DNS_CAPTURE", Istio{}, base.with(podMeta("DNS_CAPTURE", "true"))},
		{"DNS_AUTO_ALLOCATE", Istio{}, base.with(podMeta("DNS_AUTO_ALLOCATE", "true"))},
		{"extra metadata struct", extra, base.with(podMeta("PROXY_CONFIG", map[string]any{"concurrency": 2.0}))},
		{"extra metadata struct field", extra, base.with(podMeta("PROXY_CONFIG", map[string]any{"concurrency": 4.0}))},
	}
	// Every case differs from the base pod, and from every other case: no
	// two fields collapse into one.
	seen := map[Key]string{}
	for _, p := range []Istio{{}, extra} {
		seen[p.Key(base.node())] = "the base pod"
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := tc.pod.node()
			got := tc.profile.Key(n)
			if want := tc.profile.Key(base.node()); got == want {
				t.Errorf("Key(%s) = %q, the base pod's key; want another (the %s matters)", n.GetId(), got, tc.name)
			}
			if other, dup := seen[got]; dup {
				t.Errorf("Key(%s) = %q, as for %s", n.GetId(), got, other)
			}
			seen[got] = tc.name
		})
	}
}

// TestIstioKeyExtraMetadata: a metadata field counts only if the profile
// lists it, and the order of the list does not matter.
func TestIstioKeyExtraMetadata(t *testing.T) {
	a := reviewsPod().with(podMeta("SIDECAR_SCOPE_HINT", "true")).node()
	b := reviewsPod().with(podMeta("SIDECAR_SCOPE_HINT", "false")).node()
	if ka, kb := (Istio{}).Key(a), (Istio{}).Key(b); ka != kb {
		t.Errorf("Key(%s) = %q and %q for two SIDECAR_SCOPE_HINT values, want one key: the default profile does not read it", a.GetId(), ka, kb)
	}
	p1 := Istio{ExtraMetadata: []string{"SIDECAR_SCOPE_HINT", "PROXY_CONFIG"}}
	p2 := Istio{ExtraMetadata: []string{"PROXY_CONFIG", "SIDECAR_SCOPE_HINT"}}
	if k1, k2 := p1.Key(a), p2.Key(a); k1 != k2 {
		t.Errorf("Key(%s) = %q with ExtraMetadata %q, %q with %q; want one key", a.GetId(), k1, p1.ExtraMetadata, k2, p2.ExtraMetadata)
	}
	if ka, kb := p1.Key(a), p1.Key(b); ka == kb {
		t.Errorf("Key(%s) = %q for both SIDECAR_SCOPE_HINT values with ExtraMetadata %q, want two keys", a.GetId(), ka, p1.ExtraMetadata)
	}
}

// TestIstioKeyIPFamilies: v4, v6 and dual-stack pods get three keys; the
// addresses themselves, and whether they come from INSTANCE_IPS or the node
// id, do not matter.
func TestIstioKeyIPFamilies(t *testing.T) {
	ips := func(s string) func(*istioPod) { return podMeta("INSTANCE_IPS", s) }
	noIPs := podMeta("INSTANCE_IPS", nil)
	families := []struct {
		family string
		pods   []istioPod
	}{
		{"v4", []istioPod{
			reviewsPod().with(ips("10.0.0.1")),
			reviewsPod().with(ips("192.168.7.7")),
			reviewsPod().with(ips("10.0.0.1,10.0.0.2")),
			reviewsPod().with(ips("::ffff:10.0.0.1")),
			reviewsPod().with(noIPs, podIP("10.7.7.7")),
		}},
		{"v6", []istioPod{
			reviewsPod().with(ips("fd00::1")),
			reviewsPod().with(ips("2001:db8::7")),
			reviewsPod().with(ips("fd00::1,fd00::2")),
			reviewsPod().with(noIPs, podIP("fd00::7")),
		}},
		{"dual", []istioPod{
			reviewsPod().with(ips("10.0.0.1,fd00::1")),
			reviewsPod().with(ips("fd00::9, 10.9.9.9")),
		}},
	}
	keys := map[Key]string{}
	for _, f := range families {
		want := Istio{}.Key(f.pods[0].node())
		if other, dup := keys[want]; dup {
			t.Errorf("the %s key %q is also the %s key", f.family, want, other)
		}
		keys[want] = f.family
		for _, p := range f.pods[1:] {
			n := p.node()
			if got := (Istio{}).Key(n); got != want {
				t.Errorf("Key(%s) with INSTANCE_IPS %q = %q, want %q (the %s key)", n.GetId(), p.meta["INSTANCE_IPS"], got, want, f.family)
			}
		}
	}
}

// TestIstioKeyPerNode: a node the istio profile cannot classify gets the
// per-node key of its id: correct, not aggregated.
func TestIstioKeyPerNode(t *testing.T) {
	cases := []struct {
		name string
		node *core.Node
	}{
		{"plain Envoy id", &core.Node{Id: "envoy-front-1", Cluster: "front"}},
		{"three parts", &core.Node{Id: "sidecar~10.0.0.1~reviews-1.ns1"}},
		{"five parts", &core.Node{Id: "sidecar~10.0.0.1~reviews-1.ns1~ns1.svc.cluster.local~x"}},
		{"empty proxy type", &core.Node{Id: "~10.0.0.1~reviews-1.ns1~ns1.svc.cluster.local", Metadata: reviewsPod().node().GetMetadata()}},
		{"no namespace anywhere", reviewsPod().with(podMeta("NAMESPACE", nil), func(p *istioPod) { p.idNS = "" }).node()},
		{"empty id", &core.Node{}},
		{"nil node", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			want := PerNode{}.Key(tc.node)
			if got := (Istio{}).Key(tc.node); got != want {
				t.Errorf("Key(%s) = %q, want %q (per node)", tc.node.GetId(), got, want)
			}
		})
	}
	a, b := &core.Node{Id: "envoy-front-1"}, &core.Node{Id: "envoy-front-2"}
	if ka, kb := (Istio{}).Key(a), (Istio{}).Key(b); ka == kb {
		t.Errorf("Key(%s) = Key(%s) = %q, want two keys", a.GetId(), b.GetId(), ka)
	}
}

var keyForm = regexp.MustCompile(`^[^/#]+/[^/#]+/[^#]*#[0-9a-f]{16}$`)

// TestIstioKeyForm: the readable prefix names proxy type, namespace and
// workload (else the app label); the suffix is a 16-digit hash.
func TestIstioKeyForm(t *testing.T) {
	cases := []struct {
		name string
		pod  istioPod
		want string // the prefix, before '#'
	}{
		{"workload", reviewsPod(), "sidecar/ns1/reviews-v1"},
		{"app label without WORKLOAD_NAME", reviewsPod().with(podMeta("WORKLOAD_NAME", nil)), "sidecar/ns1/reviews"},
		{"router", reviewsPod().with(func(p *istioPod) { p.proxyType = "router" }), "router/ns1/reviews-v1"},
		{"namespace from the id", reviewsPod().with(podMeta("NAMESPACE", nil), func(p *istioPod) { p.idNS = "ns7" }), "sidecar/ns7/reviews-v1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := tc.pod.node()
			got := Istio{}.Key(n)
			if !keyForm.MatchString(string(got)) || !strings.HasPrefix(string(got), tc.want+"#") {
				t.Errorf("Key(%s) = %q, want %q followed by '#' and 16 hex digits", n.GetId(), got, tc.want)
			}
		})
	}
}

// TestKeyDeterminism: equal nodes built separately (one by structpb, one
// by hand) get identical keys from every profile, call after call.
func TestKeyDeterminism(t *testing.T) {
	p := reviewsPod()
	built := p.node()
	fields := map[string]*structpb.Value{}
	for k, v := range p.meta {
		fields[k] = structpb.NewStringValue(v.(string))
	}
	labels := map[string]*structpb.Value{}
	for k, v := range p.labels {
		labels[k] = structpb.NewStringValue(v.(string))
	}
	fields["LABELS"] = structpb.NewStructValue(&structpb.Struct{Fields: labels})
	byHand := &core.Node{
		Id:       p.id(),
		Metadata: &structpb.Struct{Fields: fields},
		Locality: &core.Locality{Region: "us-east1", Zone: "us-east1-b"},
	}
	profiles := []Profile{Istio{}, Istio{ExtraMetadata: []string{"LABELS", "NAME"}}, PerNode{}}
	for _, profile := range profiles {
		want := profile.Key(built)
		for i := range 3 {
			if got := profile.Key(built); got != want {
				t.Errorf("%s: Key(%s) call %d = %q, want %q", profile.Name(), built.GetId(), i+2, got, want)
			}
			if got := profile.Key(byHand); got != want {
				t.Errorf("%s: Key(%s) of an equal node built by hand = %q, want %q", profile.Name(), byHand.GetId(), got, want)
			}
		}
	}
}

func TestPerNodeKey(t *testing.T) {
	a := reviewsPod().node()
	b := reviewsPod().with(func(p *istioPod) { p.name, p.ip = "reviews-v1-7f9c-xyz12", "10.0.3.77" }).node()
	ka, kb := PerNode{}.Key(a), PerNode{}.Key(b)
	if ka == kb {
		t.Errorf("Key(%s) = Key(%s) = %q, want a key per node", a.GetId(), b.GetId(), ka)
	}
	if got := (PerNode{}).Key(reviewsPod().node()); got != ka {
		t.Errorf("Key(%s) = %q, want %q (the same node)", a.GetId(), got, ka)
	}
	if want := "node/" + a.GetId() + "#"; !strings.HasPrefix(string(ka), want) {
		t.Errorf("Key(%s) = %q, want prefix %q", a.GetId(), ka, want)
	}
}

func TestParseKeyProfile(t *testing.T) {
	cases := []struct {
		name    string
		extra   []string
		want    Profile
		wantErr []string // what the error must mention; nil: no error
	}{
		{"istio", nil, Istio{}, nil},
		{"", nil, Istio{}, nil},
		{"istio", []string{"DNS_CAPTURE"}, Istio{ExtraMetadata: []string{"DNS_CAPTURE"}}, nil},
		{"per-node", nil, PerNode{}, nil},
		{"per-node", []string{"DNS_CAPTURE"}, nil, []string{"istio"}},
		{"Istio", nil, nil, []string{`"Istio"`, "istio", "per-node"}},
		{"pernode", nil, nil, []string{`"pernode"`, "istio", "per-node"}},
		{"workload", nil, nil, []string{`"workload"`, "istio", "per-node"}},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%q/%s", tc.name, strings.Join(tc.extra, ",")), func(t *testing.T) {
			got, err := ParseProfile(tc.name, tc.extra)
			if tc.wantErr != nil {
				if err == nil {
					t.Fatalf("ParseProfile(%q, %q) = %#v, want an error", tc.name, tc.extra, got)
				}
				for _, part := range tc.wantErr {
					if !strings.HasPrefix(err.Error(), "relay: ") || !strings.Contains(err.Error(), part) {
						t.Errorf("ParseProfile(%q, %q) error = %q, want \"relay: …\" mentioning %s", tc.name, tc.extra, err, part)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseProfile(%q, %q) error = %v", tc.name, tc.extra, err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("ParseProfile(%q, %q) = %#v, want %#v", tc.name, tc.extra, got, tc.want)
			}
			if got.Name() != tc.want.Name() {
				t.Errorf("ParseProfile(%q, %q).Name() = %q, want %q", tc.name, tc.extra, got.Name(), tc.want.Name())
			}
		})
	}
}
