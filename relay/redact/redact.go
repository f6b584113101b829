// Package redact hides what a config dump must not show: every field Envoy
// marks sensitive, wherever in a resource it is, as Envoy's own
// /config_dump does. Which fields those are, relay/sensitive says: the
// snapshot store seals the same ones at rest. The relay's config dumps (the
// admin API's GetConfigDump, istiod's debug answers) pass every resource
// through Any.
package redact

import (
	"fmt"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	sensfield "github.com/meshrelay/meshrelay/relay/sensitive"
)

// redacted replaces what a config dump must not show.
const redacted = "[redacted]"

// Any returns a copy of a resource with every field Envoy marks
// sensitive (udpa.annotations.sensitive: private keys, passwords, session
// ticket keys, generic secrets) replaced by "[redacted]", as Envoy's own
// /config_dump does: a string or bytes field is replaced, a number, bool
// or enum cleared; in a sensitive message, every such field within. Any
// fields are unpacked and redacted too, and fields unknown to this binary
// dropped. A resource whose type this binary does not know, or that
// does not decode, cannot be checked and is refused.
func Any(a *anypb.Any) (*anypb.Any, error) {
	m, err := a.UnmarshalNew()
	if err != nil {
		return nil, fmt.Errorf("redact %s: %w", a.GetTypeUrl(), err)
	}
	if err := redactMessage(m.ProtoReflect(), false, 0); err != nil {
		return nil, fmt.Errorf("redact %s: %w", a.GetTypeUrl(), err)
	}
	return anypb.New(m)
}

// maxRedactDepth bounds the nesting redactMessage follows (Any within Any
// within …): protobuf's own decoder stops at 10,000.
const maxRedactDepth = 100

func redactMessage(m protoreflect.Message, sensitive bool, depth int) error {
	if depth > maxRedactDepth {
		return fmt.Errorf("nested deeper than %d", maxRedactDepth)
	}
	if a, ok := m.Interface().(*anypb.Any); ok {
		return redactNestedAny(a, sensitive, depth)
	}
	// Fields this binary's protos do not know could be sensitive in a
	// newer Envoy's: they are dropped, not shown.
	m.SetUnknown(nil)
	var (
		err     error
		cleared []protoreflect.FieldDescriptor
	)
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		s := sensitive || sensfield.Field(fd)
		valueKind := fd.Kind()
		if fd.IsMap() {
			valueKind = fd.MapValue().Kind()
		}
		switch valueKind {
		case protoreflect.MessageKind, protoreflect.GroupKind, protoreflect.StringKind, protoreflect.BytesKind:
		default:
			// A number, a bool or an enum in a sensitive field: gone.
			if s {
				cleared = append(cleared, fd)
			}
			return true
		}
		switch {
		case fd.IsList():
			l := v.List()
			for i := range l.Len() {
				if nv, ok := redactValue(fd, l.Get(i), s, depth, &err); ok {
					l.Set(i, nv)
				}
			}
		case fd.IsMap():
			mv := v.Map()
			vd := fd.MapValue()
			mv.Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
				if nv, ok := redactValue(vd, v, s, depth, &err); ok {
					mv.Set(k, nv)
				}
				return err == nil
			})
		default:
			if nv, ok := redactValue(fd, v, s, depth, &err); ok {
				m.Set(fd, nv)
			}
		}
		return err == nil
	})
	for _, fd := range cleared {
		m.Clear(fd)
	}
	return err
}

// redactValue redacts one value of field fd: it returns the value to set
// in its place, if it changed; messages are redacted in place.
func redactValue(fd protoreflect.FieldDescriptor, v protoreflect.Value, sensitive bool, depth int, err *error) (protoreflect.Value, bool) {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		if e := redactMessage(v.Message(), sensitive, depth+1); e != nil && *err == nil {
			*err = e
		}
	case protoreflect.StringKind:
		if sensitive {
			return protoreflect.ValueOfString(redacted), true
		}
	case protoreflect.BytesKind:
		if sensitive {
			return protoreflect.ValueOfBytes([]byte(redacted)), true
		}
	}
	return protoreflect.Value{}, false
}

// redactNestedAny redacts what an Any holds, in place. An Any this binary
// cannot decode (a type it does not know, an Istio filter's config say, or
// bytes that do not parse) cannot be checked for sensitive fields: it is
// replaced by a StringValue that names its type and size.
func redactNestedAny(a *anypb.Any, sensitive bool, depth int) error {
	m, err := a.UnmarshalNew()
	if err != nil {
		why := "not decoded"
		if _, ferr := protoregistry.GlobalTypes.FindMessageByURL(a.GetTypeUrl()); ferr != nil {
			why = "type unknown to the relay"
		}
		note, err := anypb.New(wrapperspb.String(fmt.Sprintf("%s: %d bytes not shown (%s)", a.GetTypeUrl(), len(a.GetValue()), why)))
		if err != nil {
			return err
		}
		a.TypeUrl, a.Value = note.TypeUrl, note.Value
		return nil
	}
	if err := redactMessage(m.ProtoReflect(), sensitive, depth+1); err != nil {
		return err
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		return err
	}
	a.Value = b
	return nil
}
