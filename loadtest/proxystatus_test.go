package loadtest

import (
	"context"
	"io"
	"testing"
)

// TestProxyStatus runs the proxy-status benchmark small: every Envoy of
// the tier is listed by both queries (RunProxyStatus checks the counts),
// and the report is filled in.
func TestProxyStatus(t *testing.T) {
	cfg := ProxyStatusConfig{Relays: 3, Envoys: 300, Keys: 10, Queries: 3}
	rep, err := RunProxyStatus(context.Background(), cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if rep.ListEnvoys.P50 <= 0 || rep.Syncz.P50 <= 0 || rep.ListEnvoysBytes <= 0 || rep.SynczBytes <= 0 {
		t.Fatalf("report not filled in: %+v", rep)
	}
}
