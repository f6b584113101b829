package wire

import (
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/mem"
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
	into.buf = data.MaterializeToBuffer(mem.DefaultBufferPool())
	into.size = into.buf.Len()
	return nil
}
