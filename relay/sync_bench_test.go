package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"
	"testing"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	route "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// Full syncs of Istio-sized responses through the real downstream server
// over loopback gRPC (issue 32, item 1): an op is syncClients Envoys, each
// on a connection of its own, opening a stream and being sent a ~1 MB CDS
// (syncServices clusters), a listener and a ~0.4 MB RDS from the relay's
// cache, each ACKed as Envoy does. The key's views are fetched from the
// upstream before the timer starts, and an anchor stream keeps the key
// alive, so an op is the downstream server's work alone: MB/s and B/op are
// per op's bytes (b.SetBytes: the responses' bytes), so B/op ÷ (bytes/op
// in MB) is the bytes allocated per MB sent.
//
// The clients run in the same process and read responses without
// decoding them (syncClientCodec), so most of the profile is the relay's;
// split it by the goroutines' roots (loadtest/results/issue32-sync-research.md).
//
// The sub-benchmarks are grpc-go's transport knobs side by side, each on
// a relay of its own: base is the relay's options as they ship.
//
//	go test ./relay -run '^$' -bench BenchmarkSync -benchmem

const (
	syncClients  = 8
	syncServices = 3000
)

// syncKnob is one variant of the benchmark: server options added after the
// relay's own, and the clients' flow-control windows (0: grpc-go's
// default, 64 KiB growing by BDP estimation).
type syncKnob struct {
	name      string
	server    []grpc.ServerOption
	clientWin int32
}

var syncKnobs = []syncKnob{
	{name: "base"},
	{name: "shared=false", server: []grpc.ServerOption{grpc.SharedWriteBuffer(false)}},
	{name: "wbuf=0", server: []grpc.ServerOption{grpc.WriteBufferSize(0)}},
	{name: "wbuf=256K", server: []grpc.ServerOption{grpc.WriteBufferSize(256 << 10)}},
	{name: "wbuf=1M", server: []grpc.ServerOption{grpc.WriteBufferSize(1 << 20)}},
	{name: "workers=2", server: []grpc.ServerOption{grpc.NumStreamWorkers(2)}},
	// Envoy's own windows are large (its default stream window is 256
	// MiB): a client that never makes the relay wait for a WINDOW_UPDATE.
	{name: "clientwin=16M", clientWin: 16 << 20},
}

func BenchmarkSync(b *testing.B) {
	// What a relay does, without the tests' check of its shortcuts.
	defer func(check bool) { checkWhole = check }(checkWhole)
	checkWhole = false
	for _, delta := range []bool{false, true} {
		for _, k := range syncKnobs {
			b.Run(protocolName(delta)+"/"+k.name, func(b *testing.B) {
				sb := newSyncBench(b, delta, k)
				b.ReportAllocs()
				b.ResetTimer()
				cpu := processCPU()
				for range b.N {
					sb.syncAll(b)
				}
				cpu = processCPU() - cpu
				b.StopTimer()
				b.SetBytes(sb.perOp)
				mb := float64(sb.perOp) / (1 << 20)
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/1e6/float64(b.N)/mb, "wall-ms/MB")
				// The process's CPU: the relay's, and its clients' reading
				// and ACKing (in-process), per MB sent.
				b.ReportMetric(float64(cpu.Nanoseconds())/1e6/float64(b.N)/mb, "cpu-ms/MB")
			})
		}
	}
}

// syncBench is a relay in front of an upstream that holds an Istio-sized
// config, and syncClients connections to it.
type syncBench struct {
	r      *Relay
	delta  bool
	conns  []*grpc.ClientConn
	anchor *syncClient
	perOp  int64 // response bytes an op sends, measured on the first
}

func newSyncBench(b *testing.B, delta bool, k syncKnob) *syncBench {
	b.Helper()
	up := newTestUpstream(b)
	cs, rc := syncConfig(syncServices)
	up.set("default", xds.TypeCluster, cs...)
	up.set("default", xds.TypeListener, mkListener("l8080", "8080"))
	up.set("default", xds.TypeRoute, rc)
	r := startRelay(b, up, func(c *Config) { c.XDS.serverOptions = k.server })
	sb := &syncBench{r: r, delta: delta}
	for range syncClients + 1 {
		opts := []grpc.DialOption{
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(256<<20), grpc.ForceCodecV2(syncClientCodec{encoding.GetCodecV2("proto")})),
		}
		if k.clientWin > 0 {
			opts = append(opts, grpc.WithInitialWindowSize(k.clientWin), grpc.WithInitialConnWindowSize(k.clientWin))
		}
		conn, err := grpc.NewClient(r.lis.Addr().String(), opts...)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { conn.Close() })
		sb.conns = append(sb.conns, conn)
	}
	// The anchor: the key's first member, synced from the upstream, and
	// kept so that the key stays between ops.
	ctx, cancel := context.WithCancel(context.Background())
	b.Cleanup(cancel)
	a, n, err := sb.sync(ctx, sb.conns[syncClients], 0, true)
	if err != nil {
		b.Fatalf("anchor sync: %v", err)
	}
	sb.anchor = a
	// One op untimed: every client's connection is warm, the bodies are
	// encoded, and perOp is measured.
	sb.perOp = sb.syncAll(b)
	if sb.perOp < 8*int64(n)/10 {
		b.Fatalf("an op sent %d bytes, want about %d", sb.perOp, n*syncClients)
	}
	return sb
}

