// Package aggkey derives aggregation keys: the class of proxies a node
// belongs to, which receive identical configuration from the upstream, so
// that one upstream stream serves them all. A Profile maps a node to its
// Key (Istio reads the node fields that change istiod's output; Fields
// reads the fields an operator's rules name; PerNode never aggregates);
// WithIdentity mixes a stream's proven identity into
// it; Namespace reads back the namespace a key's Envoys are of, which
// scopes what an admin caller of that namespace is shown.
package aggkey

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshrelay/meshrelay/relay/auth"
)

// Key names an aggregation key: a class of proxies that receive identical
// configuration from the upstream, so that one upstream stream can serve them
// all. Keys are deterministic: every relay derives the same Key from the same
// node. The readable prefix is for operators; the hash suffix is the identity.
type Key string

// Profile derives a node's aggregation key. Implementations must be safe
// for concurrent use and deterministic.
type Profile interface {
	// Key returns the key of node. It must not fail for a node the relay can
	// serve; profiles fall back to a per-node key when a field they need is
	// missing.
	Key(node *core.Node) Key
	// Name is the profile's flag value.
	Name() string
}

// Key profile names accepted by ParseProfile.
const (
	ProfileIstio   = "istio"
	ProfilePerNode = "per-node"
)

// ParseProfile returns the profile a --key-profile flag names. extraMeta
// adds node metadata fields to the istio profile (see Istio).
func ParseProfile(name string, extraMeta []string) (Profile, error) {
	switch name {
	case ProfileIstio, "":
		return Istio{ExtraMetadata: extraMeta}, nil
	case ProfilePerNode:
		if len(extraMeta) > 0 {
			return nil, errors.New("relay: extra key metadata needs the istio profile")
		}
		return PerNode{}, nil
	case ProfileFields:
		return nil, errors.New("relay: the fields profile keys by the fields a rule lists: give them with --key-fields or --key-config")
	}
	return nil, fmt.Errorf("relay: unknown key profile %q (want %s, %s or %s)", name, ProfileIstio, ProfileFields, ProfilePerNode)
}

// PerNode keys every node by its id: no aggregation, always correct.
type PerNode struct{}

// Name implements Profile.
func (PerNode) Name() string { return ProfilePerNode }

// Key implements Profile.
func (PerNode) Key(node *core.Node) Key { return perNodeKey(node.GetId()) }

func perNodeKey(id string) Key {
	return Key("node/" + id + "#" + digest(id))
}

// Istio keys a node by the fields that change what istiod generates
// for it. Pods of one workload (same namespace, labels, service account, …;
// different names and IPs) get byte-identical CDS/EDS/LDS/RDS from istiod, so
// they share a key. The fields, exactly:
//
//   - proxy type: the node id's first "~" part (sidecar, router, …);
//   - namespace: metadata NAMESPACE, else the node id's DNS domain part
//     ("<ns>.svc.cluster.local"), as istiod reads it (auth.ConfigNamespace);
//   - workload: metadata WORKLOAD_NAME and the whole LABELS map except the
//     labels that name a single pod (statefulset.kubernetes.io/pod-name,
//     apps.kubernetes.io/pod-index);
//   - metadata ISTIO_VERSION, CLUSTER_ID, NETWORK, MESH_ID, SERVICE_ACCOUNT,
//     INTERCEPTION_MODE, GENERATOR (proxyless gRPC gets other config),
//     ENABLE_HBONE, REQUESTED_NETWORK_VIEW, DNS_CAPTURE, DNS_AUTO_ALLOCATE
//     (a proxy that captures DNS gets auto-allocated addresses), and every
//     ExtraMetadata field;
//   - locality: region, zone and sub-zone (EDS priorities depend on it);
//   - IP families of INSTANCE_IPS (v4, v6 or dual: listeners bind by family),
//     not the addresses themselves.
//
// A node whose id is not Istio's four-part form, or which names no
// namespace, gets a per-node key: correct, just not aggregated.
//
// Not included: the pod name and IPs. A pod whose IP backs a Service can get
// inbound config that depends on that IP; the divergence check in DESIGN.md
// exists for that case, and ProfilePerNode is always available.
type Istio struct {
	// ExtraMetadata lists further node metadata fields to include.
	ExtraMetadata []string
}

// Name implements Profile.
func (Istio) Name() string { return ProfileIstio }

var istioMetadataFields = []string{
	"ISTIO_VERSION", "CLUSTER_ID", "NETWORK", "MESH_ID", "SERVICE_ACCOUNT",
	"INTERCEPTION_MODE", "GENERATOR", "ENABLE_HBONE", "REQUESTED_NETWORK_VIEW",
	// A proxy that captures DNS consumes auto-allocated service addresses
	// (its listeners and clusters, and its NDS name table, differ).
	"DNS_CAPTURE", "DNS_AUTO_ALLOCATE",
}

var perPodLabels = []string{"statefulset.kubernetes.io/pod-name", "apps.kubernetes.io/pod-index"}

