package loadtest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"image/png"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// tierRelayChildEnv, when set, makes this test binary a tier relay child
// (TestTierRelayChildProcess), its TierRelayChildConfig as JSON.
const tierRelayChildEnv = "MESHRELAY_TIER_RELAY_CHILD"

func TestTierRelayChildProcess(t *testing.T) {
	runHelper(t, tierRelayChildEnv, func(ctx context.Context, raw string) error {
		var cfg TierRelayChildConfig
		if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
			return err
		}
		return RunTierRelayChild(ctx, cfg, os.Stdin, os.Stdout, os.Stderr)
	})
}

// testStartTierRelay starts a tier relay child by re-executing the test
// binary.
func testStartTierRelay(ctx context.Context, cfg TierRelayChildConfig, onLine func(string)) (*Child, error) {
	b, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	return StartChild(ctx, ChildConfig{
		Path:   os.Args[0],
		Args:   []string{"-test.run=^TestTierRelayChildProcess$"},
		Env:    []string{tierRelayChildEnv + "=" + string(b)},
		Stderr: os.Stderr,
		CPUs:   cfg.CPUs,
		OnLine: onLine,
	})
}

// TestCtripQuick runs the Ctrip benchmark tiny (300 + 300 in 2
// namespaces, 3 relay processes, 30 light Envoys over 10 keys, 10 s of
// churn at 10 changes a second) and checks what must hold whatever the
// machine's speed: every Envoy synced, every change reached every Envoy
// that must get it (timed at the Envoys) and the tier's ledger has every
// Envoy on its key's version at the end, the ledger's samples timed ACKs,
// no protocol violation, one upstream stream per key, every relay
// measured, the JSON and PNG written, and no child process left. It
// asserts no latency.
func TestCtripQuick(t *testing.T) {
	requireLinux(t)
	noChildLeft(t)
	cfg := DefaultCtripConfig()
	cfg.Scenario.Services, cfg.Scenario.Endpoints, cfg.Scenario.Namespaces = 300, 300, 2
	cfg.Envoys, cfg.Keys = 30, 10
	cfg.Duration, cfg.Settle, cfg.Interval = 10*time.Second, 200*time.Millisecond, 2*time.Second
	cfg.StartRate, cfg.MaxSyncing = 0, 8
	cfg.SyncTimeout, cfg.ChangeTimeout = time.Minute, 30*time.Second
	cfg.MinAvailable = 1 << 30
	cfg.StartRelay, cfg.FleetCommand, cfg.FleetStderr = testStartTierRelay, testFleetCommand, os.Stderr
	dir := t.TempDir()
	cfg.Plot = filepath.Join(dir, "ctrip.png")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rep, err := RunCtrip(ctx, cfg, &out)
	if rep != nil {
		PrintCtrip(&out, rep)
	}
	t.Log(out.String())
	if err != nil {
		t.Fatalf("RunCtrip: %v", err)
	}

	if !rep.Synced || !rep.FinalSynced {
		t.Errorf("synced %v at the start, %v at the end; want both", rep.Synced, rep.FinalSynced)
	}
	if rep.Changes < 50 || rep.ChangesTimedOut != 0 || rep.Delivered.N != rep.Deliveries || rep.Complete.N != rep.Changes {
		t.Errorf("%d changes, %d timed out, %d of %d deliveries timed, %d completions; want ≥ 50 changes, each at every Envoy that must get it",
			rep.Changes, rep.ChangesTimedOut, rep.Delivered.N, rep.Deliveries, rep.Complete.N)
	}
	if tc := rep.Tier; tc.Envoys != cfg.Envoys || tc.Current != cfg.Envoys || tc.Missing != 0 {
		t.Errorf("tier ledger at the end: %+v, want all %d Envoys current, no relay missing", tc, cfg.Envoys)
	}
	if l := rep.Ledger; l.ACK.N == 0 || l.Histogram.Count == 0 || l.ACK.N != l.Owner.N+l.Peer.N || l.Owner.N == 0 || l.Peer.N == 0 {
		t.Errorf("ledger: %d ACKs timed (%d on the owner, %d via a peer), histogram count %d; want ACKs of both kinds",
			l.ACK.N, l.Owner.N, l.Peer.N, l.Histogram.Count)
	}
	if rep.Violations != 0 {
		t.Errorf("%d protocol violations: %v", rep.Violations, rep.ViolationSamples)
	}
	if rep.UpstreamStreams.AfterSync != int64(cfg.Keys) || rep.UpstreamStreams.AtEnd != int64(cfg.Keys) {
		t.Errorf("upstream streams %d after the sync, %d at the end, want %d (one per key)", rep.UpstreamStreams.AfterSync, rep.UpstreamStreams.AtEnd, cfg.Keys)
	}
	if rep.UpstreamBytesChurn == 0 || rep.EnvoyBytesChurn == 0 || rep.FleetHeapPerEnvoy == 0 {
		t.Errorf("bytes: upstream %d, Envoys %d during the churn, fleet heap %d an Envoy; want all > 0", rep.UpstreamBytesChurn, rep.EnvoyBytesChurn, rep.FleetHeapPerEnvoy)
	}
	if len(rep.Relays) != cfg.Relays {
		t.Fatalf("%d relays reported, want %d", len(rep.Relays), cfg.Relays)
	}
	envoys, owned := 0, 0
	for _, r := range rep.Relays {
		envoys += r.Envoys
		owned += r.UpstreamStreams
		if p := r.Process; p.Err != "" || p.RSSPeak == 0 || p.RSSEnd == 0 || p.CPUSyncS+p.CPUChangesS <= 0 {
			t.Errorf("%s: process figures %+v, want RSS, CPU and no error", r.ID, p)
		}
		if r.HeapSync == 0 || r.HeapEnd == 0 {
			t.Errorf("%s: live heap %d after the sync, %d at the end; want both", r.ID, r.HeapSync, r.HeapEnd)
		}
		if r.SamplerPolls == 0 {
			t.Errorf("%s: its ledger was never sampled", r.ID)
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", r.Process.Pid)); err == nil {
			t.Errorf("%s: process %d still exists after RunCtrip", r.ID, r.Process.Pid)
		}
	}
	if envoys != cfg.Envoys || owned != cfg.Keys {
		t.Errorf("relays hold %d Envoys and own %d keys, want %d and %d", envoys, owned, cfg.Envoys, cfg.Keys)
	}
	if len(rep.Series) == 0 || len(rep.Phases) < 4 {
		t.Errorf("%d seconds in the series, phases %+v; want a timeline", len(rep.Series), rep.Phases)
	}

	// The JSON (as cmd/loadtest writes it) and the PNG.
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		t.Fatalf("encode the report: %v", err)
	}
	jsonPath := filepath.Join(dir, "ctrip.json")
	if err := os.WriteFile(jsonPath, b, 0o644); err != nil {
		t.Fatal(err)
	}
	var back CtripReport
	if raw, err := os.ReadFile(jsonPath); err != nil || json.Unmarshal(raw, &back) != nil || back.Ledger.ACK.N != rep.Ledger.ACK.N {
		t.Errorf("the JSON report does not read back: %v", err)
	}
	f, err := os.Open(cfg.Plot)
	if err != nil {
		t.Fatalf("plot: %v", err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("plot %s: %v", cfg.Plot, err)
	}
	if b := img.Bounds(); b.Dx() < 600 || b.Dy() < 300 {
		t.Errorf("plot is %v, want at least 600×300", b)
	}
	if rep.Plot != cfg.Plot {
		t.Errorf("report names the plot %q, want %q", rep.Plot, cfg.Plot)
	}
}
