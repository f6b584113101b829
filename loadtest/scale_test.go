package loadtest

import (
	"bytes"
	"context"
	"io"
	"os"
	"testing"
	"time"
)

// TestScale runs the scale benchmark tiny: the tier rebalances after a
// relay is added and after one is stopped, the upstream keeps one stream
// per key, and no Envoy sees a protocol violation; plaintext, and over the
// relays' TLS ports (every moved stream a new handshake and token check).
func TestScale(t *testing.T) {
	for _, tls := range []bool{false, true} {
		t.Run(transportName(tls, VerifierLocal), func(t *testing.T) { testScale(t, tls, nil) })
	}
	// The fleet in a child process, pinned apart from this process (the
	// tier) on a machine with two CPUs.
	t.Run("plaintext-fleet-process", func(t *testing.T) {
		requireLinux(t)
		noChildLeft(t)
		testScale(t, false, func(cfg *ScaleConfig) {
			cfg.FleetCommand, cfg.FleetStderr = testFleetCommand, os.Stderr
			if tier, fleet, ok := twoCPUs(t); ok {
				cfg.TierCPUs, cfg.FleetCPUs = tier, fleet
			}
		})
	})
}

func testScale(t *testing.T, tls bool, adjust func(*ScaleConfig)) {
	cfg := DefaultScaleConfig()
	cfg.Scenario.Services, cfg.Scenario.Endpoints, cfg.Scenario.Namespaces = 40, 40, 4
	cfg.Envoys, cfg.Keys, cfg.Changes = 80, 8, 3
	cfg.ChangeGap = 100 * time.Millisecond
	// The benchmark's own bound (DefaultScaleConfig's 3 minutes), not a
	// shorter one: a relay moved away lands at random (one move in four
	// on the new relay), so rebalancing takes rounds of gossip, and on a
	// CPU oversubscribed sixfold (a loaded CI run beside the Istio
	// suites) 80 Envoys took over a minute where they take 3 s on two
	// cores beside two busy loops. Rebalanced is an eventual state; the
	// bound only ends a run that would never get there.
	cfg.TLS = tls
	// At a share of 20 the relays' own margin is √20 ≈ 5 streams (25 %):
	// the 20 % bound of the issue is checked at a share of 30 in
	// shard's TestScaleOutRebalances.
	cfg.Tolerance = 0.3
	if adjust != nil {
		adjust(&cfg)
	}
	allowed, _ := AllowedCPUs()
	var out bytes.Buffer
	rep, err := RunScale(context.Background(), cfg, &out)
	t.Log(out.String())
	if err != nil {
		t.Fatalf("RunScale: %v", err)
	}
	if now, _ := AllowedCPUs(); !now.Equal(allowed) {
		t.Errorf("this process may use CPUs %s after RunScale, want %s as before", now, allowed)
	}
	if rep.Pinning.TierCPUs != cfg.TierCPUs.String() || (len(cfg.FleetCPUs) > 0 && rep.Pinning.FleetCPUs != cfg.FleetCPUs.String()) {
		t.Errorf("pinning %+v, want tier on %q, fleet on %q", rep.Pinning, cfg.TierCPUs, cfg.FleetCPUs)
	}
	if (rep.Fleet != nil) != (cfg.FleetCommand != nil) || rep.Baseline.N != cfg.Changes || rep.EnvoyBytesBaseline == 0 {
		t.Errorf("fleet process figures %v with a fleet command %v, %d baseline changes timed, %d bytes: want figures iff a child, %d changes, bytes",
			rep.Fleet, cfg.FleetCommand != nil, rep.Baseline.N, rep.EnvoyBytesBaseline, cfg.Changes)
	}
	if want := transportName(tls, VerifierLocal); rep.Transport != want {
		t.Errorf("transport %q, want %q", rep.Transport, want)
	}
	if len(rep.Phases) != 2 {
		t.Fatalf("%d phases, want 2", len(rep.Phases))
	}
	for _, p := range rep.Phases {
		if !p.Rebalanced {
			t.Errorf("%s: not rebalanced within %v (streams per relay %v)", p.Name, cfg.PhaseTimeout, p.StreamsPerRelay)
		}
		if p.UpstreamAfter != int64(cfg.Keys) {
			t.Errorf("%s: upstream streams %d after, want %d", p.Name, p.UpstreamAfter, cfg.Keys)
		}
		if p.Violations != 0 {
			t.Errorf("%s: %d protocol violations", p.Name, p.Violations)
		}
		// (Keys moved is not checked: with 8 keys, adding a 4th relay
		// moves none about one time in ten.)
		if p.StreamsMoved == 0 {
			t.Errorf("%s: no Envoy stream moved", p.Name)
		}
	}
	if rep.Phases[0].RelaysAfter != 4 || rep.Phases[1].RelaysAfter != 3 {
		t.Errorf("relays %d then %d, want 4 then 3", rep.Phases[0].RelaysAfter, rep.Phases[1].RelaysAfter)
	}
}

// TestScaleInterruptedStopsAHungFleet interrupts the scale benchmark while
// its fleet child, hung, never answers the start of its Envoys: RunScale
// returns, and the child is killed and waited for.
func TestScaleInterruptedStopsAHungFleet(t *testing.T) {
	requireLinux(t)
	noChildLeft(t)
	cfg := DefaultScaleConfig()
	cfg.Scenario.Services, cfg.Scenario.Endpoints, cfg.Scenario.Namespaces = 10, 10, 2
	cfg.Envoys, cfg.Keys, cfg.Changes = 4, 2, 1
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cfg.FleetCommand = func(fc FleetChildConfig) (string, []string, []string, error) {
		time.AfterFunc(time.Second, cancel) // once the child is starting: a Ctrl-C
		return hungFleetCommand(fc)
	}
	returnsWithin(t, time.Minute, "RunScale", func() {
		if _, err := RunScale(ctx, cfg, io.Discard); err == nil {
			t.Error("RunScale = nil error, want the interruption")
		}
	})
}
