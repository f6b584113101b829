package aggkey

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// Split is a finding of the divergence check: the upstream gave a node of a
// key other content than the node the key's stream presents, so the key's
// profile is too coarse for this mesh. The diverging node and its
// look-alikes (the nodes that have its values in every field other than
// the id where the two nodes differed) leave the key for keys of their own
// (SplitKey); the others stay aggregated.
//
// When the two nodes differed in their ids alone, the split holds the
// diverging node's id and moves that node only.
//
// A split lasts while checks prove it: a later check that finds a node it
// moves given the key's config again merges it back (Merged), and its
// nodes return to the key. Relays of a tier exchange their records of a
// key's splits, proven and merged, and the later record of a split wins
// (MergeSplit).
//
// A Split is immutable and safe for concurrent use.
type Split struct {
	// ID is the diverging node's id; it alone is moved when Fields is
	// empty.
	ID string
	// Fields are the fields where the two nodes differed, other than the
	// id, with the diverging node's values, in name order.
	Fields []SplitField
	// Epoch is when the split was last proven, or disproven: a reading of
	// the hybrid clock (ledger.Stamp) of the relay that checked.
	Epoch uint64
	// Merged marks a split disproven at Epoch: its nodes are the key's
	// again, until a later check proves it again.
	Merged bool

	get []field // Fields' readers, in order
}

// SplitField is one field of a Split: its name as --key-fields names it,
// and the diverging node's value with its kind (metadata's "1" the string is
// not 1 the number), or Missing if that node lacks the field.
type SplitField struct {
	Name    string
	Value   string
	Missing bool
}

// MaxSplits bounds the splits one key keeps. A key whose profile needs more
// is not a class of proxies: past the bound, every node of it is moved
// (SplitAll).
const MaxSplits = 32

// MaxSplitFields bounds the fields of one split: nodes that differ in more
// are moved alone (by ID).
const MaxSplitFields = 16

// SplitAll is the split that moves every node of its key.
var SplitAll = Split{ID: "*"}

// NewSplit returns the split of diverging away from presented, the node the
// key's stream presented when the two got different content.
func NewSplit(diverging, presented *core.Node) Split {
	s := Split{ID: diverging.GetId()}
	for _, name := range Differing(diverging, presented) {
		if name == "id" {
			continue
		}
		f, err := parseField(name)
		if err != nil || len(s.Fields) == MaxSplitFields {
			// A metadata name no path can spell, or too many fields:
			// the node moves alone.
			return Split{ID: diverging.GetId()}
		}
		v, ok := f.get(diverging)
		s.Fields = append(s.Fields, SplitField{Name: name, Value: v.typed, Missing: !ok})
		s.get = append(s.get, f)
	}
	return s
}

// Matches reports whether node is one s moves (whether s is merged or not).
func (s Split) Matches(node *core.Node) bool {
	if s.ID == SplitAll.ID && len(s.Fields) == 0 {
		return true
	}
	if len(s.Fields) == 0 {
		return node.GetId() == s.ID
	}
	for i, f := range s.get {
		v, ok := f.get(node)
		want := s.Fields[i]
		if ok == want.Missing || ok && v.typed != want.Value {
			return false
		}
	}
	return true
}

// FieldNames returns the names of the fields s compares ("id" when it moves
// one node by its id).
func (s Split) FieldNames() []string {
	if len(s.Fields) == 0 {
		return []string{"id"}
	}
	names := make([]string, len(s.Fields))
	for i, f := range s.Fields {
		names[i] = f.Name
	}
	return names
}

// String describes s for logs and the admin surface: field names and the
// diverging node's id, no values.
func (s Split) String() string {
	if s.ID == SplitAll.ID && len(s.Fields) == 0 {
		return "every node"
	}
	return fmt.Sprintf("%s like %s", strings.Join(s.FieldNames(), ","), s.ID)
}

// same reports whether s and t move the same nodes.
func (s Split) same(t Split) bool {
	if len(s.Fields) == 0 || len(t.Fields) == 0 {
		return len(s.Fields) == len(t.Fields) && s.ID == t.ID
	}
	return slices.Equal(s.Fields, t.Fields)
}

