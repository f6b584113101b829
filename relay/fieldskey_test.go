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
	byCluster := keyedByCluster(t)
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
			r := startRelay(t, up, func(c *Config) { c.Keys.Profile = tc.profile })
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

// keyedByCluster is the fields profile keying nodes by node.cluster.
func keyedByCluster(t *testing.T) aggkey.Profile {
	t.Helper()
	p, err := aggkey.ParseKeyFields("cluster")
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// A relay whose keys each serve one Envoy says so, naming how many; one
// whose keys aggregate does not, and its metric counts them aggregated.
func TestAggregationOffIsVisible(t *testing.T) {
	byCluster := keyedByCluster(t)
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
				c.Keys.Profile, c.Logger, c.Keys.AggregationWarnInterval, c.Admin.Listen = tc.profile, logs.logger(), 10*time.Millisecond, "127.0.0.1:0"
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

// Streams to the upstream open at Config.Upstream.StreamRate: at one per
// ten seconds (a bucket of one), the first of three per-node keys opens
// its stream and is served; the other two wait their turn, while the
// first key's further Envoys are served by its one stream.
func TestUpstreamStreamRate(t *testing.T) {
	up := newTestUpstream(t)
	eds := seedN(up, "default", 1)
	r := startRelay(t, up, func(c *Config) {
		c.Keys.Profile, c.Upstream.StreamRate = aggkey.PerNode{}, 0.1
	})
	conn := dial(t, r.Addr().String())
	first := newRawClient(t, conn, true, &core.Node{Id: "sidecar-0.bench"})
	first.subscribe(xds.TypeEndpoint, eds...)
	first.recvDelta(xds.TypeEndpoint)
	for i := range 2 {
		c := newRawClient(t, conn, true, &core.Node{Id: fmt.Sprintf("sidecar-%d.bench", i+1)})
		c.subscribe(xds.TypeEndpoint, eds...)
	}
	again := newRawClient(t, conn, true, &core.Node{Id: "sidecar-0.bench"})
	again.subscribe(xds.TypeEndpoint, eds...)
	again.recvDelta(xds.TypeEndpoint) // same key: no new stream needed
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	waitCtx(ctx, t, "two keys waiting their turn", func() bool { return r.Stats().UpstreamWaiting == 2 })
	if open, opened := up.streams(); open != 1 || opened != 1 {
		t.Fatalf("upstream streams open %d, opened %d; want 1: the other keys wait their turn", open, opened)
	}
}
