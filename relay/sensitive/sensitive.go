// Package sensitive finds the fields Envoy's protos mark sensitive
// (udpa.annotations.sensitive: private keys, passwords, session ticket
// keys, HMAC and generic secrets), wherever in a resource they are: inside
// nested messages, maps, and the Any and TypedStruct of extension configs
// (a Cluster's TLS context lives in transport_socket.typed_config). The
// snapshot store seals what holds one before it writes it; the config
// dumps (relay/redact) hide them.
//
// In reads a serialized resource without decoding it: it walks the wire
// format guided by plans made once per message type, which follow only
// the fields that can lead to a sensitive one. A type that can hold none
// costs one map lookup, and a Cluster without TLS a walk over its bytes
// that allocates nothing. Everything here is safe for concurrent use.
package sensitive

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"unsafe"

	"github.com/cncf/xds/go/udpa/annotations"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/structpb"
)

// Field reports whether Envoy marks fd sensitive. The answer is cached:
// reading an option's extension is not cheap.
func Field(fd protoreflect.FieldDescriptor) bool {
	if v, ok := fields.Load(fd); ok {
		return v.(bool)
	}
	s, _ := proto.GetExtension(fd.Options(), annotations.E_Sensitive).(bool)
	fields.Store(fd, s)
	return s
}

var fields sync.Map // protoreflect.FieldDescriptor → bool

// ErrUnknownType is returned by In for a type this binary's protos do not
// know: what it holds cannot be checked.
var ErrUnknownType = errors.New("sensitive: type unknown to the relay")

// In reports whether body, a serialized resource of typeURL, sets a field
// Envoy marks sensitive anywhere within it: a field present on the wire
// counts, even if empty. Extension configs in an Any or a TypedStruct
// are followed; one of a type this binary does not know cannot hold one of
// Envoy's sensitive fields as this binary knows them (every Envoy package
// that declares one is linked, see envoy.go), and is taken to hold none.
//
// An error means the body could not be checked: typeURL is unknown
// (ErrUnknownType), or body does not parse as its type. A caller that
// keeps secrets safe treats an error as "sensitive".
func In(typeURL string, body []byte) (bool, error) {
	p, err := planForURL(typeURL)
	if err != nil {
		return false, err
	}
	if p == nil {
		return false, nil // its type can hold nothing sensitive
	}
	found, err := p.scan(body, 0)
	if err != nil {
		return false, fmt.Errorf("sensitive: %s: %w", typeURL, err)
	}
	return found, nil
}

// maxDepth bounds the nesting In follows (messages within Any within …):
// protobuf's own decoder stops at 10,000; Envoy's config is never deeper
// than a few dozen.
const maxDepth = 100

var errDepth = fmt.Errorf("nested deeper than %d", maxDepth)

// kind tells how a plan reads a message.
type kind uint8

const (
	kindMessage     kind = iota // its fields, as plan.fields says
	kindAny                     // google.protobuf.Any: the type it names
	kindTypedStruct             // udpa.type.v1 / xds.type.v3 TypedStruct
)

// plan is how to look for a sensitive field in a message type that can
// hold one: the fields that are sensitive, and the message fields whose
// type can hold one. Every other field is skipped.
type plan struct {
	kind   kind
	fields map[protowire.Number]step
}

type step struct {
	sensitive bool  // the field itself is marked sensitive
	next      *plan // else: the field's message type, which can hold one
}

var (
	buildMu sync.Mutex
	// plans caches every message type looked at: its plan, or nil if it
	// can hold nothing sensitive. Keys are full names; values *plan.
	plans sync.Map
	// byURL caches the plans of the type names in URLs that resolved (a
	// hostile upstream may name any number of unknown ones: those are not
	// kept).
	byURL sync.Map // string → *plan
)

func planForURL(url string) (*plan, error) {
	// Keyed by the type's name: "type.googleapis.com/" is a convention,
	// and a hostile upstream could vary whatever comes before the name.
	name := url[strings.LastIndexByte(url, '/')+1:]
	if p, ok := byURL.Load(name); ok {
		return p.(*plan), nil
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(name))
	if err != nil {
		return nil, ErrUnknownType
	}
	p := planFor(mt.Descriptor())
	byURL.Store(strings.Clone(name), p)
	return p, nil
}

// planForURLBytes is planForURL for a type URL read from the wire: the
// lookup does not copy it.
func planForURLBytes(b []byte) (*plan, error) {
	if len(b) == 0 {
		return nil, ErrUnknownType
	}
	return planForURL(unsafe.String(unsafe.SliceData(b), len(b)))
}

func special(md protoreflect.MessageDescriptor) (kind, bool) {
	switch md.FullName() {
	case "google.protobuf.Any":
		return kindAny, true
	case "udpa.type.v1.TypedStruct", "xds.type.v3.TypedStruct":
		return kindTypedStruct, true
	}
	return kindMessage, false
}

