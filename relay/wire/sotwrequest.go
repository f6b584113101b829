package wire

import (
	"errors"
	"fmt"
	"hash/maphash"
	"unicode/utf8"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// SotWRequest is a SotW DiscoveryRequest as the relay reads it off the
// wire. A SotW Envoy repeats its whole subscription in every request, ACKs
// included: at 5,000 Envoys with a thousand EDS names each, decoding those
// names into strings (and collecting them) was most of the relay's CPU, and
// copying the request to keep them was most of its garbage. So the names
// stay in gRPC's own receive buffer, held (not copied) until Release; their
// digest (ListDigest) tells whether the subscription changed, and only then
// are they decoded.
type SotWRequest struct {
	Req   *discovery.DiscoveryRequest // every field but resource_names
	Names NameList
}

// Release gives the request's buffer back; its names can no longer be
// decoded after it. The handler of the request calls it once done.
func (r *SotWRequest) Release() { r.Names.release() }

// NameList is a request's resource_names, decoded on demand.
type NameList struct {
	count   int
	hasStar bool // one of them is "*"
	// sum is ListDigest of the names, once summed. raw hashes the names'
	// bytes as they came, in their order, when rawKnown (they came
	// together, as Envoy sends them): a client that repeats its list as
	// it sent it matches on raw, and its names are never hashed one by one.
	sum      uint64
	summed   bool
	raw      uint64
	rawKnown bool
	size     int        // the size of the request they came in
	buf      mem.Buffer // the request's bytes, until release; nil for a decoded list
	list     []string   // set when the names are already strings
}

// ListID identifies a name list: ListDigest of its names (order does not
// matter), and, where known, a hash of its bytes as sent (order matters).
// The zero ListID is no list's.
type ListID struct {
	Sum      uint64
	Raw      uint64
	RawKnown bool
}

// Same reports whether the names are the list id identifies: their bytes
// hash to id.Raw (the cheap test, for a client that repeats its list as it
// sent it), else their digest is id.Sum; then id takes their bytes' hash,
// so that the next request that repeats them passes the cheap test. Before
// Release.
func (nl *NameList) Same(id *ListID) bool {
	if nl.rawKnown && id.RawKnown && nl.raw == id.Raw {
		return true
	}
	if nl.Digest() != id.Sum {
		return false
	}
	id.Raw, id.RawKnown = nl.raw, nl.rawKnown
	return true
}

// ID returns the names' ListID. Before Release.
func (nl *NameList) ID() ListID {
	return ListID{Sum: nl.Digest(), Raw: nl.raw, RawKnown: nl.rawKnown}
}

// Len is the number of names.
func (nl *NameList) Len() int { return nl.count }

// Wildcard reports whether one of the names is "*".
func (nl *NameList) Wildcard() bool { return nl.hasStar }

// Digest is the order-independent digest of the names (ListDigest),
// computed on first use. Before Release.
func (nl *NameList) Digest() uint64 {
	if nl.summed {
		return nl.sum
	}
	if nl.buf == nil && nl.count > 0 {
		panic("relay/wire: a request's names read after its Release")
	}
	sum := uint64(nl.count)
	if nl.buf != nil {
		eachName(nl.buf.ReadOnlyData(), func(v []byte) { sum += maphash.Bytes(listSeed, v) })
	}
	nl.sum, nl.summed = sum, true
	return sum
}

// eachName calls fn with the bytes of each resource name in a request that
// parsed once already (unmarshalSotWRequest): the walk cannot fail.
func eachName(b []byte, fn func(v []byte)) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if num == resourceNamesField && typ == protowire.BytesType {
			v, _ := protowire.ConsumeBytes(b[n:])
			fn(v)
		}
		b = b[n+m:]
	}
}

// Size is the size of the request the names came in.
func (nl *NameList) Size() int { return nl.size }

// NamesOf wraps an already decoded list.
func NamesOf(list []string) NameList {
	nl := NameList{count: len(list), sum: ListDigest(list), summed: true, list: list}
	for _, n := range list {
		nl.hasStar = nl.hasStar || n == xds.WildcardName
	}
	return nl
}

