package loadtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Helper processes of the chaos suite, started by re-executing the test
// binary (the pattern of TestRelayChildProcess): an etcd member and the
// upstream, each reading its config (JSON) from the environment.
const (
	etcdMemberChildEnv    = "MESHRELAY_ETCD_MEMBER_CHILD"
	chaosUpstreamChildEnv = "MESHRELAY_CHAOS_UPSTREAM_CHILD"
	chaosBinEnv           = "MESHRELAY_CHAOS_BIN"
)

func TestEtcdMemberChildProcess(t *testing.T) {
	runHelper(t, etcdMemberChildEnv, func(ctx context.Context, raw string) error {
		var cfg EtcdMemberConfig
		if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
			return err
		}
		return RunEtcdMemberChild(ctx, cfg, os.Stdin, os.Stdout)
	})
}

func TestChaosUpstreamChildProcess(t *testing.T) {
	runHelper(t, chaosUpstreamChildEnv, func(ctx context.Context, raw string) error {
		var cfg ChaosUpstreamConfig
		if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
			return err
		}
		return RunChaosUpstream(ctx, cfg, os.Stdin, os.Stdout)
	})
}

// runHelper runs main if env is set, and exits; otherwise it skips.
func runHelper(t *testing.T, env string, main func(ctx context.Context, raw string) error) {
	raw := os.Getenv(env)
	if raw == "" {
		t.Skip("helper process; runs only when started by a test")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := main(ctx, raw); err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", env, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// helperStart starts the test binary as the helper test named test, its
// config in env.
func helperStart(ctx context.Context, test, env string, cfg any, log io.Writer, onLine func(string)) (*Child, error) {
	b, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	return StartChild(ctx, ChildConfig{
		Path:         os.Args[0],
		Args:         []string{"-test.run=^" + test + "$"},
		Env:          []string{env + "=" + string(b)},
		Stderr:       log,
		OnLine:       onLine,
		ReadyTimeout: 2 * time.Minute,
	})
}

// TestChaosShort is the short run of `loadtest chaos`: 3 real `meshrelay
// serve` processes (built once, a normal build), a 3-member etcd cluster
// and the upstream, each a process, 16 Envoys, two seeds of three faults
// (together every kind once), each checked by the history checker. It
// asserts order and eventual state, never a latency: the delivery bound
// and the waits are generous, for a loaded 2-core machine.
//
// It needs root (a network namespace of its own, users for the relays)
// and iptables; without root it skips. The test re-executes itself in the
// namespace and the inner run does the work.
func TestChaosShort(t *testing.T) {
	if testing.Short() {
		t.Skip("runs real processes under faults for about 2 minutes")
	}
	requireLinux(t)
	if !InChaosNetns() {
		err := CanCreateNetns()
		if errors.Is(err, ErrNoNetns) {
			t.Skipf("%v", err)
		}
		if err != nil {
			t.Fatal(err)
		}
		dir, err := os.MkdirTemp("", "meshrelay-chaos-bin-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		bin, err := BuildMeshrelay(ctx, dir, os.Stderr)
		if err != nil {
			t.Fatal(err)
		}
		args := []string{"-test.run=^TestChaosShort$", "-test.v", "-test.timeout=20m"}
		if err := ReexecInNetns(ctx, os.Args[0], args, chaosBinEnv+"="+bin); err != nil {
			t.Fatalf("the run in its network namespace failed (its output is above): %v", err)
		}
		return
	}

	cfg := DefaultChaosConfig()
	cfg.Meshrelay = os.Getenv(chaosBinEnv)
	if cfg.Meshrelay == "" {
		t.Fatalf("%s is not set", chaosBinEnv)
	}
	cfg.Seeds = []uint64{1, 2}
	cfg.Faults = 3
	cfg.Envoys, cfg.Keys = 16, 4
	cfg.Scenario.Services, cfg.Scenario.Endpoints = 24, 48
	cfg.Hold = Range{5 * time.Second, 7 * time.Second}
	cfg.Down = Range{time.Second, 2 * time.Second}
	cfg.DeliveryBound = 2 * time.Minute
	cfg.RecoverTimeout = 3 * time.Minute
	cfg.StartEtcdMember = func(ctx context.Context, mc EtcdMemberConfig, log io.Writer) (*Child, error) {
		return helperStart(ctx, "TestEtcdMemberChildProcess", etcdMemberChildEnv, mc, log, nil)
	}
	cfg.StartUpstream = func(ctx context.Context, uc ChaosUpstreamConfig, log io.Writer, onLine func(string)) (*Child, error) {
		return helperStart(ctx, "TestChaosUpstreamChildProcess", chaosUpstreamChildEnv, uc, log, onLine)
	}
	var kinds []string
	for _, s := range cfg.Seeds {
		for _, f := range ChaosSchedule(cfg, s) {
			kinds = append(kinds, string(f.Kind))
		}
	}
	if len(kinds) != len(AllFaults) {
		t.Fatalf("schedules play %v, want every kind once", kinds)
	}
	for _, k := range AllFaults {
		if !strings.Contains(strings.Join(kinds, ","), string(k)) {
			t.Fatalf("schedules play %v: %s missing", kinds, k)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	rep, err := RunChaos(ctx, cfg, os.Stdout)
	if rep != nil {
		PrintChaos(os.Stdout, rep)
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range rep.Seeds {
		if s.Err != "" {
			t.Errorf("seed %d: %s", s.Seed, s.Err)
		}
		for _, v := range s.Violations[:min(len(s.Violations), 5)] {
			t.Errorf("seed %d: %s", s.Seed, v)
		}
		if len(s.Violations) > 5 {
			t.Errorf("seed %d: … %d violations in all (logs in %s)", s.Seed, len(s.Violations), s.Dir)
		}
		if len(s.Faults) != cfg.Faults {
			t.Errorf("seed %d played %d faults, want %d", s.Seed, len(s.Faults), cfg.Faults)
		}
	}
}

// TestChaosSchedule: a seed gives the same schedule every time, and seeds
// 1 … N cover the kinds evenly.
func TestChaosSchedule(t *testing.T) {
	cfg := DefaultChaosConfig()
	cfg.Faults = 4
	a, b := ChaosSchedule(cfg, 7), ChaosSchedule(cfg, 7)
	if fmt.Sprint(a) != fmt.Sprint(b) {
		t.Fatalf("seed 7 gave %v, then %v", a, b)
	}
	count := map[FaultKind]int{}
	for s := uint64(1); s <= 3; s++ {
		for _, f := range ChaosSchedule(cfg, s) {
			count[f.Kind]++
			if f.Kind == FaultCut && f.Target == f.Peer {
				t.Errorf("seed %d cuts relay %d from itself", s, f.Target)
			}
			if (f.Kind == FaultFreeze || f.Kind == FaultCut) && (f.Hold < cfg.Hold.Min || f.Hold > cfg.Hold.Max) {
				t.Errorf("seed %d: %s holds %v, outside %v", s, f.Kind, f.Hold, cfg.Hold)
			}
		}
	}
	for _, k := range AllFaults {
		if count[k] != 2 {
			t.Errorf("seeds 1–3 of 4 faults play %s %d times, want 2 (%v)", k, count[k], count)
		}
	}
}
