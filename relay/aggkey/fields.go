package aggkey

import (
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"sigs.k8s.io/yaml"

	"github.com/meshrelay/meshrelay/relay/auth"
)

// ProfileFields names the profile that keys nodes by the node fields an
// operator lists (Fields).
const ProfileFields = "fields"

// Rule is one rule of a Fields profile: a node that matches every Match
// pattern is keyed by the values of its Key fields. Field names:
//
//   - id: the node id; id~REGEX: the first capture group of REGEX (or its
//     whole match) in the id, missing when it does not match;
//   - cluster, user_agent_name, user_agent_version;
//   - locality (region/zone/sub_zone), locality.region, locality.zone,
//     locality.sub_zone;
//   - namespace: the namespace istiod configures the node for (metadata
//     NAMESPACE, else the id's DNS domain: auth.ConfigNamespace), the one
//     the TLS port checks the stream's identity against;
//   - metadata.PATH: a node metadata value, PATH its struct fields by name,
//     dot-separated; a name holding a dot goes in brackets:
//     metadata.LABELS[app.kubernetes.io/name].
//
// A field the node lacks is missing, a value of its own: nodes that lack
// it share a key with each other, not with nodes that have it empty.
type Rule struct {
	// Name names the rule in keys and logs: a DNS label (lower-case
	// letters, digits and '-', not at either end), not "node".
	Name string `json:"name"`
	// Match maps fields to regular expressions (RE2, matched against the
	// whole value); a node matches the rule if every one matches. Empty:
	// every node.
	Match map[string]string `json:"match,omitempty"`
	// Key lists the fields whose values make the key, at least one.
	Key []string `json:"key"`
}

// Fields keys a node by the first of its rules the node matches; a node
// that matches none gets a per-node key (correct, just not aggregated).
// Keys are promises that the upstream gives every node of one key the same
// config: list the fields that change what the upstream sends, and let the
// divergence check catch a list too coarse for the mesh. The relay mixes a
// stream's proven identity into its key (WithIdentity) whatever the
// fields, so nodes of two identities never share a key.
//
// A Fields is immutable and safe for concurrent use.
type Fields struct {
	rules []fieldsRule
}

type fieldsRule struct {
	name  string
	match []fieldMatch // by field name
	key   []field
	// namespace is the index in key of the namespace field (-1: none):
	// its value names the namespace of the key's Envoys.
	namespace int
}

type fieldMatch struct {
	f  field
	re *regexp.Regexp
}

// field reads one value of a node.
type field struct {
	name string
	// get returns the value, and whether the node has it. typed is the
	// value with its kind (a metadata value's: "1" the string is not 1
	// the number), which keys hash; text is what patterns match and keys
	// show.
	get func(*core.Node) (v value, ok bool)
}

type value struct{ text, typed string }

// Name implements Profile.
func (*Fields) Name() string { return ProfileFields }

// String describes the rules, as a flag or config would give them.
func (p *Fields) String() string {
	var b strings.Builder
	for i, r := range p.rules {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(r.name)
		for _, m := range r.match {
			fmt.Fprintf(&b, " %s=~%s", m.f.name, m.re)
		}
		b.WriteString(" by ")
		for j, f := range r.key {
			if j > 0 {
				b.WriteByte(',')
			}
			b.WriteString(f.name)
		}
	}
	return b.String()
}

// ParseKeyFields returns the Fields profile of a --key-fields flag: one
// rule, named "fields", keying every node by the comma-separated fields
// (a regular expression holding a comma needs the config file).
func ParseKeyFields(list string) (*Fields, error) {
	var key []string
	for f := range strings.SplitSeq(list, ",") {
		key = append(key, strings.TrimSpace(f))
	}
	return NewFields([]Rule{{Name: "fields", Key: key}})
}

// fieldsConfig is the --key-config file.
type fieldsConfig struct {
	Rules []Rule `json:"rules"`
}

// ParseKeyConfig returns the Fields profile of a --key-config file (YAML):
//
//	rules:
//	- name: gateways
//	  match: {id: "router~.*"}
//	  key: [namespace, metadata.LABELS.app, locality]
//	- name: sidecars
//	  key: [namespace, metadata.WORKLOAD_NAME, metadata.ISTIO_VERSION]
//
// Unknown fields are errors.
func ParseKeyConfig(b []byte) (*Fields, error) {
	var c fieldsConfig
	if err := yaml.UnmarshalStrict(b, &c); err != nil {
		return nil, fmt.Errorf("aggkey: key config: %w", err)
	}
	return NewFields(c.Rules)
}

