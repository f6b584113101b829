package divergence

import (
	"context"
	"errors"
	"net"
	"slices"
	"testing"
	"testing/synctest"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// confirm is the relay's confirmAfter, the window a Prober is given.
const confirm = 2 * time.Second

// fixedKey is a key whose views, wants and presented node stay as made.
type fixedKey struct {
	views     *views.Set
	wanted    map[string]bool
	presented *core.Node
}

func (k fixedKey) Views() *views.Set       { return k.views }
func (k fixedKey) Wanted() map[string]bool { return k.wanted }
func (k fixedKey) Presented() *core.Node   { return k.presented }

// cluster is a cluster whose content is its connect timeout.
func cluster(name string, timeout time.Duration) *clusterv3.Cluster {
	return &clusterv3.Cluster{Name: name, ConnectTimeout: durationpb.New(timeout)}
}

// keyHolding returns a key that presents presented and holds clusters,
// whole, as its upstream's answer, its views decoded by store as a
// relay's are.
func keyHolding(t *testing.T, store *xds.Store, presented *core.Node, clusters ...*clusterv3.Cluster) fixedKey {
	t.Helper()
	b := ledger.Tree[*xds.Resource]{}.Edit()
	for _, c := range clusters {
		v, err := proto.MarshalOptions{Deterministic: true}.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		r, err := store.Decode(xds.TypeCluster, &anypb.Any{TypeUrl: xds.TypeCluster, Value: v}, "")
		if err != nil {
			t.Fatal(err)
		}
		b.Set(r.Name, r.Hash, r)
	}
	return fixedKey{
		views:     &views.Set{Types: map[string]*views.Type{xds.TypeCluster: {View: b.Tree(), Ready: true, Full: true}}},
		wanted:    map[string]bool{xds.TypeCluster: true},
		presented: presented,
	}
}

// upstream serves clusters to node over an in-memory connection with a
// real go-control-plane server, and returns a connection to it. Call it
// inside the test's bubble; the bubble's end stops both.
func upstream(t *testing.T, node *core.Node, clusters ...*clusterv3.Cluster) *grpc.ClientConn {
	t.Helper()
	snapshots := cachev3.NewSnapshotCache(false, cachev3.IDHash{}, nil)
	res := make([]types.Resource, len(clusters))
	for i, c := range clusters {
		res[i] = c
	}
	snap, err := cachev3.NewSnapshot("1", map[resource.Type][]types.Resource{resource.ClusterType: res})
	if err != nil {
		t.Fatal(err)
	}
	if err := snapshots.SetSnapshot(context.Background(), node.GetId(), snap); err != nil {
		t.Fatal(err)
	}
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, serverv3.NewServer(context.Background(), snapshots, nil))
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	conn, err := grpc.NewClient("passthrough:///upstream",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		srv.Stop()
		<-done
	})
	return conn
}

// TestCheckSettles runs a check against a real upstream on a fake clock
// (testing/synctest): content that is the same is an answer at once; a
// difference counts only once it has lasted settle (3/2 of the confirm
// window), and is then the check's answer, over SotW and Delta alike.
func TestCheckSettles(t *testing.T) {
	presented := &core.Node{Id: "sidecar~10.0.0.1~a.default~default.svc.cluster.local"}
	member := &core.Node{Id: "sidecar~10.0.0.2~b.default~default.svc.cluster.local"}
	settle := 3 * confirm / 2
	for _, tc := range []struct {
		name            string
		key, member     []*clusterv3.Cluster
		want            []string
		atLeast, before time.Duration
	}{
		{
			name:   "the same content",
			key:    []*clusterv3.Cluster{cluster("c0", time.Second), cluster("c1", time.Second)},
			member: []*clusterv3.Cluster{cluster("c0", time.Second), cluster("c1", time.Second)},
			before: confirm / 4,
		},
		{
			name:    "other content of a cluster",
			key:     []*clusterv3.Cluster{cluster("c0", time.Second), cluster("c1", time.Second)},
			member:  []*clusterv3.Cluster{cluster("c0", time.Second), cluster("c1", 5*time.Second)},
			want:    []string{xds.TypeCluster},
			atLeast: settle, before: settle + confirm/4 + time.Millisecond,
		},
		{
			name:    "a cluster of the member's own",
			key:     []*clusterv3.Cluster{cluster("c0", time.Second)},
			member:  []*clusterv3.Cluster{cluster("c0", time.Second), cluster("inbound", time.Second)},
			want:    []string{xds.TypeCluster},
			atLeast: settle, before: settle + confirm/4 + time.Millisecond,
		},
	} {
		for _, delta := range []bool{false, true} {
			t.Run(tc.name+map[bool]string{false: "/sotw", true: "/delta"}[delta], func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) {
					store := xds.NewStore()
					k := keyHolding(t, store, presented, tc.key...)
					p := &Prober{Conn: upstream(t, member, tc.member...), Delta: delta, MaxMsgSize: 4 << 20, Store: store, Confirm: confirm}
					start := time.Now()
					differ, got, err := p.Check(t.Context(), k, member)
					took := time.Since(start)
					if err != nil {
						t.Fatalf("Check = %v", err)
					}
					if got != presented {
						t.Errorf("Check compared with %v, want the presented node", got.GetId())
					}
					if !slices.Equal(differ, tc.want) {
						t.Errorf("Check = %v, want %v", differ, tc.want)
					}
					if took < tc.atLeast || took >= tc.before {
						t.Errorf("Check took %v, want [%v, %v)", took, tc.atLeast, tc.before)
					}
				})
			})
		}
	}
}

// TestCheckNeedsComparableViews: a check of a key whose views are not
// its upstream's answer (stale, or a type not yet answered) opens no
// stream, and says so.
func TestCheckNeedsComparableViews(t *testing.T) {
	store := xds.NewStore()
	node := &core.Node{Id: "n"}
	stale := keyHolding(t, store, node, cluster("c0", time.Second))
	stale.views.Stale = true
	unanswered := keyHolding(t, store, node, cluster("c0", time.Second))
	unanswered.wanted = map[string]bool{xds.TypeCluster: true, xds.TypeListener: true}
	for name, k := range map[string]fixedKey{"stale": stale, "a type unanswered": unanswered} {
		p := &Prober{Store: store, Confirm: confirm, Pace: func(context.Context) error {
			t.Errorf("%s: the check waited for the upstream's pace", name)
			return nil
		}}
		if _, _, err := p.Check(t.Context(), k, node); !errors.Is(err, ErrNotComparable) {
			t.Errorf("%s: Check = %v, want ErrNotComparable", name, err)
		}
	}
}
