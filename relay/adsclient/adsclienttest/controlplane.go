// Package adsclienttest is a real go-control-plane ADS server for the
// tests of ADS clients (relay/adsclient, relay/passthrough): its snapshot
// cache, SotW and Delta, on loopback, recording every request it reads.
package adsclienttest

import (
	"context"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// NodeID is the node the control plane serves a snapshot to (Set).
const NodeID = "sidecar~10.0.0.1~a.ns~ns.svc.cluster.local"

// ControlPlane is a go-control-plane server on loopback. Every stream's
// trailer says "x-ended-by: test-control-plane".
type ControlPlane struct {
	// Addr is where it listens.
	Addr string

	cache cachev3.SnapshotCache
	srv   *grpc.Server
	done  chan struct{}

	mu     sync.Mutex
	sotw   []*discovery.DiscoveryRequest
	delta  []*discovery.DeltaDiscoveryRequest
	refuse error
}

// Start starts a control plane on addr ("127.0.0.1:0" for any port), stopped
// when the test ends.
func Start(t testing.TB, addr string) *ControlPlane {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	cp := &ControlPlane{Addr: lis.Addr().String(), cache: cachev3.NewSnapshotCache(false, cachev3.IDHash{}, nil), done: make(chan struct{})}
	trailer := func(ctx context.Context, _ int64, _ string) error {
		return grpc.SetTrailer(ctx, metadata.Pairs("x-ended-by", "test-control-plane"))
	}
	cb := serverv3.CallbackFuncs{
		StreamOpenFunc:      trailer,
		DeltaStreamOpenFunc: trailer,
		StreamRequestFunc: func(_ int64, r *discovery.DiscoveryRequest) error {
			cp.mu.Lock()
			defer cp.mu.Unlock()
			cp.sotw = append(cp.sotw, proto.Clone(r).(*discovery.DiscoveryRequest))
			return cp.refuse
		},
		StreamDeltaRequestFunc: func(_ int64, r *discovery.DeltaDiscoveryRequest) error {
			cp.mu.Lock()
			defer cp.mu.Unlock()
			cp.delta = append(cp.delta, proto.Clone(r).(*discovery.DeltaDiscoveryRequest))
			return cp.refuse
		},
	}
	cp.srv = grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(cp.srv, serverv3.NewServer(context.Background(), cp.cache, cb))
	go func() {
		defer close(cp.done)
		_ = cp.srv.Serve(lis)
	}()
	t.Cleanup(cp.Stop)
	return cp
}

// Stop stops the server at once, ending its streams. It is idempotent.
func (cp *ControlPlane) Stop() {
	cp.srv.Stop()
	<-cp.done
}

// Refuse makes every stream end with err on its next request.
func (cp *ControlPlane) Refuse(err error) {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	cp.refuse = err
}

// Set publishes version of the clusters named to NodeID.
func (cp *ControlPlane) Set(t testing.TB, version string, clusters ...string) {
	t.Helper()
	var res []types.Resource
	for _, c := range clusters {
		res = append(res, &clusterv3.Cluster{Name: c})
	}
	snap, err := cachev3.NewSnapshot(version, map[resource.Type][]types.Resource{resource.ClusterType: res})
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.cache.SetSnapshot(context.Background(), NodeID, snap); err != nil {
		t.Fatal(err)
	}
}

// SotWRequests and DeltaRequests return what the server read so far.
func (cp *ControlPlane) SotWRequests() []*discovery.DiscoveryRequest {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return slices.Clone(cp.sotw)
}

func (cp *ControlPlane) DeltaRequests() []*discovery.DeltaDiscoveryRequest {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return slices.Clone(cp.delta)
}

// WaitFor polls cond (a control plane's record, a client's state) every 5
// ms until it holds, failing the test when ctx ends first.
func WaitFor(t testing.TB, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("%s: never happened", what)
		case <-time.After(5 * time.Millisecond):
		}
	}
}
