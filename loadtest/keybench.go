package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/relay"
)

// KeyBenchConfig configures RunKeyBench: issue 18's fleet that no Istio
// key recognises. Clients SotW clients, go-control-plane style (node ids
// "sidecar-<i>.bench", one node.cluster, no metadata), each subscribed to
// the same Endpoints ClusterLoadAssignments of a real go-control-plane
// snapshot cache, behind one relay in a process of its own, keyed by
// Profile; then Pushes endpoint changes, one after the other.
type KeyBenchConfig struct {
	// Clients is the number of SotW clients. Default 1,000.
	Clients int
	// Endpoints is the number of ClusterLoadAssignments. Default 10,000.
	Endpoints int
	// Pushes is the number of endpoint changes timed. Default 3.
	Pushes int
	// Profile is the relay's key profile: "fields" (keyed by cluster: one
	// key) or "per-node" (one key per client). Default fields.
	Profile string
	// UpstreamProtocol is the relay's ADS variant to the upstream.
	// Default sotw, as the clients'.
	UpstreamProtocol relay.Protocol
	// ClientsPerConn is how many clients share a gRPC connection. Default
	// 10.
	ClientsPerConn int
	// SyncTimeout bounds the initial sync; PushTimeout each push.
	// Defaults 10 min and 5 min.
	SyncTimeout, PushTimeout time.Duration
	// StartRelay starts the relay child. Required.
	StartRelay StartRelayFunc `json:"-"`
	// RelayCPUs pins the relay child (default: not pinned).
	RelayCPUs CPUSet `json:"relay_cpus"`
	// RelayProfile, if set, has the relay child write a CPU profile of
	// the pushes to RelayProfile.cpu and a heap profile after them to
	// RelayProfile.heap.
	RelayProfile string `json:"relay_profile,omitempty"`
}

// DefaultKeyBenchConfig is the scenario.
func DefaultKeyBenchConfig() KeyBenchConfig {
	return KeyBenchConfig{Clients: 1000, Endpoints: 10_000, Pushes: 3, Profile: "fields", UpstreamProtocol: relay.ProtocolSotW,
		ClientsPerConn: 10, SyncTimeout: 10 * time.Minute, PushTimeout: 5 * time.Minute}
}

// KeyBenchReport is what RunKeyBench measured.
type KeyBenchReport struct {
	Date    string         `json:"date"`
	Machine report.Machine `json:"machine"`
	Config  KeyBenchConfig `json:"config"`
	// Connect is the time from the first client's dial to every client
	// holding every endpoint.
	Connect time.Duration `json:"connect"`
	// UpstreamStreams is the streams the upstream held once synced.
	UpstreamStreams int64 `json:"upstream_streams"`
	// Pushes: each push's time to the last client (every client's first
	// response after the push: P50, P99, max), and the relay's CPU over it.
	Pushes []KeyBenchPush `json:"pushes"`
	// The relay process: CPU over the initial sync, RSS once synced
	// (steady) and the largest seen (peak, VmHWM).
	RelaySyncCPU   time.Duration `json:"relay_sync_cpu"`
	RelaySteadyRSS uint64        `json:"relay_steady_rss"`
	RelayPeakRSS   uint64        `json:"relay_peak_rss"`
}

// KeyBenchPush is one push's figures.
type KeyBenchPush struct {
	P50, P99, Max time.Duration
	RelayCPU      time.Duration `json:"relay_cpu"`
}

// benchHash keys every node to one snapshot: the upstream serves the whole
// fleet the same config, as the control plane does.
type benchHash struct{}

func (benchHash) ID(*core.Node) string { return "fleet" }

