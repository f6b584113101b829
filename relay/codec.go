package relay

import (
	"sync"

	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// The relay encodes its responses itself instead of building a
// DiscoveryResponse per stream for gRPC to marshal. A response's bytes are a
// function of what the client held before and holds after (both Merkle
// roots), so every stream of a key that gets the same update gets the same
// bytes: they are encoded once, kept in a small cache, and each stream only
// adds its nonce (protobuf lets a field come last). A thousand Envoys
// catching up on a 1 MB CDS share one 1 MB buffer instead of holding a
// thousand copies while their sends wait on flow control.

// outgoing is a response about to be sent, in protocol-neutral form.
type outgoing struct {
	typeURL string
	// version is the Merkle root of what the client holds once it applies
	// this response (SotW version_info), or of the key's view (Delta
	// system_version_info).
	version string
	upd     []*xds.Resource
	removed []string
	// full is set for a SotW full-state type: the response carries
	// everything the client holds (held), not just upd.
	full  bool
	held  ledger.Tree[*xds.Resource]
	nonce string
	// The Merkle roots that determine the response's bytes: what the
	// client held before (zero for a SotW full-state response, which does
	// not depend on it) and after, and the key's view (Delta); and the
	// view's Order, which every version in it carries.
	from, to, view ledger.Hash
	order          ledger.Order
}

// fullSotW lists what a SotW full-state response carries (nil for other
// responses). It is built only when the body is encoded, once per content,
// not once per stream.
func (o *outgoing) fullSotW() []*xds.Resource {
	if !o.full {
		return nil
	}
	out := make([]*xds.Resource, 0, o.held.Len())
	for e := range o.held.All() {
		if e.Value == nil {
			// Content the relay knows only by hash (resolveClaim takes a
			// claim only with every body): never held in a full state.
			continue
		}
		out = append(out, e.Value)
	}
	return out
}

// wireMessage is a response already encoded: a shared body and the stream's
// own tail (the nonce field).
type wireMessage struct {
	body []byte // shared: never modified
	tail []byte
}

func (w *wireMessage) size() int { return len(w.body) + len(w.tail) }

// codec is the relay server's gRPC codec: wireMessages go out as they are,
// everything else (requests in, passthrough responses out) through the
// standard proto codec.
type codec struct{ proto encoding.CodecV2 }

func newCodec() codec { return codec{proto: encoding.GetCodecV2("proto")} }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if w, ok := v.(*wireMessage); ok {
		// SliceBuffers are not pooled: gRPC's Free leaves the shared body
		// alone.
		return mem.BufferSlice{mem.SliceBuffer(w.body), mem.SliceBuffer(w.tail)}, nil
	}
	return c.proto.Marshal(v)
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	if r, ok := v.(*sotwRequest); ok {
		return unmarshalSotWRequest(data, r)
	}
	return c.proto.Unmarshal(data, v)
}

func (codec) Name() string { return "proto" }

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

// bodyCache keeps recent bodies, bounded in bytes; bodies still on their way
// to clients stay alive through those messages. Safe for concurrent use.
type bodyCache struct {
	mu    sync.Mutex
	m     map[bodyKey][]byte
	bytes int
}

// bodyCacheBytes bounds the cache; it is cleared when full (the working set
// is the few updates in flight).
const bodyCacheBytes = 256 << 20

func (c *bodyCache) get(k bodyKey, encode func() []byte) []byte {
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

// sotw returns o as a SotW DiscoveryResponse: its body from the cache (or
// encoded once, with the relay's control_plane), its nonce its own.
func (c *bodyCache) sotw(o *outgoing, controlPlane []byte) *wireMessage {
	body := c.get(bodyKey{typeURL: o.typeURL, from: o.from, to: o.to, order: o.order}, func() []byte {
		return encodeSotW(o, controlPlane)
	})
	return &wireMessage{body: body, tail: nonceField(fSotWNonce, o.nonce)}
}

// delta returns o as a DeltaDiscoveryResponse, as sotw does.
func (c *bodyCache) delta(o *outgoing, controlPlane []byte) *wireMessage {
	body := c.get(bodyKey{delta: true, typeURL: o.typeURL, from: o.from, to: o.to, view: o.view, order: o.order}, func() []byte {
		return encodeDelta(o, controlPlane)
	})
	return &wireMessage{body: body, tail: nonceField(fDeltaNonce, o.nonce)}
}

// encodeSotW encodes a DiscoveryResponse without its nonce.
func encodeSotW(o *outgoing, controlPlane []byte) []byte {
	res := o.fullSotW()
	if res == nil {
		res = o.upd
	}
	n := len(o.version) + len(o.typeURL) + len(controlPlane) + 16
	for _, r := range res {
		n += len(r.Type) + len(r.Body.GetValue()) + 16
	}
	b := make([]byte, 0, n)
	b = appendString(b, fSotWVersion, o.version)
	for _, r := range res {
		b = appendAny(b, fSotWResources, r)
	}
	b = appendString(b, fSotWTypeURL, o.typeURL)
	b = protowire.AppendTag(b, fSotWControlPlane, protowire.BytesType)
	return protowire.AppendBytes(b, controlPlane)
}

// encodeDelta encodes a DeltaDiscoveryResponse without its nonce.
func encodeDelta(o *outgoing, controlPlane []byte) []byte {
	n := len(o.version) + len(o.typeURL) + len(controlPlane) + 16
	for _, r := range o.upd {
		n += len(r.Name) + len(r.Type) + len(r.Body.GetValue()) + 2*len(r.Hash) + 48
	}
	for _, name := range o.removed {
		n += len(name) + 4
	}
	b := make([]byte, 0, n)
	b = appendString(b, fDeltaVersion, o.version)
	for _, r := range o.upd {
		// envoy.service.discovery.v3.Resource: name, version, resource.
		b = protowire.AppendTag(b, fDeltaResources, protowire.BytesType)
		version := stampedVersion(r.Hash, o.order)
		anyLen := anySize(r)
		size := protowire.SizeTag(fResourceName) + protowire.SizeBytes(len(r.Name)) +
			protowire.SizeTag(fResourceVersion) + protowire.SizeBytes(len(version)) +
			protowire.SizeTag(fResourceBody) + protowire.SizeBytes(anyLen)
		b = protowire.AppendVarint(b, uint64(size))
		b = appendString(b, fResourceName, r.Name)
		b = appendString(b, fResourceVersion, version)
		b = appendAny(b, fResourceBody, r)
	}
	b = appendString(b, fDeltaTypeURL, o.typeURL)
	for _, name := range o.removed {
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
