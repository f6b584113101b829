// Package wire is the relay's xDS on the wire: the gRPC Codec, responses
// encoded once per content (Bodies), SotW requests read without decoding
// their names (SotWRequest), and the version form every relay puts on the
// wire (Version, ParseVersion).
//
// The relay encodes its responses itself instead of building a
// DiscoveryResponse per stream for gRPC to marshal. A response's bytes are a
// function of what the client held before and holds after (both Merkle
// roots), so every stream of a key that gets the same update gets the same
// bytes: they are encoded once, kept in a small cache, and each stream only
// adds its nonce (protobuf lets a field come last). A thousand Envoys
// catching up on a 1 MB CDS share one 1 MB buffer instead of holding a
// thousand copies while their sends wait on flow control.
package wire

import (
	"sync"

	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Response is a response about to be sent, in protocol-neutral form.
type Response struct {
	TypeURL string
	// Version is the Merkle root of what the client holds once it applies
	// this response (SotW version_info), or of the key's view (Delta
	// system_version_info).
	Version string
	Updated []*xds.Resource
	Removed []string
	// Full is set for a SotW full-state type: the response carries
	// everything the client holds (Held), not just Updated.
	Full  bool
	Held  ledger.Tree[*xds.Resource]
	Nonce string
	// The Merkle roots that determine the response's bytes: what the
	// client held before (zero for a SotW full-state response, which does
	// not depend on it) and after, and the key's view (Delta); and the
	// view's Order, which every version in it carries.
	From, To, View ledger.Hash
	Order          ledger.Order
}

// FullSotW lists what a SotW full-state response carries (nil for other
// responses). It is built only when the body is encoded, once per content,
// not once per stream.
func (o *Response) FullSotW() []*xds.Resource {
	if !o.Full {
		return nil
	}
	out := make([]*xds.Resource, 0, o.Held.Len())
	for e := range o.Held.All() {
		if e.Value == nil {
			// Content the relay knows only by hash (resolveClaim takes a
			// claim only with every body): never held in a full state.
			continue
		}
		out = append(out, e.Value)
	}
	return out
}

// Message is a response already encoded: a shared body and the stream's
// own tail (the nonce field).
type Message struct {
	body []byte // shared: never modified
	tail []byte
}

func (w *Message) Size() int { return len(w.body) + len(w.tail) }

// Codec is the relay server's gRPC codec: Messages go out as they are,
// everything else (requests in, passthrough responses out) through the
// standard proto codec.
type Codec struct{ proto encoding.CodecV2 }

func NewCodec() Codec { return Codec{proto: encoding.GetCodecV2("proto")} }

func (c Codec) Marshal(v any) (mem.BufferSlice, error) {
	if w, ok := v.(*Message); ok {
		// SliceBuffers are not pooled: gRPC's Free leaves the shared body
		// alone.
		return mem.BufferSlice{mem.SliceBuffer(w.body), mem.SliceBuffer(w.tail)}, nil
	}
	return c.proto.Marshal(v)
}

func (c Codec) Unmarshal(data mem.BufferSlice, v any) error {
	if r, ok := v.(*SotWRequest); ok {
		return unmarshalSotWRequest(data, r)
	}
	return c.proto.Unmarshal(data, v)
}

func (Codec) Name() string { return "proto" }

// Field numbers of envoy.service.discovery.v3 messages.
const (
	fSotWVersion, fSotWResources, fSotWTypeURL, fSotWNonce, fSotWControlPlane           = 1, 2, 4, 5, 6
	fDeltaVersion, fDeltaResources, fDeltaTypeURL, fDeltaNonce, fDeltaRemoved, fDeltaCP = 1, 2, 4, 5, 6, 7
	fResourceVersion, fResourceBody, fResourceName                                      = 1, 2, 3
	fAnyTypeURL, fAnyValue                                                              = 1, 2
)

// bodyKey identifies a response body: the protocol, the type, and the
// Merkle roots that determine it. A SotW full-state body is determined by
// what the client holds after (to); a SotW partial or a Delta body by what it
// held before and after (the difference), Delta's also by the view's root
// (its system_version_info). Every version in it carries the view's Order.
type bodyKey struct {
	delta    bool
	typeURL  string
	from, to ledger.Hash
	view     ledger.Hash
	order    ledger.Order
}

// Bodies keeps recent bodies, bounded in bytes; bodies still on their way
// to clients stay alive through those messages. Safe for concurrent use.
type Bodies struct {
	mu    sync.Mutex
	m     map[bodyKey][]byte
	bytes int
}

// bodyCacheBytes bounds the cache; it is cleared when full (the working set
// is the few updates in flight).
const bodyCacheBytes = 256 << 20

func (c *Bodies) get(k bodyKey, encode func() []byte) []byte {
	c.mu.Lock()
	b, ok := c.m[k]
	c.mu.Unlock()
	if ok {
		return b
	}
	b = encode()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil || c.bytes+len(b) > bodyCacheBytes {
		c.m, c.bytes = make(map[bodyKey][]byte), 0
	}
	if have, ok := c.m[k]; ok {
		return have
	}
	c.m[k] = b
	c.bytes += len(b)
	return b
}

// SotW returns o as a SotW DiscoveryResponse: its body from the cache (or
// encoded once, with the relay's control_plane), its nonce its own.
func (c *Bodies) SotW(o *Response, controlPlane []byte) *Message {
	body := c.get(bodyKey{typeURL: o.TypeURL, from: o.From, to: o.To, order: o.Order}, func() []byte {
		return encodeSotW(o, controlPlane)
	})
	return &Message{body: body, tail: nonceField(fSotWNonce, o.Nonce)}
}

// Delta returns o as a DeltaDiscoveryResponse, as SotW does.
func (c *Bodies) Delta(o *Response, controlPlane []byte) *Message {
	body := c.get(bodyKey{delta: true, typeURL: o.TypeURL, from: o.From, to: o.To, view: o.View, order: o.Order}, func() []byte {
		return encodeDelta(o, controlPlane)
	})
	return &Message{body: body, tail: nonceField(fDeltaNonce, o.Nonce)}
}

// encodeSotW encodes a DiscoveryResponse without its nonce.
func encodeSotW(o *Response, controlPlane []byte) []byte {
	res := o.FullSotW()
	if res == nil {
		res = o.Updated
	}
	n := len(o.Version) + len(o.TypeURL) + len(controlPlane) + 16
	for _, r := range res {
		n += len(r.Type) + len(r.Body.GetValue()) + 16
	}
	b := make([]byte, 0, n)
	b = appendString(b, fSotWVersion, o.Version)
	for _, r := range res {
		b = appendAny(b, fSotWResources, r)
	}
	b = appendString(b, fSotWTypeURL, o.TypeURL)
	b = protowire.AppendTag(b, fSotWControlPlane, protowire.BytesType)
	return protowire.AppendBytes(b, controlPlane)
}

// encodeDelta encodes a DeltaDiscoveryResponse without its nonce.
func encodeDelta(o *Response, controlPlane []byte) []byte {
	n := len(o.Version) + len(o.TypeURL) + len(controlPlane) + 16
	for _, r := range o.Updated {
		n += len(r.Name) + len(r.Type) + len(r.Body.GetValue()) + 2*len(r.Hash) + 48
	}
	for _, name := range o.Removed {
		n += len(name) + 4
	}
	b := make([]byte, 0, n)
	b = appendString(b, fDeltaVersion, o.Version)
	for _, r := range o.Updated {
		// envoy.service.discovery.v3.Resource: name, version, resource.
		b = protowire.AppendTag(b, fDeltaResources, protowire.BytesType)
		version := Version(r.Hash, o.Order)
		anyLen := anySize(r)
		size := protowire.SizeTag(fResourceName) + protowire.SizeBytes(len(r.Name)) +
			protowire.SizeTag(fResourceVersion) + protowire.SizeBytes(len(version)) +
			protowire.SizeTag(fResourceBody) + protowire.SizeBytes(anyLen)
		b = protowire.AppendVarint(b, uint64(size))
		b = appendString(b, fResourceName, r.Name)
		b = appendString(b, fResourceVersion, version)
		b = appendAny(b, fResourceBody, r)
	}
	b = appendString(b, fDeltaTypeURL, o.TypeURL)
	for _, name := range o.Removed {
		b = appendString(b, fDeltaRemoved, name)
	}
	b = protowire.AppendTag(b, fDeltaCP, protowire.BytesType)
	return protowire.AppendBytes(b, controlPlane)
}

// anySize is the encoded size of a resource's google.protobuf.Any.
func anySize(r *xds.Resource) int {
	return protowire.SizeTag(fAnyTypeURL) + protowire.SizeBytes(len(r.Type)) +
		protowire.SizeTag(fAnyValue) + protowire.SizeBytes(len(r.Body.GetValue()))
}

// appendAny appends r's body as a google.protobuf.Any in field num.
func appendAny(b []byte, num protowire.Number, r *xds.Resource) []byte {
	b = protowire.AppendTag(b, num, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(anySize(r)))
	b = appendString(b, fAnyTypeURL, r.Type)
	b = protowire.AppendTag(b, fAnyValue, protowire.BytesType)
	return protowire.AppendBytes(b, r.Body.GetValue())
}

// appendString appends a string field, omitted when empty as proto3 does.
func appendString(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendString(b, s)
}

// nonceField encodes a response's nonce, the part each stream adds.
func nonceField(num protowire.Number, nonce string) []byte {
	return appendString(make([]byte, 0, len(nonce)+2), num, nonce)
}
