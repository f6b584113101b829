package scenario_test

import (
	"context"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/scenario"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/snapshot"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// TestRollUnderChurnInProcess runs the upgrade scenario on an in-process
// tier of three relays, both protocol pairs: every relay restarted in
// turn under churn, no Envoy sees a version go back or a resource it did
// not ask for, and every one ends with the upstream's config.
// loadtest's TestRollUnderChurnProcesses runs the same scenario on the
// meshrelay binaries.
func TestRollUnderChurnInProcess(t *testing.T) {
	for _, pair := range []struct {
		name   string
		envoys envoy.Protocol
		up     relay.Protocol
	}{
		{"sotw-envoys/delta-upstream", envoy.SotW, relay.ProtocolDelta},
		{"delta-envoys/sotw-upstream", envoy.Delta, relay.ProtocolSotW},
	} {
		t.Run(pair.name, func(t *testing.T) {
			ctx := t.Context()
			sc := upstream.Scenario{Services: 30, Endpoints: 60, Namespaces: 3, LocalFraction: 0.25}
			up := startUpstream(t, sc)
			// Snapshots in etcd, as a tier is run: a relay that drains a
			// SotW Envoy hands its version over there, so the relay it
			// moves to knows what it holds.
			etcd, err := snapshot.StartEmbedded(ctx, snapshot.EmbeddedConfig{Dir: t.TempDir()})
			if err != nil {
				t.Fatal(err)
			}
			defer etcd.Close()
			tier, err := cluster.StartConvergedTier(ctx, cluster.TierConfig{Relays: 3, Upstream: up.Addr(), UpstreamProtocol: pair.up, Etcd: etcd.Endpoints()}, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			defer tier.Stop(context.Background())
			fleet := traffic.FleetConfig{Scenario: sc, Envoys: 24, Keys: 6, Protocol: pair.envoys}
			if err := scenario.RollUnderChurn(ctx, tier, up, fleet, 10, 2*time.Minute); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// startUpstream starts a synthetic upstream of sc on loopback, stopped at
// the test's end.
func startUpstream(t *testing.T, sc upstream.Scenario) *upstream.Upstream {
	t.Helper()
	cfg := upstream.DefaultConfig()
	cfg.Scenario = sc
	up, err := upstream.Start(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { up.Stop(context.Background()) })
	return up
}