// syncAll has every client sync a new stream at once, and returns the
// response bytes they got.
func (sb *syncBench) syncAll(b *testing.B) int64 {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var total int64
	var first error
	for i := range syncClients {
		wg.Go(func() {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			_, n, err := sb.sync(ctx, sb.conns[i], i+1, false)
			mu.Lock()
			defer mu.Unlock()
			total += int64(n)
			if err != nil && first == nil {
				first = err
			}
		})
	}
	wg.Wait()
	if first != nil {
		b.Fatal(first)
	}
	return total
}

// syncClient is one ADS stream that reads responses as syncResponses.
type syncClient struct {
	stream grpc.ClientStream
	delta  bool
	node   *core.Node
}

// sync opens a stream on conn as Envoy i and syncs CDS, LDS and RDS as
// Envoy does (each response ACKed; the next type asked for once the one
// before it is in). It returns the stream, open if keep, and the response
// bytes it got.
func (sb *syncBench) sync(ctx context.Context, conn *grpc.ClientConn, i int, keep bool) (*syncClient, int, error) {
	method := "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
	if sb.delta {
		method = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
	}
	st, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, method)
	if err != nil {
		return nil, 0, err
	}
	c := &syncClient{stream: st, delta: sb.delta, node: node("default", "bench", i)}
	n := 0
	var ack *syncResponse
	for _, step := range []struct {
		typeURL string
		names   []string
	}{{xds.TypeCluster, nil}, {xds.TypeListener, nil}, {xds.TypeRoute, []string{"8080"}}} {
		if err := c.request(step.typeURL, step.names, ack); err != nil {
			return nil, n, err
		}
		var resp syncResponse
		if err := st.RecvMsg(&resp); err != nil {
			return nil, n, fmt.Errorf("recv %s: %w", xds.ShortType(step.typeURL), err)
		}
		if resp.typeURL != step.typeURL {
			return nil, n, fmt.Errorf("got %s, want %s", resp.typeURL, step.typeURL)
		}
		n += resp.size
		ack = &resp
	}
	if err := c.request("", nil, ack); err != nil {
		return nil, n, err
	}
	if !keep {
		if err := st.CloseSend(); err != nil {
			return nil, n, err
		}
	}
	return c, n, nil
}

// request ACKs ack (if any) and then asks for typeURL (if any), as
// Envoy's ADS does.
func (c *syncClient) request(typeURL string, names []string, ack *syncResponse) error {
	var node *core.Node
	if ack == nil {
		node = c.node
	}
	if ack != nil {
		var err error
		if c.delta {
			err = c.stream.SendMsg(&discovery.DeltaDiscoveryRequest{TypeUrl: ack.typeURL, ResponseNonce: ack.nonce})
		} else {
			var subs []string
			if ack.typeURL == xds.TypeRoute {
				subs = []string{"8080"}
			}
			err = c.stream.SendMsg(&discovery.DiscoveryRequest{TypeUrl: ack.typeURL, VersionInfo: ack.version, ResponseNonce: ack.nonce, ResourceNames: subs})
		}
		if err != nil {
			return fmt.Errorf("ack %s: %w", xds.ShortType(ack.typeURL), err)
		}
	}
	if typeURL == "" {
		return nil
	}
	var err error
	if c.delta {
		err = c.stream.SendMsg(&discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: typeURL, ResourceNamesSubscribe: names})
	} else {
		err = c.stream.SendMsg(&discovery.DiscoveryRequest{Node: node, TypeUrl: typeURL, ResourceNames: names})
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("request %s: %w", xds.ShortType(typeURL), err)
	}
	return err
}

// syncResponse is a DiscoveryResponse or DeltaDiscoveryResponse read
// without decoding its resources: the fields an ACK needs, and its size.
type syncResponse struct {
	version, typeURL, nonce string
	size                    int
}

