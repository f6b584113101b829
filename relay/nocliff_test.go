package relay

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// No cliff at one Envoy per key (issue 18): clients keyed one a node, all
// subscribed to the same endpoints, cost the relay within twice what the
// same clients cost keyed together, whichever protocol they and the
// relay's upstream speak. What the relay holds per key (its views,
// subscriptions, upstream names and versions, history, the bodies it
// encoded for its clients) must be shared by content, or it grows with
// keys × names.
//
// Memory is read as the live heap after a collection, so the figure does
// not depend on the machine's speed or load. Everything in the test
// process counts: so the upstream and the clients are lean, holding
// nothing per stream beyond their gRPC stream (go-control-plane's cache
// keeps every watch's request, and the raw test client its last response:
// at 200 streams either would outweigh the relay), and each case has an
// upstream of its own, stopped with it, measured from a steady heap.
func TestNoCliffPerNodeKeys(t *testing.T) {
	const clients, endpoints = 100, 2000
	for _, tc := range []struct{ down, up Protocol }{
		{ProtocolSotW, ProtocolSotW},   // issue 18's fleet
		{ProtocolDelta, ProtocolDelta}, // the relay's default upstream
	} {
		t.Run(fmt.Sprintf("clients %s, upstream %s", tc.down, tc.up), func(t *testing.T) {
			heap := func(perNode bool) uint64 {
				var live uint64
				name := "one key"
				if perNode {
					name = "per-node keys"
				}
				t.Run(name, func(t *testing.T) {
					before := steadyHeap()
					up := newLeanUpstream(t, endpoints)
					r := startRelayTo(t, up.addr, func(c *Config) {
						c.Upstream.Protocol = tc.up
						c.Upstream.StreamRate, c.Upstream.Syncs, c.XDS.AdmitRate = 0, 0, 0
						if perNode {
							c.Keys.Profile = aggkey.PerNode{}
						}
					})
					syncLeanClients(t, r.Addr().String(), tc.down == ProtocolDelta, clients, up.names)
					want := 1
					if perNode {
						want = clients
					}
					if got := up.streams(); got != want {
						t.Fatalf("upstream streams = %d, want %d", got, want)
					}
					waitSettled(t, r, clients)
					after := steadyHeap()
					live = after - min(before, after)
					t.Logf("%d clients, %d endpoints: %.1f MiB live", clients, endpoints, float64(live)/(1<<20))
				})
				return live
			}
			one := heap(false)
			perNode := heap(true)
			if t.Failed() {
				return
			}
			t.Logf("per-node / one key = %.2f", float64(perNode)/float64(one))
			if perNode > 2*one {
				t.Errorf("%d per-node keys hold %.1f MiB, more than twice one key's %.1f MiB", clients, float64(perNode)/(1<<20), float64(one)/(1<<20))
			}
		})
	}
}

// waitSettled waits until n streams are attached to r and each ACKed the
// latest response it was sent: nothing is in flight.
func waitSettled(t *testing.T, r *Relay, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	waitCtx(ctx, t, "every client ACKed its latest response", func() bool {
		cs := r.Clients()
		for _, c := range cs {
			st, ok := c.Types[xds.TypeEndpoint]
			if !ok || st.SentVersion == "" || st.AckedVersion != st.SentVersion {
				return false
			}
		}
		return len(cs) == n
	})
}

// steadyHeap returns liveHeap once two readings in a row agree within 1%:
// buffers of the last responses may still be on their way out.
func steadyHeap() uint64 {
	prev := liveHeap()
	for range 50 {
		time.Sleep(20 * time.Millisecond)
		h := liveHeap()
		if max(h, prev)-min(h, prev) <= max(h, prev)/100 {
			return h
		}
		prev = h
	}
	return prev
}

// liveHeap returns the bytes of live heap objects after a full collection.
func liveHeap() uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC() // the first may leave cleanups (weak sets) to run
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// syncLeanClients opens n streams to addr (Delta if delta, else SotW),
// each subscribed to names of EDS, and returns once every one was sent
// them all and ACKed. The streams stay open, ACKing what comes, until the
// test ends; the clients keep nothing of what they receive.
func syncLeanClients(t *testing.T, addr string, delta bool, n int, names []string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	const perConn = 50
	var ads discovery.AggregatedDiscoveryServiceClient
	synced := make(chan error, n)
	for i := range n {
		if i%perConn == 0 {
			ads = discovery.NewAggregatedDiscoveryServiceClient(dial(t, addr))
		}
		var client leanClient = leanSotW
		if delta {
			client = leanDelta
		}
		run, err := client(ctx, ads, node("ns1", "app", i), names)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() { run(func(err error) { synced <- err }) })
	}
	for range n {
		select {
		case err := <-synced:
			if err != nil {
				t.Fatalf("client: %v", err)
			}
		case <-time.After(2 * time.Minute):
			t.Fatal("clients not synced in 2 minutes")
		}
	}
}

// A leanClient opens a stream for node subscribed to names of EDS; run
// ACKs what comes, calls synced once it was sent every name (or with the
// error that ended the stream first), and returns when the stream ends.
type leanClient func(ctx context.Context, ads discovery.AggregatedDiscoveryServiceClient, n *core.Node, names []string) (run func(synced func(error)), err error)

