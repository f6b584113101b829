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
// names into strings (and collecting them) was most of the relay's CPU. So
// the names stay raw; their digest (ListDigest) tells whether the
// subscription changed, and only then are they decoded.
type SotWRequest struct {
	Req   *discovery.DiscoveryRequest // every field but resource_names
	Names NameList
}

// NameList is a request's resource_names, decoded on demand.
type NameList struct {
	count   int
	hasStar bool   // one of them is "*"
	sum     uint64 // ListDigest of the names
	raw     []byte // the request's bytes; names are at spans
	spans   [][2]int32
	list    []string // set when the names are already strings
}

// Len is the number of names.
func (nl *NameList) Len() int { return nl.count }

// Wildcard reports whether one of the names is "*".
func (nl *NameList) Wildcard() bool { return nl.hasStar }

// Digest is the order-independent digest of the names (ListDigest).
func (nl *NameList) Digest() uint64 { return nl.sum }

// Size is the size of the request the names came in.
func (nl *NameList) Size() int { return len(nl.raw) }

// NamesOf wraps an already decoded list.
func NamesOf(list []string) NameList {
	nl := NameList{count: len(list), sum: ListDigest(list), list: list}
	for _, n := range list {
		nl.hasStar = nl.hasStar || n == xds.WildcardName
	}
	return nl
}

var errBadName = errors.New("relay: resource name is not valid UTF-8")

// Decode returns the names as strings.
func (nl *NameList) Decode() ([]string, error) {
	if nl.list != nil || nl.count == 0 {
		return nl.list, nil
	}
	out := make([]string, len(nl.spans))
	for i, sp := range nl.spans {
		b := nl.raw[sp[0]:sp[1]]
		if !utf8.Valid(b) {
			return nil, errBadName
		}
		out[i] = string(b)
	}
	nl.list = out
	return out, nil
}

// resourceNamesField is DiscoveryRequest.resource_names.
const resourceNamesField = 3

// unmarshalSotWRequest reads a DiscoveryRequest, keeping resource_names raw.
func unmarshalSotWRequest(data mem.BufferSlice, into *SotWRequest) error {
	raw := data.Materialize() // a copy: data is freed when we return
	var rest []byte           // the other fields, for proto.Unmarshal
	nl := NameList{raw: raw}
	for b := raw; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return fmt.Errorf("relay: bad request: %w", protowire.ParseError(n))
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return fmt.Errorf("relay: bad request: %w", protowire.ParseError(m))
		}
		field := b[:n+m]
		if num == resourceNamesField && typ == protowire.BytesType {
			v, _ := protowire.ConsumeBytes(b[n:])
			start := int32(len(raw) - len(b) + n + (m - len(v)))
			nl.spans = append(nl.spans, [2]int32{start, start + int32(len(v))})
			nl.sum += maphash.Bytes(listSeed, v)
			nl.hasStar = nl.hasStar || string(v) == xds.WildcardName
		} else {
			rest = append(rest, field...)
		}
		b = b[n+m:]
	}
	nl.count = len(nl.spans)
	nl.sum += uint64(nl.count)
	into.Req = new(discovery.DiscoveryRequest)
	if err := proto.Unmarshal(rest, into.Req); err != nil {
		return fmt.Errorf("relay: bad request: %w", err)
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
