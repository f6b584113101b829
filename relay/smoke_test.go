package relay

import (
	"context"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/xds"
)

func TestSmoke(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocolName(delta), func(t *testing.T) {
			up := newTestUpstream(t, "ns1")
			seed(up, "ns1", 3)
			r := startRelay(t, up, nil)
			c := newRawClient(t, dial(t, r.Addr().String()), delta, node("ns1", "app", 0))
			c.subscribe(xds.TypeCluster)
			m := c.recv()
			if got := names(m); len(got) != 3 {
				t.Fatalf("CDS names = %v, want 3", got)
			}
			c.ack(m)
			c.subscribe(xds.TypeEndpoint, "c0", "c1")
			m = c.recv()
			got := names(m)
			slices.Sort(got)
			if !slices.Equal(got, []string{"c0", "c1"}) {
				t.Fatalf("EDS names = %v, want [c0 c1]", got)
			}
			if r, ok := m.(*discovery.DiscoveryResponse); ok {
				t.Logf("EDS version %s", r.GetVersionInfo())
			}
		})
	}
}

// TestAdminEndpoints: health, readiness, metrics and pprof on the admin
// listener.
func TestAdminEndpoints(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	seed(up, "ns1", 1)
	r := startRelay(t, up, func(c *Config) { c.Admin.Listen = "127.0.0.1:0" })
	c := newRawClient(t, dial(t, r.Addr().String()), true, node("ns1", "app", 0))
	c.subscribe(xds.TypeCluster)
	c.ack(c.recv())
	c.quiet()
	base := "http://" + r.AdminAddr().String()
	for _, tc := range []struct{ path, want string }{
		{"/healthz", "ok"},
		{"/healthz", "stale keys: 0 of 1"},
		{"/readyz", "ready"},
		{"/metrics", `meshrelay_xds_clients{protocol="delta"} 1`},
		{"/metrics", `meshrelay_upstream_streams 1`},
		{"/metrics", `meshrelay_xds_pushes_total{type="cds"} 1`},
		{"/metrics", `meshrelay_keys{aggregated="false"} 1`},
		{"/metrics", `meshrelay_keys{aggregated="true"} 0`},
		{"/metrics", "meshrelay_stale_keys 0\n"},
		{"/metrics", `meshrelay_keys_by_source{source="upstream"} 1`},
		{"/metrics", `meshrelay_keys_by_source{source="peer"} 0`},
		{"/healthz", "xds plaintext: "},
		{"/debug/pprof/", "goroutine"},
	} {
		resp, err := http.Get(base + tc.path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), tc.want) {
			t.Errorf("GET %s = %d, want 200 with %q in:\n%.2000s", tc.path, resp.StatusCode, tc.want, body)
		}
	}

	// gRPC on the same port: health (the relay's readiness) and reflection.
	conn := dial(t, r.AdminAddr().String())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	hc, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || hc.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health Check = %v, %v; want SERVING", hc, err)
	}
	if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "nope"}); status.Code(err) != codes.NotFound {
		t.Fatalf("health Check(nope) err = %v, want NotFound", err)
	}
	rs, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	resp, err := rs.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var services []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		services = append(services, s.GetName())
	}
	if !slices.Contains(services, "grpc.health.v1.Health") {
		t.Fatalf("reflection lists %v, want grpc.health.v1.Health among them", services)
	}
	r.MarkNotReady()
	if hc, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || hc.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("health Check while draining = %v, %v; want NOT_SERVING", hc, err)
	}
}