// RunKeyBench runs the scenario and reports; progress goes to out.
func RunKeyBench(ctx context.Context, cfg KeyBenchConfig, out io.Writer) (*KeyBenchReport, error) {
	if cfg.StartRelay == nil {
		return nil, errors.New("loadtest: KeyBenchConfig.StartRelay is required")
	}
	if cfg.Clients <= 0 || cfg.Endpoints <= 0 || cfg.ClientsPerConn <= 0 {
		return nil, errors.New("loadtest: Clients, Endpoints and ClientsPerConn must be positive")
	}
	rep := &KeyBenchReport{Date: time.Now().UTC().Format(time.RFC3339), Machine: report.ThisMachine(), Config: cfg}

	// The upstream: go-control-plane's snapshot cache and server.
	snapCache := cachev3.NewSnapshotCache(false, benchHash{}, nil)
	names := make([]string, cfg.Endpoints)
	for i := range names {
		names[i] = fmt.Sprintf("outbound|8080||svc-%d.bench.svc.cluster.local", i)
	}
	setSnapshot := func(version int) error {
		res := make([]types.Resource, len(names))
		for i, n := range names {
			port := uint32(8080)
			if version > 0 && i == version-1 {
				port = 9000 + uint32(version) // the push: one endpoint moves
			}
			res[i] = benchCLA(n, i, port)
		}
		snap, err := cachev3.NewSnapshot(fmt.Sprint("v", version), map[resourcev3.Type][]types.Resource{resourcev3.EndpointType: res})
		if err != nil {
			return err
		}
		return snapCache.SetSnapshot(ctx, "fleet", snap)
	}
	if err := setSnapshot(0); err != nil {
		return nil, err
	}
	var upOpen atomic.Int64
	cb := serverv3.CallbackFuncs{
		StreamOpenFunc:        func(context.Context, int64, string) error { upOpen.Add(1); return nil },
		StreamClosedFunc:      func(int64, *core.Node) { upOpen.Add(-1) },
		DeltaStreamOpenFunc:   func(context.Context, int64, string) error { upOpen.Add(1); return nil },
		DeltaStreamClosedFunc: func(int64, *core.Node) { upOpen.Add(-1) },
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	// istiod lets clients ping as often as the relay does (the synthetic
	// upstream's policy); go-control-plane's default would send it away.
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(256<<20), grpc.MaxSendMsgSize(256<<20),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: time.Second, PermitWithoutStream: true}))
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, serverv3.NewServer(ctx, snapCache, cb))
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	defer func() {
		srv.Stop()
		<-served
	}()

	relayCfg := RelayChildConfig{Upstream: lis.Addr().String(), UpstreamProtocol: cfg.UpstreamProtocol, KeyProfile: cfg.Profile, CPUs: cfg.RelayCPUs}
	if cfg.Profile == "fields" {
		relayCfg.KeyFields = "cluster"
	}
	if cfg.RelayProfile != "" {
		relayCfg.CPUProfile, relayCfg.HeapProfile = cfg.RelayProfile+".cpu", cfg.RelayProfile+".heap"
	}
	child, err := cfg.StartRelay(ctx, relayCfg)
	if err != nil {
		return nil, fmt.Errorf("loadtest: start relay: %w", err)
	}
	defer child.Stop(context.Background())
	var peak atomic.Uint64
	sample := func() ProcStat {
		st, err := child.Stat()
		if err == nil && st.PeakRSS > peak.Load() {
			peak.Store(st.PeakRSS)
		}
		return st
	}
	before := sample()

	// The clients.
	fleet, err := startBenchClients(ctx, child.Addr(), names, cfg)
	if err != nil {
		return nil, err
	}
	defer fleet.stop()
	start := time.Now()
	fmt.Fprintf(out, "keys: %d SotW clients, %d endpoints, profile %s, relay upstream %s\n", cfg.Clients, cfg.Endpoints, cfg.Profile, cfg.UpstreamProtocol)
	if err := fleet.waitPast(ctx, make([]int64, cfg.Clients), cfg.SyncTimeout, out); err != nil {
		return nil, fmt.Errorf("loadtest: initial sync: %w", err)
	}
	rep.Connect = time.Since(start)
	synced := sample()
	rep.RelaySyncCPU = synced.CPU - before.CPU
	// Settle: the upstream streams of every key open, garbage collected.
	time.Sleep(2 * time.Second)
	rep.UpstreamStreams = upOpen.Load()
	rep.RelaySteadyRSS = sample().RSS
	fmt.Fprintf(out, "  connected and synced in %v: %d upstream streams, relay CPU %v, RSS %.0f MiB\n",
		rep.Connect.Round(time.Millisecond), rep.UpstreamStreams, rep.RelaySyncCPU, float64(rep.RelaySteadyRSS)/(1<<20))

	if cfg.RelayProfile != "" {
		if err := child.Send(childProfileStart); err != nil {
			return nil, err
		}
	}
	for p := 1; p <= cfg.Pushes; p++ {
		cpu0 := sample().CPU
		want := fleet.received()
		t0 := time.Now()
		if err := setSnapshot(p); err != nil {
			return nil, err
		}
		if err := fleet.waitPast(ctx, want, cfg.PushTimeout, nil); err != nil {
			return nil, fmt.Errorf("loadtest: push %d: %w", p, err)
		}
		ds := fleet.since(want, t0)
		cpu := sample().CPU - cpu0
		slices.Sort(ds)
		push := KeyBenchPush{P50: ds[len(ds)/2], P99: ds[min(len(ds)-1, len(ds)*99/100)], Max: ds[len(ds)-1], RelayCPU: cpu}
		rep.Pushes = append(rep.Pushes, push)
		fmt.Fprintf(out, "  push %d: to every client P50 %v P99 %v max %v; relay CPU %v\n", p, push.P50.Round(time.Millisecond),
			push.P99.Round(time.Millisecond), push.Max.Round(time.Millisecond), cpu)
	}
	if cfg.RelayProfile != "" {
		if err := child.Send(childProfileStop); err != nil {
			return nil, err
		}
	}
	rep.RelayPeakRSS = max(peak.Load(), sample().PeakRSS)
	fmt.Fprintf(out, "  relay RSS steady %.0f MiB, peak %.0f MiB\n", float64(rep.RelaySteadyRSS)/(1<<20), float64(rep.RelayPeakRSS)/(1<<20))
	return rep, nil
}

