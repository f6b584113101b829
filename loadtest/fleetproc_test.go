package loadtest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/traffic"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// fleetChildEnv, when set in the environment, makes this test binary a
// fleet child: TestFleetChildProcess runs RunFleetChild with the
// FleetChildConfig (JSON) it holds, its observations on file descriptor 3,
// and exits (the helper-process pattern, as relayChildEnv).
const fleetChildEnv = "MESHRELAY_FLEET_CHILD"

func TestFleetChildProcess(t *testing.T) {
	runHelper(t, fleetChildEnv, func(ctx context.Context, raw string) error {
		var cfg FleetChildConfig
		if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
			return err
		}
		obs := os.NewFile(3, "observations")
		defer obs.Close()
		return RunFleetChild(ctx, cfg, os.Stdin, os.Stdout, obs)
	})
}

// testFleetCommand runs a fleet child by re-executing the test binary.
func testFleetCommand(cfg FleetChildConfig) (string, []string, []string, error) {
	b, err := json.Marshal(cfg)
	if err != nil {
		return "", nil, nil, err
	}
	return os.Args[0], []string{"-test.run=^TestFleetChildProcess$"}, []string{fleetChildEnv + "=" + string(b)}, nil
}

// startTestUpstream starts a synthetic upstream of cfg, stopped when t
// ends.
func startTestUpstream(t *testing.T, ctx context.Context, cfg upstream.Config) *upstream.Upstream {
	t.Helper()
	up, err := upstream.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := up.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = up.Stop(context.Background()) })
	return up
}

// twoCPUs returns two CPUs this process may use, or skips the pinning
// part of a test (skip says so) on a machine with fewer.
func twoCPUs(t *testing.T) (relay, fleet CPUSet, ok bool) {
	t.Helper()
	all, err := AllowedCPUs()
	if err != nil || len(all) < 2 {
		t.Logf("SKIP pinning: this process may use CPUs %s (%v), want at least 2; running unpinned", all, err)
		return nil, nil, false
	}
	return CPUSet{all[0]}, CPUSet{all[1]}, true
}

// noChildLeft fails t, when it ends, if a process this test process
// started after the call is still there (a zombie counts too), and kills
// the live ones: it runs even when the test fails.
func noChildLeft(t *testing.T) {
	t.Helper()
	before := map[int]bool{}
	pids, err := childPids(os.Getpid())
	if err != nil {
		t.Fatalf("list child processes: %v", err)
	}
	for _, p := range pids {
		before[p] = true
	}
	t.Cleanup(func() {
		pids, err := childPids(os.Getpid())
		if err != nil {
			t.Errorf("list child processes: %v", err)
			return
		}
		for _, p := range pids {
			if before[p] {
				continue
			}
			t.Errorf("child process %d left behind", p)
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
	})
}

// childPids lists the processes whose parent is ppid, from /proc.
func childPids(ppid int) ([]int, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue // gone meanwhile
		}
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:])) // state, ppid, …
		if len(f) < 2 {
			continue
		}
		if p, err := strconv.Atoi(f[1]); err == nil && p == ppid {
			out = append(out, pid)
		}
	}
	return out, nil
}

