package relay

import (
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
)

func TestSmoke(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocolName(delta), func(t *testing.T) {
			up := newTestUpstream(t, "ns1")
			seed(up, "ns1", 3)
			r := startRelay(t, up, nil)
			c := newRawClient(t, dial(t, r.Addr().String()), delta, node("ns1", "app", 0))
			c.subscribe(typeCluster)
			m := c.recv()
			if got := names(m); len(got) != 3 {
				t.Fatalf("CDS names = %v, want 3", got)
			}
			c.ack(m)
			c.subscribe(typeEndpoint, "c0", "c1")
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
	r := startRelay(t, up, func(c *Config) { c.AdminListen = "127.0.0.1:0" })
	c := newRawClient(t, dial(t, r.Addr().String()), true, node("ns1", "app", 0))
	c.subscribe(typeCluster)
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
}