func benchCLA(name string, i int, port uint32) *endpoint.ClusterLoadAssignment {
	return &endpoint.ClusterLoadAssignment{ClusterName: name, Endpoints: []*endpoint.LocalityLbEndpoints{{
		LbEndpoints: []*endpoint.LbEndpoint{{HostIdentifier: &endpoint.LbEndpoint_Endpoint{Endpoint: &endpoint.Endpoint{
			Address: &core.Address{Address: &core.Address_SocketAddress{SocketAddress: &core.SocketAddress{
				Address: fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255), PortSpecifier: &core.SocketAddress_PortValue{PortValue: port}}}},
		}}}},
	}}}
}

// benchClients are the SotW clients of RunKeyBench. Each reads only the
// top of a response (version, nonce, how many resources) and ACKs it with
// the request it subscribed with, pre-encoded once for all.
type benchClients struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	conns  []*grpc.ClientConn
	n      int
	// counts[i] is how many responses client i has received since it held
	// every endpoint, at[i] when each arrived (guarded by mu). A SotW
	// response of endpoints may carry only those that changed (xDS lets a
	// server leave out unchanged ClusterLoadAssignments).
	counts []atomic.Int64
	mu     sync.Mutex
	at     [][]time.Time
	failed atomic.Pointer[error]
}

// rawCodec sends pre-encoded requests ([]byte) and hands responses over
// whole (*[]byte), so that a client never decodes ten thousand resources.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }
func (rawCodec) Marshal(v any) ([]byte, error) {
	if b, ok := v.([]byte); ok {
		return b, nil
	}
	return nil, fmt.Errorf("rawCodec: %T", v)
}
func (rawCodec) Unmarshal(data []byte, v any) error {
	p, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: %T", v)
	}
	*p = append((*p)[:0], data...)
	return nil
}

var adsStream = &grpc.StreamDesc{StreamName: "StreamAggregatedResources", ServerStreams: true, ClientStreams: true}