// NewFields validates rules and returns their profile.
func NewFields(rules []Rule) (*Fields, error) {
	if len(rules) == 0 {
		return nil, errors.New("aggkey: a fields profile needs at least one rule")
	}
	p := &Fields{}
	seen := map[string]bool{}
	for i, r := range rules {
		where := fmt.Sprintf("rule %d (%q)", i+1, r.Name)
		if !isRuleName(r.Name) {
			return nil, fmt.Errorf("aggkey: %s: a rule's name is a DNS label (lower-case letters, digits and '-' inside), not %q, nor \"node\"", where, r.Name)
		}
		if seen[r.Name] {
			return nil, fmt.Errorf("aggkey: %s: two rules are named %q", where, r.Name)
		}
		seen[r.Name] = true
		if len(r.Key) == 0 {
			return nil, fmt.Errorf("aggkey: %s: key lists no field", where)
		}
		cr := fieldsRule{name: r.Name, namespace: -1}
		for j, name := range r.Key {
			f, err := parseField(name)
			if err != nil {
				return nil, fmt.Errorf("aggkey: %s: key: %w", where, err)
			}
			if slices.ContainsFunc(cr.key, func(g field) bool { return g.name == f.name }) {
				return nil, fmt.Errorf("aggkey: %s: key lists %s twice", where, f.name)
			}
			if f.name == "namespace" {
				cr.namespace = j
			}
			cr.key = append(cr.key, f)
		}
		for _, name := range slices.Sorted(maps.Keys(r.Match)) {
			f, err := parseField(name)
			if err != nil {
				return nil, fmt.Errorf("aggkey: %s: match: %w", where, err)
			}
			re, err := regexp.Compile(`^(?:` + r.Match[name] + `)$`)
			if err != nil {
				return nil, fmt.Errorf("aggkey: %s: match %s: %w", where, name, err)
			}
			cr.match = append(cr.match, fieldMatch{f, re})
		}
		p.rules = append(p.rules, cr)
	}
	return p, nil
}

// isRuleName reports whether s may name a rule: a DNS label, as a
// namespace's name is, other than "node" (per-node keys' prefix).
func isRuleName(s string) bool { return s != "node" && isNamespaceName(s) }

// parseField returns the field a name in a rule names.
func parseField(name string) (field, error) {
	get := func(fn func(*core.Node) string) func(*core.Node) (value, bool) {
		return func(n *core.Node) (value, bool) {
			v := fn(n)
			return value{v, v}, v != ""
		}
	}
	f := field{name: name}
	switch name {
	case "id":
		f.get = get((*core.Node).GetId)
	case "cluster":
		f.get = get((*core.Node).GetCluster)
	case "user_agent_name":
		f.get = get((*core.Node).GetUserAgentName)
	case "user_agent_version":
		f.get = get((*core.Node).GetUserAgentVersion)
	case "locality":
		f.get = func(n *core.Node) (value, bool) {
			l := n.GetLocality()
			v := l.GetRegion() + "/" + l.GetZone() + "/" + l.GetSubZone()
			return value{v, v}, l != nil
		}
	case "locality.region":
		f.get = get(func(n *core.Node) string { return n.GetLocality().GetRegion() })
	case "locality.zone":
		f.get = get(func(n *core.Node) string { return n.GetLocality().GetZone() })
	case "locality.sub_zone":
		f.get = get(func(n *core.Node) string { return n.GetLocality().GetSubZone() })
	case "namespace":
		f.get = get(auth.ConfigNamespace)
	default:
		switch {
		case strings.HasPrefix(name, "id~"):
			re, err := regexp.Compile(name[len("id~"):])
			if err != nil {
				return field{}, fmt.Errorf("field %q: %w", name, err)
			}
			f.get = func(n *core.Node) (value, bool) {
				m := re.FindStringSubmatch(n.GetId())
				switch {
				case m == nil:
					return value{}, false
				case len(m) > 1:
					return value{m[1], m[1]}, true
				}
				return value{m[0], m[0]}, true
			}
		case strings.HasPrefix(name, "metadata."):
			path, err := metadataPath(name[len("metadata."):])
			if err != nil {
				return field{}, fmt.Errorf("field %q: %w", name, err)
			}
			f.get = func(n *core.Node) (value, bool) { return metadataValue(n.GetMetadata(), path) }
		default:
			return field{}, fmt.Errorf("unknown field %q (want id, id~REGEX, cluster, user_agent_name, user_agent_version, locality[.region|.zone|.sub_zone], namespace or metadata.PATH)", name)
		}
	}
	return f, nil
}

