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
	"encoding/binary"
	"encoding/hex"
	"sync"
	"time"
	"unsafe"
	"weak"

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
	// Carried is the hash of the resource a Delta response that only
	// removes sends again unchanged to carry its Order (zero if none): the
	// one resource of a response that From and To do not determine, so the
	// bytes depend on it too.
	Carried ledger.Hash
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

// Message is a response already encoded: the stream's own fields (its
// nonce, and a SotW version_info), then the shared body (protobuf takes
// fields in any order). The body is never copied nor boxed per stream: it
// is the cached entry's, already a mem.Buffer, so a message costs three
// small allocations whatever its size (TestMessageAllocations).
type Message struct {
	parts [2]mem.Buffer // own fields, body
	size  int
}

func newMessage(own []byte, bd body) *Message {
	return &Message{parts: [2]mem.Buffer{mem.SliceBuffer(own), bd.buf}, size: len(own) + len(bd.b)}
}

func (w *Message) Size() int { return w.size }

// Codec is the relay's gRPC codec, on its server and on its streams to
// keys' sources: Messages go out as they are, SotW requests and the
// sources' responses (DeltaIn, SotWIn) come in read lazily, and
// everything else through the standard proto codec.
type Codec struct{ proto encoding.CodecV2 }

func NewCodec() Codec { return Codec{proto: encoding.GetCodecV2("proto")} }

func (c Codec) Marshal(v any) (mem.BufferSlice, error) {
	if w, ok := v.(*Message); ok {
		// SliceBuffers are not pooled: gRPC's Free leaves the shared body
		// alone.
		return w.parts[:], nil
	}
	return c.proto.Marshal(v)
}