func startBenchClients(ctx context.Context, addr string, names []string, cfg KeyBenchConfig) (*benchClients, error) {
	ctx, cancel := context.WithCancel(ctx)
	f := &benchClients{cancel: cancel, n: cfg.Clients, counts: make([]atomic.Int64, cfg.Clients), at: make([][]time.Time, cfg.Clients)}
	// Every request names every endpoint: encoded once.
	base, err := proto.Marshal(&discovery.DiscoveryRequest{TypeUrl: resourcev3.EndpointType, ResourceNames: names})
	if err != nil {
		cancel()
		return nil, err
	}
	var conn *grpc.ClientConn
	for i := range cfg.Clients {
		if i%cfg.ClientsPerConn == 0 {
			if conn, err = grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
				grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(256<<20), grpc.ForceCodec(rawCodec{}))); err != nil {
				f.stop()
				return nil, err
			}
			f.conns = append(f.conns, conn)
		}
		node, err := proto.Marshal(&discovery.DiscoveryRequest{Node: &core.Node{Id: fmt.Sprintf("sidecar-%d.bench", i), Cluster: "bench"}})
		if err != nil {
			f.stop()
			return nil, err
		}
		first := append(slices.Clip(node), base...)
		c := conn // the loop moves conn on
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			if err := f.run(ctx, c, i, first, base, len(names)); err != nil && ctx.Err() == nil {
				err = fmt.Errorf("client %d: %w", i, err)
				f.failed.CompareAndSwap(nil, &err)
			}
		}()
	}
	return f, nil
}

// run is client i's stream: subscribe, then ACK every response, counting
// those from the one that completed every endpoint on.
func (f *benchClients) run(ctx context.Context, conn *grpc.ClientConn, i int, first, base []byte, want int) error {
	s, err := conn.NewStream(ctx, adsStream, "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources")
	if err != nil {
		return err
	}
	if err := s.SendMsg(first); err != nil {
		return err
	}
	var buf []byte
	held := 0 // resources received before the client held every one
	for {
		if err := s.RecvMsg(&buf); err != nil {
			return err
		}
		at := time.Now()
		version, nonce, n := responseTop(buf)
		if held < want {
			held += n
		}
		if held >= want {
			f.mu.Lock()
			f.at[i] = append(f.at[i], at)
			f.mu.Unlock()
			f.counts[i].Add(1)
		}
		ack := slices.Clip(base)
		ack = protowire.AppendTag(ack, 1, protowire.BytesType) // version_info
		ack = protowire.AppendString(ack, version)
		ack = protowire.AppendTag(ack, 5, protowire.BytesType) // response_nonce
		ack = protowire.AppendString(ack, nonce)
		if err := s.SendMsg(ack); err != nil {
			return err
		}
	}
}

// responseTop reads a DiscoveryResponse's version_info, nonce and number
// of resources, and nothing else.
func responseTop(b []byte) (version, nonce string, resources int) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return
		}
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return
		}
		if typ == protowire.BytesType {
			v, _ := protowire.ConsumeBytes(b)
			switch num {
			case 1:
				version = string(v)
			case 2:
				resources++
			case 5:
				nonce = string(v)
			}
		}
		b = b[m:]
	}
	return
}

// received returns how many responses each client has received since
// it held every endpoint.
func (f *benchClients) received() []int64 {
	out := make([]int64, f.n)
	for i := range out {
		out[i] = f.counts[i].Load()
	}
	return out
}

// waitPast waits until every client has received more responses than
// counted in before, printing progress every 10 s to out if set.
func (f *benchClients) waitPast(ctx context.Context, before []int64, timeout time.Duration, out io.Writer) error {
	deadline := time.Now().Add(timeout)
	lastPrint := time.Now()
	for {
		if p := f.failed.Load(); p != nil {
			return *p
		}
		done := 0
		for i := range before {
			if f.counts[i].Load() > before[i] {
				done++
			}
		}
		if done == f.n {
			return nil
		}
		if out != nil && time.Since(lastPrint) > 10*time.Second {
			fmt.Fprintf(out, "  … %d of %d clients synced\n", done, f.n)
			lastPrint = time.Now()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d clients done after %v", done, f.n, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// since returns, for each client, the time from t0 to its first response
// after the count in before.
func (f *benchClients) since(before []int64, t0 time.Time) []time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]time.Duration, f.n)
	for i := range out {
		out[i] = f.at[i][before[i]].Sub(t0)
	}
	return out
}

// stop ends every client and waits for them.
func (f *benchClients) stop() {
	f.cancel()
	f.wg.Wait()
	for _, c := range f.conns {
		c.Close()
	}
}