// Key implements Profile.
func (p Istio) Key(node *core.Node) Key {
	id := node.GetId()
	parts := strings.Split(id, "~")
	if len(parts) != 4 || parts[0] == "" {
		return perNodeKey(id)
	}
	md := node.GetMetadata().GetFields()
	// The namespace istiod configures the node for (auth.ConfigNamespace,
	// whose rule the TLS port applies): a DNS domain without a dot names
	// none, and the node gets a per-node key.
	ns := auth.ConfigNamespace(node)
	if ns == "" {
		return perNodeKey(id)
	}
	workload := md["WORKLOAD_NAME"].GetStringValue()

	var b canon
	b.field("type", parts[0])
	b.field("namespace", ns)
	b.field("workload", workload)
	for _, f := range istioMetadataFields {
		b.field(f, md[f].GetStringValue())
	}
	for _, f := range slices.Sorted(slices.Values(p.ExtraMetadata)) {
		b.value("meta:"+f, md[f])
	}
	if labels := md["LABELS"].GetStructValue().GetFields(); len(labels) > 0 {
		for _, k := range slices.Sorted(maps.Keys(labels)) {
			if !slices.Contains(perPodLabels, k) {
				b.field("label:"+k, labels[k].GetStringValue())
			}
		}
	}
	loc := node.GetLocality()
	b.field("locality", loc.GetRegion()+"/"+loc.GetZone()+"/"+loc.GetSubZone())
	b.field("ipfamilies", ipFamilies(md["INSTANCE_IPS"].GetStringValue(), parts[1]))

	name := workload
	if name == "" {
		name = md["LABELS"].GetStructValue().GetFields()["app"].GetStringValue()
	}
	return Key(parts[0] + "/" + ns + "/" + name + "#" + b.sum())
}

// ipFamilies returns "4", "6" or "46" for a comma-separated IP list (istio's
// INSTANCE_IPS), falling back to the IP in the node id.
func ipFamilies(instanceIPs, idIP string) string {
	if instanceIPs == "" {
		instanceIPs = idIP
	}
	var v4, v6 bool
	for _, s := range strings.Split(instanceIPs, ",") {
		a, err := netip.ParseAddr(strings.TrimSpace(s))
		if err != nil {
			continue
		}
		if a.Unmap().Is4() {
			v4 = true
		} else {
			v6 = true
		}
	}
	out := ""
	if v4 {
		out += "4"
	}
	if v6 {
		out += "6"
	}
	return out
}

// canon builds an unambiguous byte string of (name, value) pairs to hash.
type canon struct{ b []byte }

func (c *canon) field(name, value string) {
	c.b = fmt.Appendf(c.b, "%d:%s=%d:%s;", len(name), name, len(value), value)
}

func (c *canon) value(name string, v *structpb.Value) {
	if v == nil {
		c.field(name, "")
		return
	}
	// The text form of a proto is deliberately unstable; deterministic
	// binary marshalling (sorted map keys) is stable.
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(v)
	if err != nil {
		b = nil
	}
	c.field(name, string(b))
}

func (c *canon) sum() string {
	h := sha256.Sum256(c.b)
	return hex.EncodeToString(h[:8])
}

func digest(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:8])
}

// WithIdentity makes an authenticated stream's identity part of its key:
// nodes that look alike but are proven by different service accounts
// (istiod's rule lets a node without SERVICE_ACCOUNT through for any) must
// not share an upstream stream, nor each other's config.
func WithIdentity(k Key, id *auth.Identity) Key {
	if id == nil {
		return k
	}
	prefix, sum := string(k), ""
	if i := strings.LastIndexByte(prefix, '#'); i >= 0 {
		prefix, sum = prefix[:i], prefix[i+1:]
	}
	return Key(prefix + "#" + digest(sum+"\x00"+id.SPIFFEID()))
}

// Namespace returns the namespace of a key's Envoys, read from the key
// the relay derived from their nodes (the ledger records an Envoy's node
// id and key, not its metadata):
//
//   - an istio-profile key, "<type>/<namespace>/<workload>#<hash>", names
//     the namespace the profile read from its nodes (metadata NAMESPACE,
//     else the id's domain): for a node istiod reads a namespace from
//     (auth.ConfigNamespace), that one, which the TLS port checked the
//     stream's identity against;
//   - a per-node key, "node/<id>#<hash>", names its node id's namespace
//     (the id's DNS domain, "sidecar~ip~pod.ns~ns.svc.cluster.local");
//   - anything else, or a name that is not a Kubernetes namespace name,
//     names none: "", which only admins see.
//
// A workload can make its own Envoys look like another namespace's (a
// crafted node on the plaintext port, a per-node key whose id and
// metadata disagree), never another workload's look like its own.
func Namespace(key string) string {
	prefix := key
	if i := strings.LastIndexByte(prefix, '#'); i >= 0 {
		prefix = prefix[:i]
	}
	var ns string
	if id, ok := strings.CutPrefix(prefix, "node/"); ok {
		// Istio's ids hold no "/": one that does is an istio-profile key
		// of a node that calls itself of type "node", which names none.
		if !strings.Contains(id, "/") {
			ns = auth.ConfigNamespace(&core.Node{Id: id})
		}
	} else if parts := strings.Split(prefix, "/"); len(parts) == 3 && parts[0] != "" {
		ns = parts[1]
	}
	if !isNamespaceName(ns) {
		return ""
	}
	return ns
}

// isNamespaceName reports whether s is a Kubernetes namespace name (an
// RFC 1123 label).
func isNamespaceName(s string) bool {
	if s == "" || len(s) > 63 || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}
