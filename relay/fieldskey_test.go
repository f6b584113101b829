package relay

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
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

// A relay whose keys each serve one Envoy says so, naming how many; one
// whose keys aggregate does not, and its metric counts them aggregated.
func TestAggregationOffIsVisible(t *testing.T) {
	byCluster, err := aggkey.ParseKeyFields("cluster")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		profile aggkey.Profile
		want    AggregationReport
	}{
		{"per-node keys", aggkey.PerNode{}, AggregationReport{Keys: 12, Lone: 12}},
		{"keyed by cluster", byCluster, AggregationReport{Keys: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs logBuffer
			up := newTestUpstream(t)
			eds := seedN(up, "default", 1)
			r := startRelay(t, up, func(c *Config) {
				c.KeyProfile, c.Logger, c.AggregationWarnInterval, c.AdminListen = tc.profile, logs.logger(), 10*time.Millisecond, "127.0.0.1:0"
			})
			conn := dial(t, r.Addr().String())
			for i := range 12 {
				c := newRawClient(t, conn, true, &core.Node{Id: fmt.Sprintf("sidecar-%d.bench", i), Cluster: "bench"})
				c.subscribe(xds.TypeEndpoint, eds...)
				c.recvDelta(xds.TypeEndpoint)
			}
			got := r.Aggregation()
			if got.Keys != tc.want.Keys || got.Lone != tc.want.Lone || got.Off() != (tc.want.Lone > 0) {
				t.Fatalf("Aggregation() = %+v, want %d keys, %d lone", got, tc.want.Keys, tc.want.Lone)
			}
			if tc.want.Lone == 0 {
				if got, want := metricsOf(t, r), `meshrelay_keys{aggregated="true"} 1`; !strings.Contains(got, want) {
					t.Fatalf("/metrics lacks %q", want)
				}
				return
			}
			if len(got.Examples) != 3 || !strings.HasPrefix(got.Examples[0], "node/sidecar-") {
				t.Fatalf("Examples = %q, want three per-node keys", got.Examples)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			waitCtx(ctx, t, "the warning", func() bool { return strings.Contains(logs.String(), "aggregation is off for 12 of 12 keys") })
			if got, want := metricsOf(t, r), `meshrelay_keys{aggregated="false"} 12`; !strings.Contains(got, want) {
				t.Fatalf("/metrics lacks %q", want)
			}
		})
	}
}

// metricsOf returns r's /metrics page.
func metricsOf(t *testing.T, r *Relay) string {
	t.Helper()
	resp, err := http.Get("http://" + r.AdminAddr().String() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