// metadataPath splits a metadata path: names separated by dots, a name in
// brackets taken whole.
func metadataPath(s string) ([]string, error) {
	var path []string
	for s != "" {
		var name string
		if s[0] == '[' {
			end := strings.IndexByte(s, ']')
			if end < 0 {
				return nil, errors.New("a '[' without its ']'")
			}
			name, s = s[1:end], s[end+1:]
			if s != "" && s[0] != '.' && s[0] != '[' {
				return nil, fmt.Errorf("%q after a ']'", s)
			}
			s = strings.TrimPrefix(s, ".")
		} else {
			end := strings.IndexAny(s, ".[")
			if end < 0 {
				end = len(s)
			}
			name, s = s[:end], s[end:]
			s = strings.TrimPrefix(s, ".")
		}
		if name == "" {
			return nil, errors.New("an empty name in the path")
		}
		path = append(path, name)
	}
	if len(path) == 0 {
		return nil, errors.New("no name after metadata.")
	}
	return path, nil
}

// metadataValue returns the value at path in md: a string as it is, a
// number or bool in Go's form, anything else (a struct, a list, null) as
// no text and its deterministic binary encoding; typed by its kind.
func metadataValue(md *structpb.Struct, path []string) (value, bool) {
	var v *structpb.Value
	for i, name := range path {
		if i > 0 {
			md = v.GetStructValue()
		}
		var ok bool
		if v, ok = md.GetFields()[name]; !ok || v == nil {
			return value{}, false
		}
	}
	switch k := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		return value{k.StringValue, "s:" + k.StringValue}, true
	case *structpb.Value_NumberValue:
		t := strconv.FormatFloat(k.NumberValue, 'g', -1, 64)
		return value{t, "n:" + t}, true
	case *structpb.Value_BoolValue:
		t := strconv.FormatBool(k.BoolValue)
		return value{t, "b:" + t}, true
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(v)
	if err != nil {
		return value{}, false
	}
	return value{"", "x:" + string(b)}, true
}

// Key implements Profile. A key is "<rule>/<namespace>/<values>#<hash>"
// when the rule keys by namespace (which Namespace reads back, as of an
// istio-profile key), else "<rule>:<values>#<hash>"; the values are
// readable, escaped and cut short, the hash covers them whole.
func (p *Fields) Key(node *core.Node) Key {
	for i := range p.rules {
		r := &p.rules[i]
		if !r.matches(node) {
			continue
		}
		var b canon
		b.field("rule", r.name)
		var readable []string
		ns := ""
		for j, f := range r.key {
			v, ok := f.get(node)
			if !ok {
				b.field("missing:"+f.name, "")
				readable = append(readable, "-")
				continue
			}
			b.field("field:"+f.name, v.typed)
			if j == r.namespace {
				ns = v.text
				continue
			}
			readable = append(readable, v.text)
		}
		values := readableValues(readable)
		if r.namespace >= 0 && isNamespaceName(ns) {
			return Key(r.name + "/" + ns + "/" + values + "#" + b.sum())
		}
		return Key(r.name + ":" + values + "#" + b.sum())
	}
	return perNodeKey(node.GetId())
}

func (r *fieldsRule) matches(node *core.Node) bool {
	for _, m := range r.match {
		v, ok := m.f.get(node)
		if !ok || !m.re.MatchString(v.text) {
			return false
		}
	}
	return true
}

// maxReadable bounds the readable part of a fields key.
const maxReadable = 96

// readableValues joins values with ',' for a key's readable part: bytes
// other than letters, digits, '.', '_' and '-' are %-escaped (so the part
// holds no '/', ':' or '#'), and it is cut at maxReadable bytes, ending
// in '~'.
func readableValues(values []string) string {
	var b strings.Builder
	for i, v := range values {
		if i > 0 {
			b.WriteByte(',')
		}
		for j := 0; j < len(v) && b.Len() < maxReadable; j++ {
			c := v[j]
			if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-' {
				b.WriteByte(c)
			} else {
				fmt.Fprintf(&b, "%%%02X", c)
			}
		}
		if b.Len() >= maxReadable {
			return b.String()[:maxReadable] + "~"
		}
	}
	return b.String()
}
