package envoy

import (
	"context"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// refusingADS refuses every stream with PermissionDenied, as the relay's
// TLS port refuses a token of another namespace, and records the
// authorization metadata each stream came with.
type refusingADS struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	mu   sync.Mutex
	auth [][]string
}

func (a *refusingADS) refuse(ctx context.Context) error {
	md, _ := metadata.FromIncomingContext(ctx)
	a.mu.Lock()
	a.auth = append(a.auth, md.Get("authorization"))
	a.mu.Unlock()
	return status.Error(codes.PermissionDenied, "authorization failed")
}

func (a *refusingADS) StreamAggregatedResources(s discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	return a.refuse(s.Context())
}

func (a *refusingADS) DeltaAggregatedResources(s discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	return a.refuse(s.Context())
}

// Config.Metadata goes out on every stream, reconnects included, and a
// refused stream's status is what Stats.LastErr holds.
func TestMetadataOnEveryStream(t *testing.T) {
	for _, p := range protocols {
		t.Run(p.String(), func(t *testing.T) {
			a := &refusingADS{}
			cfg := DefaultConfig()
			cfg.Node = &core.Node{Id: testNodeID}
			cfg.Conn = startFake(t, a)
			cfg.Protocol = p
			cfg.Metadata = metadata.Pairs("authorization", "Bearer tok")
			cfg.Backoff = Backoff{Base: 10 * time.Millisecond, Max: 20 * time.Millisecond}
			e, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := e.Start(ctx); err != nil {
				t.Fatal(err)
			}
			err = e.WaitFor(ctx, func(v View) bool { return v.Stats().Reconnects >= 2 })
			if stopErr := e.Stop(context.Background()); stopErr != nil {
				t.Fatal(stopErr)
			}
			if err != nil {
				t.Fatalf("WaitFor 2 reconnects: %v", err)
			}
			st := e.Stats()
			if got := status.Code(st.LastErr); got != codes.PermissionDenied {
				t.Errorf("Stats().LastErr = %v (%s), want PermissionDenied", st.LastErr, got)
			}
			if st.Responses != 0 {
				t.Errorf("Stats().Responses = %d, want 0", st.Responses)
			}
			a.mu.Lock()
			defer a.mu.Unlock()
			if len(a.auth) < 2 {
				t.Fatalf("%d streams seen, want at least 2", len(a.auth))
			}
			for i, got := range a.auth {
				if len(got) != 1 || got[0] != "Bearer tok" {
					t.Errorf("stream %d: authorization %q, want [\"Bearer tok\"]", i, got)
				}
			}
		})
	}
}