func leanSotW(ctx context.Context, ads discovery.AggregatedDiscoveryServiceClient, n *core.Node, names []string) (func(func(error)), error) {
	st, err := ads.StreamAggregatedResources(ctx)
	if err != nil {
		return nil, err
	}
	return func(synced func(error)) {
		leanRun(st.Send(&discovery.DiscoveryRequest{Node: n, TypeUrl: xds.TypeEndpoint, ResourceNames: names}), st.Recv,
			func(resp *discovery.DiscoveryResponse, each func(string)) error {
				for _, a := range resp.GetResources() {
					var cla endpoint.ClusterLoadAssignment
					if err := a.UnmarshalTo(&cla); err != nil {
						return err
					}
					each(cla.GetClusterName())
				}
				return st.Send(ackOf(resp, names))
			}, len(names), synced)
	}, nil
}

func leanDelta(ctx context.Context, ads discovery.AggregatedDiscoveryServiceClient, n *core.Node, names []string) (func(func(error)), error) {
	st, err := ads.DeltaAggregatedResources(ctx)
	if err != nil {
		return nil, err
	}
	return func(synced func(error)) {
		leanRun(st.Send(&discovery.DeltaDiscoveryRequest{Node: n, TypeUrl: xds.TypeEndpoint, ResourceNamesSubscribe: names}), st.Recv,
			func(resp *discovery.DeltaDiscoveryResponse, each func(string)) error {
				for _, r := range resp.GetResources() {
					each(r.GetName())
				}
				return st.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResponseNonce: resp.GetNonce()})
			}, len(names), synced)
	}, nil
}

// leanRun is a lean client's loop, once its first request was sent
// (err): it receives, and answers each response (calling each with every
// name in it) until the stream ends. synced is called once every one of
// want names came, or with the error that ended the stream before.
func leanRun[Resp any](err error, recv func() (Resp, error), answer func(Resp, func(string)) error, want int, synced func(error)) {
	seen := make(map[string]bool, want)
	for err == nil {
		var resp Resp
		if resp, err = recv(); err == nil {
			err = answer(resp, func(name string) {
				if seen != nil {
					seen[name] = true
				}
			})
		}
		if seen != nil && len(seen) == want {
			seen = nil
			synced(nil)
		}
	}
	if seen != nil {
		synced(err)
	}
}

func ackOf(resp *discovery.DiscoveryResponse, names []string) *discovery.DiscoveryRequest {
	return &discovery.DiscoveryRequest{TypeUrl: xds.TypeEndpoint, VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce(), ResourceNames: names}
}

// leanUpstream is an ADS server of one set of endpoints for every node. In
// SotW it answers a request whose names differ from the last it answered
// on the stream with those of them it has; in Delta, a subscription with
// the names subscribed. It holds nothing else per stream.
type leanUpstream struct {
	addr  string
	names []string
	res   map[string]*anypb.Any

	mu   sync.Mutex
	open int
}

func newLeanUpstream(t *testing.T, n int) *leanUpstream {
	t.Helper()
	u := &leanUpstream{res: make(map[string]*anypb.Any, n)}
	for i := range n {
		name := fmt.Sprintf("outbound|8080||svc-%d.ns-%d.svc.cluster.local", i, i%50)
		a, err := anypb.New(mkCLA(name, 8080, 8081))
		if err != nil {
			t.Fatal(err)
		}
		u.names = append(u.names, name)
		u.res[name] = a
	}
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(256<<20), grpc.MaxSendMsgSize(256<<20))
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, u)
	u.addr = serveLoopback(t, srv)
	return u
}

func (u *leanUpstream) streams() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.open
}

// opened counts a stream open until the returned func is called.
func (u *leanUpstream) opened() (closed func()) {
	u.mu.Lock()
	u.open++
	u.mu.Unlock()
	return func() {
		u.mu.Lock()
		u.open--
		u.mu.Unlock()
	}
}

// recvEDS receives a request, refusing any but EDS.
func recvEDS[R interface{ GetTypeUrl() string }](recv func() (R, error)) (R, error) {
	req, err := recv()
	if err == nil && req.GetTypeUrl() != xds.TypeEndpoint {
		err = status.Errorf(codes.Unimplemented, "lean upstream serves only EDS, not %s", req.GetTypeUrl())
	}
	return req, err
}

func (u *leanUpstream) StreamAggregatedResources(st discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	defer u.opened()()
	var nonce int
	var last uint64 // wire.ListDigest of the names last answered
	for {
		req, err := recvEDS(st.Recv)
		if err != nil {
			return err
		}
		if got := strconv.Itoa(nonce); nonce > 0 && req.GetResponseNonce() != got {
			continue // stale
		}
		sum := wire.ListDigest(req.GetResourceNames())
		if nonce > 0 && sum == last {
			continue // an ACK
		}
		last = sum
		nonce++
		resp := &discovery.DiscoveryResponse{TypeUrl: xds.TypeEndpoint, VersionInfo: "1", Nonce: strconv.Itoa(nonce)}
		for _, n := range req.GetResourceNames() {
			if a := u.res[n]; a != nil {
				resp.Resources = append(resp.Resources, a)
			}
		}
		if err := st.Send(resp); err != nil {
			return err
		}
	}
}

func (u *leanUpstream) DeltaAggregatedResources(st discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	defer u.opened()()
	nonce := 0
	for {
		req, err := recvEDS(st.Recv)
		if err != nil {
			return err
		}
		if len(req.GetResourceNamesSubscribe()) == 0 {
			continue // an ACK, or an unsubscription
		}
		nonce++
		resp := &discovery.DeltaDiscoveryResponse{TypeUrl: xds.TypeEndpoint, SystemVersionInfo: "1", Nonce: strconv.Itoa(nonce)}
		for _, n := range req.GetResourceNamesSubscribe() {
			if a := u.res[n]; a != nil {
				resp.Resources = append(resp.Resources, &discovery.Resource{Name: n, Version: "1", Resource: a})
			}
		}
		if err := st.Send(resp); err != nil {
			return err
		}
	}
}
