package relay

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// The push path without the network: streams of one key, each in the
// state a synced Envoy's stream is in, and one endpoint change of a
// 1,000-cluster view pushed to every one of them and ACKed, as the stream
// goroutines do it (sync, the body encoded as the server would send it, the
// ACK handled). An op is one change reaching every stream; ns/envoy is the
// relay's CPU per Envoy per change (the issue 17 target: 25 µs).

const (
	benchStreams  = 1000
	benchClusters = 1000
)

func BenchmarkPush(b *testing.B) {
	// What a relay does, without the tests' check of its shortcuts.
	defer func(check bool) { checkWhole = check }(checkWhole)
	checkWhole = false
	for _, delta := range []bool{false, true} {
		b.Run(protocolName(delta), func(b *testing.B) {
			pb := newPushBench(b, delta)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				pb.change(b, i)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchStreams), "ns/envoy")
			b.ReportMetric(float64(pb.bytes)/float64(b.N*benchStreams), "B/envoy")
		})
	}
}

// pushBench is a relay's key with benchStreams synced streams.
type pushBench struct {
	r       *Relay
	k       *keyState
	delta   bool
	streams []*stream
	nonces  []string // the latest response's nonce, by stream
	names   []string // the EDS names every stream subscribes to
	bytes   int      // sent by the benchmark's changes
	counted bool
	acks    map[string][]byte // ackNames
}

func newPushBench(b *testing.B, delta bool) *pushBench {
	b.Helper()
	r := newTestRelay(b)
	r.ctx, r.cancel = context.WithCancel(context.Background())
	b.Cleanup(r.cancel)
	r.srv.start(r.ctx, nil)
	pb := &pushBench{r: r, delta: delta, nonces: make([]string, benchStreams)}
	var cs, es []types.Resource
	for c := range benchClusters {
		name := "c" + strconv.Itoa(c)
		pb.names = append(pb.names, name)
		cs, es = append(cs, mkCluster(name)), append(es, mkCLA(name, 9000))
	}
	pb.k = newKeyState(r.cache, "bench")
	pb.publish(b, xds.TypeCluster, cs...)
	pb.publish(b, xds.TypeEndpoint, es...)
	codec := wire.NewCodec()
	for i := range benchStreams {
		s := r.srv.newStream(context.Background(), delta, portPlain)
		i := i
		s.send = func(o *wire.Response) error {
			// The message as the server hands it to gRPC (wire.Codec).
			m := r.srv.bodies.SotW
			if delta {
				m = r.srv.bodies.Delta
			}
			msg := m(o, r.srv.controlPlaneWire)
			if _, err := codec.Marshal(msg); err != nil {
				return err
			}
			size := msg.Size()
			if pb.counted {
				pb.bytes += size
			}
			pb.nonces[i] = o.Nonce
			return nil
		}
		// Attached as attach does it, without a feed (nothing upstream:
		// the benchmark publishes the views).
		s.node = &core.Node{Id: fmt.Sprintf("sidecar~10.0.%d.%d~pod-%d.ns~ns.svc.cluster.local", i/256, i%256, i), Cluster: "bench"}
		s.key = pb.k
		s.led = r.ledger.Connect(s.node.GetId(), string(pb.k.key), time.Now())
		pb.k.join(s)
		pb.request(b, s, i, xds.TypeCluster, nil)
		pb.request(b, s, i, xds.TypeEndpoint, pb.names)
		if err := s.sync(); err != nil {
			b.Fatal(err)
		}
		pb.ack(b, s, i, xds.TypeCluster, nil)
		pb.ack(b, s, i, xds.TypeEndpoint, pb.names)
		pb.streams = append(pb.streams, s)
	}
	pb.counted = true
	return pb
}

// publish sets the key's view of typeURL to res.
func (pb *pushBench) publish(b *testing.B, typeURL string, res ...types.Resource) {
	view := viewOf(b, pb.r, typeURL, res...)
	pb.k.mu.Lock()
	pb.k.update(func(next *views.Set) {
		next.Types[typeURL] = &views.Type{View: view, Ready: true, Full: true}
	})
	pb.k.mu.Unlock()
}

// change moves the endpoint of one cluster and has every stream sync and
// ACK it.
func (pb *pushBench) change(b *testing.B, i int) {
	name := pb.names[i%benchClusters]
	ts := pb.k.views.Load().Types[xds.TypeEndpoint]
	res, err := pb.r.store.Decode(xds.TypeEndpoint, mustAny(mkCLA(name, uint32(10000+i%50000))), name)
	if err != nil {
		b.Fatal(err)
	}
	e := ts.View.Edit()
	e.Set(name, res.Hash, res)
	view := e.Tree()
	pb.k.mu.Lock()
	pb.k.update(func(next *views.Set) {
		next.Types[xds.TypeEndpoint] = &views.Type{View: view, Ready: true, Full: true}
	})
	pb.k.mu.Unlock()
	for j, s := range pb.streams {
		if err := s.sync(); err != nil {
			b.Fatal(err)
		}
		pb.ack(b, s, j, xds.TypeEndpoint, pb.names)
	}
}

// request sends stream i's first request of typeURL.
func (pb *pushBench) request(b *testing.B, s *stream, i int, typeURL string, names []string) {
	b.Helper()
	if pb.delta {
		if err := s.onDelta(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesSubscribe: names}); err != nil {
			b.Fatal(err)
		}
		return
	}
	if err := s.onSotW(&discovery.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: names}); err != nil {
		b.Fatal(err)
	}
}

// ack answers stream i's latest response of typeURL, as Envoy does (SotW
// repeats its whole subscription).
func (pb *pushBench) ack(b *testing.B, s *stream, i int, typeURL string, names []string) {
	if pb.delta {
		if err := s.onDelta(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResponseNonce: pb.nonces[i]}); err != nil {
			b.Fatal(err)
		}
		return
	}
	// As the relay reads it off the wire (wire.Codec): the names the
	// Envoy repeats are encoded once, version and nonce per ACK, in two
	// buffers as two HTTP/2 frames would bring them.
	version := s.subs[typeURL].known.Root().String()
	var tail []byte
	tail = protowire.AppendTag(tail, 1, protowire.BytesType) // version_info
	tail = protowire.AppendString(tail, version)
	tail = protowire.AppendTag(tail, 5, protowire.BytesType) // response_nonce
	tail = protowire.AppendString(tail, pb.nonces[i])
	var req wire.SotWRequest
	if err := wire.NewCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(pb.ackNames(b, typeURL, names)), mem.SliceBuffer(tail)}, &req); err != nil {
		b.Fatal(err)
	}
	defer req.Release()
	if err := s.handleSotW(req.Req, &req.Names); err != nil {
		b.Fatal(err)
	}
}

// ackNames is the part of a SotW ACK of typeURL every stream repeats,
// encoded: its type and names.
func (pb *pushBench) ackNames(b *testing.B, typeURL string, names []string) []byte {
	if raw, ok := pb.acks[typeURL]; ok {
		return raw
	}
	raw, err := proto.Marshal(&discovery.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: names})
	if err != nil {
		b.Fatal(err)
	}
	if pb.acks == nil {
		pb.acks = map[string][]byte{}
	}
	pb.acks[typeURL] = raw
	return raw
}