// TestFleetProcess drives a fleet child directly: pinned from its start
// (every thread), synced, a change timed through this process's Tracker
// from the ACKs it streams, its counters; Stop ends it, and so does EOF
// on its stdin.
func TestFleetProcess(t *testing.T) {
	requireLinux(t)
	noChildLeft(t)
	_, cpus, pinned := twoCPUs(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	tracker := traffic.NewTracker()
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario.Services, ucfg.Scenario.Endpoints, ucfg.Scenario.Namespaces = 20, 20, 2
	ucfg.OnPublish = func(c upstream.Change) { tracker.Track(c) }
	up := startTestUpstream(t, ctx, ucfg)

	const envoys = 12
	fcfg := FleetProcessConfig{
		Fleet:   FleetChildConfig{Scenario: ucfg.Scenario, Envoys: envoys, Keys: 4, Protocol: "sotw", Target: up.Addr()},
		Command: testFleetCommand, CPUs: cpus, Tracker: tracker, Stderr: os.Stderr,
	}
	fp, err := StartFleetProcess(ctx, fcfg)
	if err != nil {
		t.Fatalf("StartFleetProcess: %v", err)
	}
	defer fp.Stop(context.Background())
	if pinned {
		if got, err := ProcessCPUs(fp.Pid()); err != nil || !got.Equal(cpus) {
			t.Errorf("ProcessCPUs(fleet child) = %s, %v, want %s", got, err, cpus)
		}
	}
	if _, err := fp.Figures(ctx); err == nil || !strings.Contains(err.Error(), "before start") {
		t.Errorf("Figures before Start: error %v, want one saying it comes before start", err)
	}
	if err := fp.Start(ctx); err != nil {
		t.Fatalf("Start: %v", err)
	}
	sctx, scancel := context.WithTimeout(ctx, 30*time.Second)
	err = fp.WaitSynced(sctx, up)
	scancel()
	if err != nil {
		t.Fatalf("WaitSynced: %v", err)
	}
	if n := fp.Observed(); n != 0 {
		t.Errorf("%d observations streamed during the sync, want 0 (nothing tracked yet)", n)
	}
	if err := fp.Track(ctx, up.Generation()); err != nil {
		t.Fatalf("Track: %v", err)
	}
	c, err := up.MoveEndpoint(movable(ucfg.Scenario)[0])
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-tracker.Track(c):
	case <-ctx.Done():
		t.Fatalf("change not ACKed by every Envoy: %v", ctx.Err())
	}
	if per, complete, _ := tracker.Results(); per.N != envoys || complete.N != 1 {
		t.Errorf("tracker: %d ACKs and %d completions, want %d and 1", per.N, complete.N, envoys)
	}
	fig, err := fp.Figures(ctx)
	if err != nil || fig.Envoys != envoys || fig.Connected != envoys || fig.Violations != 0 || fig.BytesReceived == 0 {
		t.Errorf("Figures() = %+v, %v, want %d Envoys all connected, bytes, no violation", fig, err, envoys)
	}
	counters, err := fp.Counters(ctx)
	if err != nil || counters.Bytes[0] == 0 {
		t.Errorf("Counters() = %+v, %v, want %d Envoys' bytes", counters, err, envoys)
	}
	pid := fp.Pid()
	if err := fp.Stop(ctx); err != nil {
		t.Errorf("Stop: %v", err)
	}
	if err := fp.Stop(ctx); err != nil {
		t.Errorf("second Stop: %v", err)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err == nil {
		t.Errorf("fleet child %d still exists after Stop", pid)
	}

	// EOF on its stdin (what it sees when the parent dies) ends it.
	fp, err = StartFleetProcess(ctx, fcfg)
	if err != nil {
		t.Fatalf("StartFleetProcess: %v", err)
	}
	defer fp.Stop(context.Background())
	if err := fp.Start(ctx); err != nil {
		t.Fatalf("Start: %v", err)
	}
	fp.child.mu.Lock()
	fp.child.stopped = true
	fp.child.stdin.Close()
	fp.child.mu.Unlock()
	select {
	case <-fp.child.Exited():
		if err := fp.child.exitErr(); err != nil {
			t.Errorf("fleet child exit on stdin EOF: %v, want status 0", err)
		}
	case <-time.After(30 * time.Second):
		t.Errorf("fleet child still running 30s after its stdin closed")
	}
}

func TestObservationsRoundTrip(t *testing.T) {
	at := time.Unix(1700000000, 123456789)
	in := []observation{
		{envoy: 0, kind: obsACKed, typeURL: envoy.EndpointType, at: at, names: []string{"a", "b"}, gens: []uint64{7, 9}},
		{envoy: 3, kind: obsDeclared, typeURL: envoy.ClusterType, at: at.Add(time.Millisecond), names: []string{"a"}, gens: []uint64{1 << 40}},
		{envoy: 2, kind: obsACKed, typeURL: envoy.EndpointType, at: at, names: []string{"b"}, gens: []uint64{10}},
	}
	var buf bytes.Buffer
	enc := obsEncoder{ids: map[string]uint64{}}
	for _, ob := range in {
		if err := enc.encode(&buf, ob); err != nil {
			t.Fatal(err)
		}
	}
	var got []observation
	err := readObservations(&buf, 4, func(i int, ev envoy.Event) {
		kind := byte(obsACKed)
		if ev.Kind == envoy.Declared {
			kind = obsDeclared
		}
		got = append(got, observation{envoy: i, kind: kind, typeURL: ev.TypeURL, at: ev.At, names: ev.Names, gens: ev.Generations})
	})
	if err != nil {
		t.Fatalf("readObservations: %v", err)
	}
	if fmt.Sprint(got) != fmt.Sprint(in) {
		t.Errorf("readObservations = %v, want %v", got, in)
	}
	for i := range got {
		if !got[i].at.Equal(in[i].at) {
			t.Errorf("observation %d at %v, want %v", i, got[i].at, in[i].at)
		}
	}
	// An Envoy index out of range, and a stream cut inside a record.
	buf.Reset()
	_ = (&obsEncoder{ids: map[string]uint64{}}).encode(&buf, in[1])
	if err := readObservations(bytes.NewReader(buf.Bytes()), 3, func(int, envoy.Event) {}); err == nil {
		t.Errorf("readObservations of Envoy 3 of 3: no error")
	}
	if err := readObservations(bytes.NewReader(buf.Bytes()[:buf.Len()-1]), 4, func(int, envoy.Event) {}); err == nil {
		t.Errorf("readObservations of a truncated stream: no error")
	}
}

// FuzzReadObservations: whatever the stream, the decoder returns (no
// panic, no allocation beyond its bounds) and hands out only Envoys in
// range with as many generations as names.
func FuzzReadObservations(f *testing.F) {
	var buf bytes.Buffer
	enc := obsEncoder{ids: map[string]uint64{}}
	_ = enc.encode(&buf, observation{envoy: 1, kind: obsACKed, typeURL: envoy.EndpointType, at: time.Unix(1, 2), names: []string{"x"}, gens: []uint64{3}})
	f.Add(buf.Bytes())
	f.Add([]byte{obsString, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add([]byte{obsRecord, 0, obsACKed, 0})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		_ = readObservations(bytes.NewReader(b), 4, func(i int, ev envoy.Event) {
			if i < 0 || i >= 4 || len(ev.Names) != len(ev.Generations) || len(ev.Names) == 0 {
				t.Fatalf("emitted Envoy %d with %d names and %d generations", i, len(ev.Names), len(ev.Generations))
			}
		})
	})
}

func TestHoldingsDigest(t *testing.T) {
	a := map[traffic.ResourceKey]uint64{"c|x": 1, "e|x": 2, "e|y": 2}
	b := map[traffic.ResourceKey]uint64{"e|y": 2, "c|x": 1, "e|x": 2}
	if digestOf(a) != digestOf(b) {
		t.Errorf("digest depends on order: %v, %v", digestOf(a), digestOf(b))
	}
	for _, m := range []map[traffic.ResourceKey]uint64{
		{"c|x": 1, "e|x": 3, "e|y": 2}, // a generation differs
		{"c|x": 1, "e|x": 2},           // one missing
		{"c|x": 1, "e|x": 2, "e|z": 2}, // another name
	} {
		if digestOf(m) == digestOf(a) {
			t.Errorf("digestOf(%v) = digestOf(%v)", m, a)
		}
	}
}
