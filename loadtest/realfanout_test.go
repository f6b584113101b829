package loadtest

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/realenvoy/install"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
)

// TestRealFanout runs the real-Envoy benchmark tiny, one protocol, both
// modes and the simulated fleet beside them, and checks what holds on any
// machine: every change reached every Envoy (as Envoy stamps it, and
// relayed as the relay's ledger has the ACKs), one upstream stream per
// Envoy direct and per key relayed, the processes measured. No latency is
// asserted.
func TestRealFanout(t *testing.T) {
	requireLinux(t)
	cfg := DefaultRealFanoutConfig()
	cfg.Binary = install.EnvoyBinary(t)
	cfg.Scenario.Services, cfg.Scenario.Endpoints, cfg.Scenario.Namespaces = 20, 20, 2
	cfg.Envoys, cfg.Keys, cfg.Changes = 4, 2, 3
	cfg.Protocols = []envoy.Protocol{envoy.Delta}
	cfg.Settle, cfg.ChangeGap = 100*time.Millisecond, 10*time.Millisecond
	cfg.SyncTimeout, cfg.ChangeTimeout = time.Minute, 30*time.Second
	cfg.StartRelay = testStartRelay(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rep, err := RunRealFanout(ctx, cfg, &out)
	t.Log(out.String())
	if err != nil {
		t.Fatalf("RunRealFanout: %v", err)
	}
	if len(rep.Runs) != 2 || len(rep.Simulated) != 2 {
		t.Fatalf("%d real and %d simulated runs, want 2 of each", len(rep.Runs), len(rep.Simulated))
	}
	for _, r := range rep.Runs {
		want := cfg.Envoys
		if r.Mode == Relayed {
			want = cfg.Keys
		}
		if r.UpstreamStreams != want {
			t.Errorf("%s: %d upstream streams, want %d", r.Mode, r.UpstreamStreams, want)
		}
		if r.ChangesDone != cfg.Changes || r.Applied.N != cfg.Changes*cfg.Envoys || r.AppliedAll.N != cfg.Changes {
			t.Errorf("%s: %d changes done, %d Envoy applications, %d completions; want %d, %d, %d",
				r.Mode, r.ChangesDone, r.Applied.N, r.AppliedAll.N, cfg.Changes, cfg.Changes*cfg.Envoys, cfg.Changes)
		}
		if (r.Mode == Relayed) != (r.Acked != nil && r.Acked.N == cfg.Changes*cfg.Envoys && r.Relay != nil) {
			t.Errorf("%s: ledger ACKs %+v, relay figures %+v", r.Mode, r.Acked, r.Relay)
		}
		if r.EnvoyRSSMean == 0 || r.EnvoyRSSMax < r.EnvoyRSSMean {
			t.Errorf("%s: Envoy RSS mean %d, max %d", r.Mode, r.EnvoyRSSMean, r.EnvoyRSSMax)
		}
	}
	for _, r := range rep.Simulated {
		if r.ChangesDone != cfg.Changes {
			t.Errorf("simulated %s: %d changes done, want %d", r.Mode, r.ChangesDone, cfg.Changes)
		}
	}
}
