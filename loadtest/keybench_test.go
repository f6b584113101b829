package loadtest

import (
	"context"
	"io"
	"testing"
	"time"
)

// TestKeyBenchTiny runs `loadtest keys` small, both ways: keyed by cluster
// the fleet holds one upstream stream, per node one per client; every push
// reaches every client.
func TestKeyBenchTiny(t *testing.T) {
	for _, tc := range []struct {
		profile string
		streams int64
	}{{"fields", 1}, {"per-node", 6}} {
		t.Run(tc.profile, func(t *testing.T) {
			cfg := DefaultKeyBenchConfig()
			cfg.Clients, cfg.Endpoints, cfg.Pushes, cfg.ClientsPerConn, cfg.Profile = 6, 50, 2, 3, tc.profile
			cfg.SyncTimeout, cfg.PushTimeout = time.Minute, time.Minute
			cfg.StartRelay = testStartRelay(t)
			rep, err := RunKeyBench(context.Background(), cfg, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			if rep.UpstreamStreams != tc.streams {
				t.Errorf("upstream streams = %d, want %d", rep.UpstreamStreams, tc.streams)
			}
			if len(rep.Pushes) != 2 || rep.RelaySteadyRSS == 0 || rep.RelayPeakRSS < rep.RelaySteadyRSS {
				t.Errorf("report = %+v, want 2 pushes and the relay's RSS", rep)
			}
		})
	}
}
