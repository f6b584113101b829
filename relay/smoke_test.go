package relay

import (
	"slices"
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