// planFor returns md's plan, nil if it can hold nothing sensitive. The
// first call for a type works out every type reachable from it at once.
func planFor(md protoreflect.MessageDescriptor) *plan {
	if p, ok := plans.Load(md.FullName()); ok {
		return p.(*plan)
	}
	buildMu.Lock()
	defer buildMu.Unlock()
	if p, ok := plans.Load(md.FullName()); ok {
		return p.(*plan)
	}
	// Every message type reachable from md through message fields, not yet
	// planned (the types already planned are settled).
	graph := map[protoreflect.FullName]protoreflect.MessageDescriptor{}
	var visit func(protoreflect.MessageDescriptor)
	visit = func(m protoreflect.MessageDescriptor) {
		if _, ok := graph[m.FullName()]; ok {
			return
		}
		if _, ok := plans.Load(m.FullName()); ok {
			return
		}
		graph[m.FullName()] = m
		if _, ok := special(m); ok {
			return
		}
		fs := m.Fields()
		for i := range fs.Len() {
			if sub := fs.Get(i).Message(); sub != nil {
				visit(sub)
			}
		}
	}
	visit(md)
	// may: can the type hold a sensitive field? Settled types answer from
	// the cache; the rest are found by a fixed point (types can recurse).
	may := make(map[protoreflect.FullName]bool, len(graph))
	holds := func(m protoreflect.MessageDescriptor) bool {
		if p, ok := plans.Load(m.FullName()); ok {
			return p.(*plan) != nil
		}
		return may[m.FullName()]
	}
	for changed := true; changed; {
		changed = false
		for name, m := range graph {
			if may[name] {
				continue
			}
			if _, ok := special(m); ok {
				may[name], changed = true, true
				continue
			}
			fs := m.Fields()
			for i := range fs.Len() {
				f := fs.Get(i)
				if Field(f) || f.Message() != nil && holds(f.Message()) {
					may[name], changed = true, true
					break
				}
			}
		}
	}
	built := make(map[protoreflect.FullName]*plan, len(graph))
	for name, m := range graph {
		if may[name] {
			k, _ := special(m)
			built[name] = &plan{kind: k}
		}
	}
	planOf := func(m protoreflect.MessageDescriptor) *plan {
		if p, ok := built[m.FullName()]; ok {
			return p
		}
		if p, ok := plans.Load(m.FullName()); ok {
			return p.(*plan)
		}
		return nil
	}
	for name, p := range built {
		if p.kind != kindMessage {
			continue
		}
		p.fields = map[protowire.Number]step{}
		fs := graph[name].Fields()
		for i := range fs.Len() {
			f := fs.Get(i)
			switch {
			case Field(f):
				p.fields[f.Number()] = step{sensitive: true}
			case f.Message() != nil:
				if next := planOf(f.Message()); next != nil {
					p.fields[f.Number()] = step{next: next}
				}
			}
		}
	}
	for name := range graph {
		plans.Store(name, built[name]) // nil for a type that holds nothing
	}
	return built[md.FullName()]
}

// scan looks for a sensitive field in b, a message p plans for.
func (p *plan) scan(b []byte, depth int) (bool, error) {
	if depth > maxDepth {
		return false, errDepth
	}
	switch p.kind {
	case kindAny:
		return scanAny(b, depth)
	case kindTypedStruct:
		return scanTypedStruct(b, depth)
	}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false, protowire.ParseError(n)
		}
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return false, protowire.ParseError(m)
		}
		if st, ok := p.fields[num]; ok {
			if st.sensitive {
				return true, nil
			}
			// A message field with another wire type is an unknown field
			// to protobuf's decoder too.
			if typ == protowire.BytesType {
				v, _ := protowire.ConsumeBytes(b)
				if found, err := st.next.scan(v, depth+1); found || err != nil {
					return found, err
				}
			}
		}
		b = b[m:]
	}
	return false, nil
}

// fields12 reads the first two fields of an Any or a TypedStruct (type_url
// and value), the last of each as protobuf's decoder would.
func fields12(b []byte) (url, value []byte, err error) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, nil, protowire.ParseError(n)
		}
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return nil, nil, protowire.ParseError(m)
		}
		if typ == protowire.BytesType && (num == 1 || num == 2) {
			v, _ := protowire.ConsumeBytes(b)
			if num == 1 {
				url = v
			} else {
				value = v
			}
		}
		b = b[m:]
	}
	return url, value, nil
}

func scanAny(b []byte, depth int) (bool, error) {
	url, value, err := fields12(b)
	if err != nil {
		return false, err
	}
	p, err := planForURLBytes(url)
	if err != nil || p == nil {
		return false, nil // unknown (see In), or holds nothing sensitive
	}
	return p.scan(value, depth+1)
}

// scanTypedStruct checks a TypedStruct (an extension's config as JSON-like
// Struct) by turning it into the message it names. If that fails, it is
// taken to be sensitive when its type can hold a sensitive field.
func scanTypedStruct(b []byte, depth int) (bool, error) {
	url, value, err := fields12(b)
	if err != nil {
		return false, err
	}
	p, err := planForURLBytes(url)
	if err != nil || p == nil {
		return false, nil
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByURL(string(url))
	if err != nil {
		return true, nil // resolved above; cannot happen
	}
	var st structpb.Struct
	if err := proto.Unmarshal(value, &st); err != nil {
		return false, err
	}
	js, err := protojson.Marshal(&st)
	if err != nil {
		return true, nil
	}
	m := mt.New().Interface()
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(js, m); err != nil {
		return true, nil
	}
	wire, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		return true, nil
	}
	return p.scan(wire, depth+1)
}
