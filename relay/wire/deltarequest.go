package wire

import (
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// DeltaRequest is a Delta DeltaDiscoveryRequest as it came off the wire,
// not yet decoded: a reconnect's initial_resource_versions decodes into a
// map several times its size, so the relay takes the request's bytes of
// its budget first (relay.requestBudget), then decodes.
type DeltaRequest struct {
	buf  mem.Buffer
	size int
}

// Size is the request's size on the wire.
func (r *DeltaRequest) Size() int { return r.size }

// Decode decodes the request and gives its buffer back: call it once.
func (r *DeltaRequest) Decode() (*discovery.DeltaDiscoveryRequest, error) {
	if r.buf == nil {
		return nil, errReleased
	}
	req := new(discovery.DeltaDiscoveryRequest)
	err := proto.Unmarshal(r.buf.ReadOnlyData(), req)
	r.Release()
	if err != nil {
		return nil, err
	}
	return req, nil
}

// Release gives the request's buffer back, decoded or not.
func (r *DeltaRequest) Release() {
	if r.buf != nil {
		r.buf.Free()
		r.buf = nil
	}
}

func unmarshalDeltaRequest(data mem.BufferSlice, into *DeltaRequest) error {
	into.buf = gather(data)
	into.size = into.buf.Len()
	return nil
}

// Delta request field numbers whose entries are names.
const (
	fDeltaSubscribe, fDeltaUnsubscribe, fDeltaInitialVersions = 3, 4, 5
)

// Names counts the names the request subscribes, unsubscribes and
// declares, without decoding it: a request of a million names is refused
// for a scan of its bytes, not a million strings. A request that does not
// parse counts 0 (Decode says why).
func (r *DeltaRequest) Names() int {
	if r.buf == nil {
		return 0
	}
	n := 0
	for b := r.buf.ReadOnlyData(); len(b) > 0; {
		num, typ, l := protowire.ConsumeTag(b)
		if l < 0 {
			return 0
		}
		b = b[l:]
		l = protowire.ConsumeFieldValue(num, typ, b)
		if l < 0 {
			return 0
		}
		b = b[l:]
		switch num {
		case fDeltaSubscribe, fDeltaUnsubscribe, fDeltaInitialVersions:
			if typ == protowire.BytesType { // else an unknown field to proto
				n++
			}
		}
	}
	return n
}
