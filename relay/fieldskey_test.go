package relay

import (
	"context"
	"fmt"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// A go-control-plane fleet (ids of its own, one node.cluster, no Istio
// metadata) aggregates under a fields profile keyed by cluster: one
// upstream stream per cluster, every client served. The istio profile
// does not recognise the ids and gives each its own stream.
func TestFieldsProfileAggregatesAFleet(t *testing.T) {
	byCluster, err := aggkey.ParseKeyFields("cluster")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		profile aggkey.Profile
		streams int
	}{
		{"fields by cluster", byCluster, 2},
		{"istio", aggkey.Istio{}, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := newTestUpstream(t)
			eds := seedN(up, "default", 3)
			r := startRelay(t, up, func(c *Config) { c.KeyProfile = tc.profile })
			conn := dial(t, r.Addr().String())
			for i, cluster := range []string{"bench", "bench", "bench", "other"} {
				c := newRawClient(t, conn, true, &core.Node{Id: fmt.Sprintf("sidecar-%d.bench", i), Cluster: cluster})
				c.subscribe(xds.TypeEndpoint, eds...)
				if got := names(c.recvDelta(xds.TypeEndpoint)); len(got) != len(eds) {
					t.Fatalf("client %d got %v, want %v", i, got, eds)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			waitCtx(ctx, t, fmt.Sprintf("%d upstream streams", tc.streams), func() bool {
				open, opened := up.streams()
				return open == tc.streams && opened == tc.streams
			})
		})
	}
}