// MergeSplit returns a key's split records with s entered, and whether they
// changed: a record that moves the same nodes is replaced if s is later
// (by Epoch) and kept if not; an active split is added unless SplitAll is
// active; a merged one no record knows is kept, so that an older record of
// the split that comes later loses to it. Past MaxSplits active splits the
// result is SplitAll alone; past MaxSplits records in all, the oldest merged
// ones are forgotten.
func MergeSplit(splits []Split, s Split) ([]Split, bool) {
	for i, o := range splits {
		if o.same(s) {
			if s.Epoch <= o.Epoch {
				return splits, false
			}
			out := slices.Clone(splits)
			out[i] = s
			return out, true
		}
	}
	if !s.Merged && slices.ContainsFunc(splits, func(o Split) bool { return !o.Merged && o.same(SplitAll) }) {
		return splits, false
	}
	out := append(slices.Clone(splits), s)
	if active := Active(out); len(active) > MaxSplits {
		all := SplitAll
		all.Epoch = s.Epoch
		return []Split{all}, true
	}
	for len(out) > MaxSplits {
		oldest := -1
		for i, o := range out {
			if o.Merged && (oldest < 0 || o.Epoch < out[oldest].Epoch) {
				oldest = i
			}
		}
		out = slices.Delete(out, oldest, oldest+1)
	}
	return out, true
}

// Active returns the splits of records that are not merged.
func Active(splits []Split) []Split {
	var out []Split
	for _, s := range splits {
		if !s.Merged {
			out = append(out, s)
		}
	}
	return out
}

// SplitKey is the key of a node that left its key by a split: its own.
func SplitKey(node *core.Node) Key { return perNodeKey(node.GetId()) }

// IsSplitKeyOf reports whether k is node's SplitKey, for any identity
// (WithIdentity).
func IsSplitKeyOf(k Key, node *core.Node) bool {
	return strings.HasPrefix(string(k), "node/"+node.GetId()+"#")
}

// Differing returns the names of the fields in which a and b differ, sorted:
// id, cluster, user_agent_name, user_agent_version, locality.region,
// locality.zone, locality.sub_zone, and metadata paths down to the leaves
// (a list is a leaf). A struct holding a name that a path cannot spell
// (empty, or with ']') is a leaf.
func Differing(a, b *core.Node) []string {
	var out []string
	for _, name := range []string{"id", "cluster", "user_agent_name", "user_agent_version", "locality.region", "locality.zone", "locality.sub_zone"} {
		f, _ := parseField(name)
		va, oka := f.get(a)
		vb, okb := f.get(b)
		if oka != okb || va.typed != vb.typed {
			out = append(out, name)
		}
	}
	out = diffStructs(out, "metadata", nil, a.GetMetadata(), b.GetMetadata(), a.GetMetadata(), b.GetMetadata())
	slices.Sort(out)
	return out
}

// diffStructs appends the paths where a and b, the structs at path (named
// name) in the metadata ma and mb, differ.
func diffStructs(out []string, name string, path []string, ma, mb, a, b *structpb.Struct) []string {
	names := make(map[string]bool)
	for n := range a.GetFields() {
		names[n] = true
	}
	for n := range b.GetFields() {
		names[n] = true
	}
	for n := range names {
		p := append(slices.Clip(path), n)
		pn := pathName(name, n)
		sa, sb := a.GetFields()[n].GetStructValue(), b.GetFields()[n].GetStructValue()
		if sa != nil && sb != nil && spellable(sa) && spellable(sb) {
			out = diffStructs(out, pn, p, ma, mb, sa, sb)
			continue
		}
		x, okx := metadataValue(ma, p)
		y, oky := metadataValue(mb, p)
		if okx != oky || x.typed != y.typed {
			out = append(out, pn)
		}
	}
	return out
}

// pathName spells the path of n below the path named name as parseField
// reads it.
func pathName(name, n string) string {
	if !strings.ContainsAny(n, ".[") {
		return name + "." + n
	}
	if name == "metadata" {
		return name + ".[" + n + "]"
	}
	return name + "[" + n + "]"
}