// syncClientCodec is the benchmark clients' codec: requests through the
// proto codec, responses read as syncResponses, their resources skipped
// where gRPC received them (no copy, no decoding), so that the clients
// cost the process little beside the relay.
type syncClientCodec struct{ proto encoding.CodecV2 }

func (c syncClientCodec) Marshal(v any) (mem.BufferSlice, error) { return c.proto.Marshal(v) }

func (c syncClientCodec) Unmarshal(data mem.BufferSlice, v any) error {
	r, ok := v.(*syncResponse)
	if !ok {
		return c.proto.Unmarshal(data, v)
	}
	r.size = data.Len()
	rd := data.Reader()
	defer rd.Close()
	for rd.Remaining() > 0 {
		tag, err := readVarint(rd)
		if err != nil {
			return err
		}
		num, typ := protowire.DecodeTag(tag)
		switch typ {
		case protowire.VarintType:
			if _, err := readVarint(rd); err != nil {
				return err
			}
			continue
		case protowire.BytesType:
		default:
			return fmt.Errorf("field %d: wire type %d", num, typ)
		}
		n, err := readVarint(rd)
		if err != nil {
			return err
		}
		var s *string
		switch num {
		case 1:
			s = &r.version
		case 4:
			s = &r.typeURL
		case 5:
			s = &r.nonce
		}
		if s == nil {
			if _, err := rd.Discard(int(n)); err != nil {
				return err
			}
			continue
		}
		b := make([]byte, n)
		if _, err := io.ReadFull(rd, b); err != nil {
			return err
		}
		*s = string(b)
	}
	return nil
}

func (syncClientCodec) Name() string { return "proto" }

func readVarint(rd *mem.Reader) (uint64, error) {
	var v uint64
	for shift := 0; shift < 64; shift += 7 {
		c, err := rd.ReadByte()
		if err != nil {
			return 0, err
		}
		v |= uint64(c&0x7f) << shift
		if c < 0x80 {
			return v, nil
		}
	}
	return 0, errors.New("varint overflow")
}

// syncConfig returns n Istio-shaped outbound clusters (about 300 bytes
// each, as istiod's are) and route configuration "8080" with a virtual host
// for each service (about 140 bytes each).
func syncConfig(n int) ([]types.Resource, types.Resource) {
	var cs []types.Resource
	rc := &route.RouteConfiguration{Name: "8080", ValidateClusters: wrapperspb.Bool(false)}
	for i := range n {
		host := fmt.Sprintf("svc-%d.ns-%d.svc.cluster.local", i, i%50)
		name := "outbound|8080||" + host
		md, err := structpb.NewStruct(map[string]any{"services": []any{map[string]any{
			"host": host, "name": fmt.Sprint("svc-", i), "namespace": fmt.Sprint("ns-", i%50),
		}}})
		if err != nil {
			panic(err)
		}
		// Resolved by DNS, as istiod's clusters of DNS ServiceEntries
		// are: warm once sent, with no EDS for the benchmark to sync.
		c := &cluster.Cluster{
			Name:                 name,
			ClusterDiscoveryType: &cluster.Cluster_Type{Type: cluster.Cluster_STRICT_DNS},
			LoadAssignment:       mkCLA(host, 8080),
		}
		c.LoadAssignment.Endpoints[0].LbEndpoints[0].GetEndpoint().GetAddress().GetSocketAddress().Address = host
		c.ConnectTimeout = durationpb.New(10 * time.Second)
		c.LbPolicy = cluster.Cluster_LEAST_REQUEST
		c.CircuitBreakers = &cluster.CircuitBreakers{Thresholds: []*cluster.CircuitBreakers_Thresholds{{
			MaxConnections: wrapperspb.UInt32(4294967295), MaxPendingRequests: wrapperspb.UInt32(4294967295),
			MaxRequests: wrapperspb.UInt32(4294967295), MaxRetries: wrapperspb.UInt32(4294967295),
			TrackRemaining: true,
		}}}
		c.Metadata = &core.Metadata{FilterMetadata: map[string]*structpb.Struct{"istio": md}}
		c.CommonLbConfig = &cluster.Cluster_CommonLbConfig{}
		cs = append(cs, c)
		rc.VirtualHosts = append(rc.VirtualHosts, &route.VirtualHost{
			Name: host + ":8080", Domains: []string{host, host + ":8080"},
			Routes: []*route.Route{{
				Match:  &route.RouteMatch{PathSpecifier: &route.RouteMatch_Prefix{Prefix: "/"}},
				Action: &route.Route_Route{Route: &route.RouteAction{ClusterSpecifier: &route.RouteAction_Cluster{Cluster: name}}},
			}},
		})
	}
	return cs, rc
}

// processCPU is the CPU time the process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