func (c Codec) Unmarshal(data mem.BufferSlice, v any) error {
	switch m := v.(type) {
	case *SotWRequest:
		return unmarshalSotWRequest(data, m)
	case *DeltaRequest:
		return unmarshalDeltaRequest(data, m)
	case *DeltaIn:
		return unmarshalDeltaIn(data, m)
	case *SotWIn:
		return unmarshalSotWIn(data, m)
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
// (its system_version_info). Every version in a Delta body carries the
// view's Order; a SotW body has none (its one version, which does, is the
// message's head), so the keys that hold the same content, each with views
// of its own Order, share one SotW body.
type bodyKey struct {
	delta    bool
	typeURL  string
	from, to ledger.Hash
	view     ledger.Hash
	order    ledger.Order
	carried  ledger.Hash
}

// Bodies keeps recent bodies, bounded in bytes and in age: a body is
// encoded once however many streams want it at once (the others wait for
// it), and let go once unused for bodyAge to 2·bodyAge; bodies still on
// their way to clients stay alive through those messages. A body asked
// for once is held only through its messages (weakly): most are wanted by
// the many streams of a key, or of keys of the same content, but a
// per-node key's Delta body (its versions carry the key's Order) is its
// one stream's alone, and a thousand such keys held a thousand bodies for
// a minute. Asked for again, a body is kept (encoded again first if its
// messages were all gone). Safe for concurrent use; the zero value is
// ready.
type Bodies struct {
	mu        sync.Mutex
	cur, old  map[bodyKey]*bodyEntry
	bytes     int // of the bodies held (strongly) by cur and old
	rotatedAt time.Time
	now       func() time.Time // nil: time.Now (tests set it)
}

// bodyEntry is a body kept or being encoded. Its fields are read and
// written under Bodies.mu.
type bodyEntry struct {
	done chan struct{} // closed once the first encoding is done
	// body, while held; nil while held weakly (asked for once), through
	// weak, its first byte, and n, its length.
	body body
	weak weak.Pointer[byte]
	n    int
	asks int // how many times the body was asked for
}

// body is an encoded body, and the same as the message's part.
type body struct {
	b   []byte
	buf mem.Buffer
}

func newBody(b []byte) body { return body{b: b, buf: mem.SliceBuffer(b)} }

const (
	// bodyCacheBytes bounds the cache; past it the older bodies go, then
	// all (the working set is the few updates in flight).
	bodyCacheBytes = 256 << 20
	// bodyAge: a body unused for this long is let go at the next
	// rotation, one unused for twice as long is gone.
	bodyAge = 30 * time.Second
)

func (c *Bodies) get(k bodyKey, encode func() []byte) body {
	c.mu.Lock()
	c.rotate()
	e, ok := c.cur[k]
	if !ok {
		if e, ok = c.old[k]; ok {
			c.cur[k] = e // used again: kept another period
			delete(c.old, k)
		}
	}
	if !ok {
		e = &bodyEntry{done: make(chan struct{}), asks: 1}
		c.cur[k] = e
		c.mu.Unlock()
		bd := newBody(encode())
		c.mu.Lock()
		defer c.mu.Unlock()
		close(e.done)
		if e.asks > 1 || len(bd.b) == 0 {
			c.hold(k, e, bd) // others waited for it
		} else {
			e.weak, e.n = weak.Make(&bd.b[0]), len(bd.b)
		}
		return bd
	}
	e.asks++
	c.mu.Unlock()
	<-e.done
	c.mu.Lock()
	if e.body.b != nil {
		defer c.mu.Unlock()
		return e.body
	}
	if p := e.weak.Value(); p != nil { // asked for again: kept
		bd := newBody(unsafe.Slice(p, e.n))
		c.hold(k, e, bd)
		c.mu.Unlock()
		return bd
	}
	c.mu.Unlock()
	bd := newBody(encode()) // its messages are gone, and it with them
	c.mu.Lock()
	defer c.mu.Unlock()
	if e.body.b == nil {
		c.hold(k, e, bd)
	}
	return bd
}

// hold makes bd e's body, held (and counted, within the bound) if e is
// still k's. The caller holds c.mu.
func (c *Bodies) hold(k bodyKey, e *bodyEntry, bd body) {
	e.body, e.weak = bd, weak.Pointer[byte]{}
	if c.cur[k] != e && c.old[k] != e {
		return // let go meanwhile: its waiters have it all the same
	}
	c.bytes += len(bd.b)
	if c.bytes > bodyCacheBytes {
		c.old, c.bytes = nil, c.sizeOf(c.cur)
	}
	if c.bytes > bodyCacheBytes {
		c.cur, c.bytes = make(map[bodyKey]*bodyEntry), 0
	}
}

// rotate starts a new period if the current one is over: what was not
// used in the last one goes. The caller holds c.mu.
func (c *Bodies) rotate() {
	now := time.Now
	if c.now != nil {
		now = c.now
	}
	t := now()
	if c.cur == nil {
		c.cur, c.rotatedAt = make(map[bodyKey]*bodyEntry), t
		return
	}
	if t.Sub(c.rotatedAt) < bodyAge {
		return
	}
	c.old, c.cur, c.rotatedAt = c.cur, make(map[bodyKey]*bodyEntry), t
	c.bytes = c.sizeOf(c.old)
}

// sizeOf counts the bodies m holds. The caller holds c.mu.
func (c *Bodies) sizeOf(m map[bodyKey]*bodyEntry) int {
	n := 0
	for _, e := range m {
		n += len(e.body.b) // none while encoding or held weakly
	}
	return n
}

// waiting reports whether k is being encoded now (1) or not (0); for tests.
func (c *Bodies) waiting(k bodyKey) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.cur[k]; ok {
		select {
		case <-e.done:
		default:
			return 1
		}
	}
	return 0
}

// Len returns the number of bodies held (not counting those held weakly,
// nor being encoded), and their bytes.
func (c *Bodies) Len() (n, bytes int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range []map[bodyKey]*bodyEntry{c.cur, c.old} {
		for _, e := range m {
			if e.body.b != nil {
				n++
			}
		}
	}
	return n, c.bytes
}

// SotW returns o as a SotW DiscoveryResponse: its body (resources,
// type_url, control_plane) from the cache, or encoded once, and its
// version_info and nonce its own.
func (c *Bodies) SotW(o *Response, controlPlane []byte) *Message {
	body := c.get(bodyKey{typeURL: o.TypeURL, from: o.From, to: o.To}, func() []byte {
		return encodeSotW(o, controlPlane)
	})
	own := make([]byte, 0, len(o.Version)+len(o.Nonce)+2*binary.MaxVarintLen32)
	own = appendString(own, fSotWVersion, o.Version)
	return newMessage(appendString(own, fSotWNonce, o.Nonce), body)
}

// Delta returns o as a DeltaDiscoveryResponse, as SotW does.
func (c *Bodies) Delta(o *Response, controlPlane []byte) *Message {
	body := c.get(bodyKey{delta: true, typeURL: o.TypeURL, from: o.From, to: o.To, view: o.View, order: o.Order, carried: o.Carried}, func() []byte {
		return encodeDelta(o, controlPlane)
	})
	return newMessage(nonceField(fDeltaNonce, o.Nonce), body)
}

// encodeSotW encodes a DiscoveryResponse without its version_info and
// nonce.
func encodeSotW(o *Response, controlPlane []byte) []byte {
	res := o.FullSotW()
	if res == nil {
		res = o.Updated
	}
	n := len(o.TypeURL) + len(controlPlane) + 16
	for _, r := range res {
		n += len(r.Type) + len(r.Body.GetValue()) + 16
	}
	b := make([]byte, 0, n)
	for _, r := range res {
		b = appendAny(b, fSotWResources, r)
	}
	b = appendString(b, fSotWTypeURL, o.TypeURL)
	b = protowire.AppendTag(b, fSotWControlPlane, protowire.BytesType)
	return protowire.AppendBytes(b, controlPlane)
}

// encodeDelta encodes a DeltaDiscoveryResponse without its nonce, into a
// buffer of its exact size. Every resource's version is its hash and the
// view's Order (Version), written in place: a 3,000-cluster body was
// sized short by its versions, grown (a copy of it all) and built from
// ten small allocations per resource.
func encodeDelta(o *Response, controlPlane []byte) []byte {
	order := o.Order.String()
	versionLen := hex.EncodedLen(len(ledger.Hash{})) + 1 + len(order)
	n := sizeString(fDeltaVersion, o.Version) + sizeString(fDeltaTypeURL, o.TypeURL) +
		protowire.SizeTag(fDeltaCP) + protowire.SizeBytes(len(controlPlane))
	for _, r := range o.Updated {
		n += protowire.SizeTag(fDeltaResources) + protowire.SizeBytes(resourceSize(r, versionLen))
	}
	for _, name := range o.Removed {
		n += sizeString(fDeltaRemoved, name)
	}
	b := make([]byte, 0, n)
	b = appendString(b, fDeltaVersion, o.Version)
	for _, r := range o.Updated {
		// envoy.service.discovery.v3.Resource: name, version, resource.
		b = protowire.AppendTag(b, fDeltaResources, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(resourceSize(r, versionLen)))
		b = appendString(b, fResourceName, r.Name)
		// Version(r.Hash, o.Order), never empty.
		b = protowire.AppendTag(b, fResourceVersion, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(versionLen))
		b = hex.AppendEncode(b, r.Hash[:])
		b = append(append(b, '@'), order...)
		b = appendAny(b, fResourceBody, r)
	}
	b = appendString(b, fDeltaTypeURL, o.TypeURL)
	for _, name := range o.Removed {
		b = appendString(b, fDeltaRemoved, name)
	}
	b = protowire.AppendTag(b, fDeltaCP, protowire.BytesType)
	return protowire.AppendBytes(b, controlPlane)
}

// resourceSize is the encoded size of r as a Delta Resource whose version
// is versionLen bytes.
func resourceSize(r *xds.Resource, versionLen int) int {
	return sizeString(fResourceName, r.Name) +
		protowire.SizeTag(fResourceVersion) + protowire.SizeBytes(versionLen) +
		protowire.SizeTag(fResourceBody) + protowire.SizeBytes(anySize(r))
}

// sizeString is the encoded size of a string field as appendString writes
// it.
func sizeString(num protowire.Number, s string) int {
	if s == "" {
		return 0
	}
	return protowire.SizeTag(num) + protowire.SizeBytes(len(s))
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