var (
	errBadName  = errors.New("relay: resource name is not valid UTF-8")
	errReleased = errors.New("relay: request names read after the request was released")
)

// Decode returns the names as strings.
func (nl *NameList) Decode() ([]string, error) {
	if nl.list != nil || nl.count == 0 {
		return nl.list, nil
	}
	if nl.buf == nil {
		return nil, errReleased
	}
	out := make([]string, 0, nl.count)
	valid := true
	eachName(nl.buf.ReadOnlyData(), func(v []byte) {
		valid = valid && utf8.Valid(v)
		out = append(out, string(v))
	})
	if !valid {
		return nil, errBadName
	}
	nl.list = out
	return out, nil
}

func (nl *NameList) release() {
	if nl.buf != nil {
		nl.buf.Free()
		nl.buf = nil
	}
}

// resourceNamesField is DiscoveryRequest.resource_names, and namesTag its
// tag as encoders write it: field 3, length-delimited, in one byte.
const (
	resourceNamesField = 3
	namesTag           = resourceNamesField<<3 | byte(protowire.BytesType)
)

// unmarshalSotWRequest reads a DiscoveryRequest, keeping resource_names
// raw: data's buffer is held (or, when the request came in several, copied
// into one from gRPC's pool) until into.Release.
func unmarshalSotWRequest(data mem.BufferSlice, into *SotWRequest) error {
	buf := gather(data)
	raw := buf.ReadOnlyData()
	nl := NameList{size: len(raw)}
	var rest []byte // the other fields, for proto.Unmarshal
	// The names' span [first, end), while they come one after another.
	first, end, together := -1, -1, true
	bad := func(code int) error {
		buf.Free()
		return fmt.Errorf("relay: bad request: %w", protowire.ParseError(code))
	}
	for b := raw; len(b) > 0; {
		if b[0] == namesTag {
			// A name: the tag is one byte, its length a varint; read
			// inline, as this loop reads a thousand of them per ACK.
			l, n := uint64(0), 0
			if len(b) > 1 && b[1] < 0x80 {
				l, n = uint64(b[1]), 1
			} else if l, n = protowire.ConsumeVarint(b[1:]); n < 0 {
				return bad(n)
			}
			if l > uint64(len(b)-1-n) {
				return bad(-1) // protowire's "unexpected end of input"
			}
			at, size := len(raw)-len(b), 1+n+int(l)
			switch {
			case first < 0:
				first = at
			case at != end:
				together = false
			}
			end = at + size
			nl.count++
			nl.hasStar = nl.hasStar || (l == 1 && b[1+n] == '*')
			b = b[size:]
			continue
		}
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return bad(n)
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return bad(m)
		}
		if num == resourceNamesField && typ == protowire.BytesType {
			// The same tag in a longer form: not how anyone encodes it.
			together = false
			nl.count++
			v, _ := protowire.ConsumeBytes(b[n:])
			nl.hasStar = nl.hasStar || string(v) == xds.WildcardName
		} else {
			rest = append(rest, b[:n+m]...)
		}
		b = b[n+m:]
	}
	if together && first >= 0 {
		nl.raw, nl.rawKnown = maphash.Bytes(listSeed, raw[first:end]), true
	}
	into.Req = new(discovery.DiscoveryRequest)
	if err := proto.Unmarshal(rest, into.Req); err != nil {
		buf.Free()
		return fmt.Errorf("relay: bad request: %w", err)
	}
	if nl.count > 0 {
		nl.buf = buf
	} else {
		buf.Free()
	}
	into.Names = nl
	return nil
}

var listSeed = maphash.MakeSeed()

// ListDigest is an order-independent digest of a list of names and its
// length. A SotW client repeats its whole subscription in every request,
// ACKs included; comparing digests tells, without sorting thousands of
// names, that nothing changed.
func ListDigest(names []string) uint64 {
	sum := uint64(len(names))
	for _, n := range names {
		sum += maphash.String(listSeed, n)
	}
	return sum
}