// spellable reports whether every name in s can be spelled in a path.
func spellable(s *structpb.Struct) bool {
	for n := range s.GetFields() {
		if n == "" || strings.Contains(n, "]") {
			return false
		}
	}
	return true
}

// maxSplitsEncoded bounds an encoded list of splits: it travels in gRPC
// metadata, whose headers grpc-go limits to 16 KiB in all.
const maxSplitsEncoded = 8 << 10

type splitJSON struct {
	ID     string      `json:"id"`
	Fields []fieldJSON `json:"fields,omitempty"`
	Epoch  uint64      `json:"epoch,omitempty"`
	Merged bool        `json:"merged,omitempty"`
}

// fieldJSON is a SplitField on the wire: its value as bytes (base64), as a
// metadata struct's value is its binary encoding, which JSON's strings
// cannot carry.
type fieldJSON struct {
	Name    string `json:"name"`
	Value   []byte `json:"value,omitempty"`
	Missing bool   `json:"missing,omitempty"`
}

// EncodeSplits returns the wire form of a key's splits, which relays of a
// tier exchange on their streams (relay.MDSplits). If it would pass
// maxSplitsEncoded, the form of SplitAll is returned.
func EncodeSplits(splits []Split) []byte {
	out := make([]splitJSON, len(splits))
	for i, s := range splits {
		out[i] = splitJSON{ID: s.ID, Epoch: s.Epoch, Merged: s.Merged}
		for _, f := range s.Fields {
			out[i].Fields = append(out[i].Fields, fieldJSON{Name: f.Name, Value: []byte(f.Value), Missing: f.Missing})
		}
	}
	b, err := json.Marshal(out)
	if err != nil || len(b) > maxSplitsEncoded {
		var epoch uint64
		for _, s := range splits {
			epoch = max(epoch, s.Epoch)
		}
		b, _ = json.Marshal([]splitJSON{{ID: SplitAll.ID, Epoch: epoch}})
	}
	return b
}

// DecodeSplits parses splits another relay sent. It refuses more than
// MaxSplits, fields no split names (only the fields Differing returns are
// read: no patterns), and anything over maxSplitsEncoded.
func DecodeSplits(b []byte) ([]Split, error) {
	if len(b) > maxSplitsEncoded {
		return nil, fmt.Errorf("aggkey: splits of %d bytes, over %d", len(b), maxSplitsEncoded)
	}
	var in []splitJSON
	if err := json.Unmarshal(b, &in); err != nil {
		return nil, fmt.Errorf("aggkey: splits: %w", err)
	}
	if len(in) > MaxSplits {
		return nil, fmt.Errorf("aggkey: %d splits, over %d", len(in), MaxSplits)
	}
	out := make([]Split, 0, len(in))
	for _, j := range in {
		if j.ID == "" {
			return nil, errors.New("aggkey: a split without the diverging node's id")
		}
		if len(j.Fields) > MaxSplitFields {
			return nil, fmt.Errorf("aggkey: a split of %d fields, over %d", len(j.Fields), MaxSplitFields)
		}
		s := Split{ID: j.ID, Epoch: j.Epoch, Merged: j.Merged}
		for i, sf := range j.Fields {
			s.Fields = append(s.Fields, SplitField{Name: sf.Name, Value: string(sf.Value), Missing: sf.Missing})
			if !splittable(sf.Name) {
				return nil, fmt.Errorf("aggkey: split field %q is not one a split compares", sf.Name)
			}
			if i > 0 && sf.Name <= j.Fields[i-1].Name {
				return nil, errors.New("aggkey: split fields out of order")
			}
			f, err := parseField(sf.Name)
			if err != nil {
				return nil, fmt.Errorf("aggkey: split: %w", err)
			}
			s.get = append(s.get, f)
		}
		out = append(out, s)
	}
	return out, nil
}

// splittable reports whether name is a field Differing may return, other
// than the id.
func splittable(name string) bool {
	switch name {
	case "cluster", "user_agent_name", "user_agent_version", "locality.region", "locality.zone", "locality.sub_zone":
		return true
	}
	return strings.HasPrefix(name, "metadata.")
}
