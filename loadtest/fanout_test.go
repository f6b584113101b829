package loadtest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/report"
)

// relayChildEnv, when set in the environment, makes this test binary a
// relay child: TestRelayChildProcess runs RunRelayChild with the
// RelayChildConfig (JSON) it holds and exits. This is the helper-process
// pattern of Go's own os/exec tests; it needs no TestMain.
const relayChildEnv = "MESHRELAY_RELAY_CHILD"

func TestRelayChildProcess(t *testing.T) {
	runHelper(t, relayChildEnv, func(ctx context.Context, raw string) error {
		var cfg RelayChildConfig
		if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
			return err
		}
		return RunRelayChild(ctx, cfg, os.Stdin, os.Stdout, os.Stderr)
	})
}

// testStartRelay starts a relay child by re-executing the test binary.
func testStartRelay(t *testing.T) StartRelayFunc {
	return func(ctx context.Context, cfg RelayChildConfig) (*Child, error) {
		b, err := json.Marshal(cfg)
		if err != nil {
			return nil, err
		}
		return StartChild(ctx, ChildConfig{
			Path:   os.Args[0],
			Args:   []string{"-test.run=^TestRelayChildProcess$"},
			Env:    []string{relayChildEnv + "=" + string(b)},
			Stderr: os.Stderr,
			CPUs:   cfg.CPUs,
		})
	}
}

// tinyFanoutConfig is a fan-out of services services (one endpoint each)
// in namespaces namespaces, envoys Envoys over keys keys, changes changes,
// paced for a test: all connecting at once, short pauses, bounded waits.
func tinyFanoutConfig(services, namespaces, envoys, keys, changes int) FanoutConfig {
	cfg := DefaultFanoutConfig()
	cfg.Scenario.Services, cfg.Scenario.Endpoints, cfg.Scenario.Namespaces = services, services, namespaces
	cfg.Envoys, cfg.Keys, cfg.Changes = envoys, keys, changes
	cfg.StartRate = 0
	cfg.Settle, cfg.ChangeGap = 100*time.Millisecond, 10*time.Millisecond
	cfg.SyncTimeout, cfg.ChangeTimeout = 30*time.Second, 20*time.Second
	return cfg
}

// runTinyFanout runs cfg within 2 minutes, logs what it printed, and
// fails t unless it succeeded with one run for each of the comma-separated
// runs.
func runTinyFanout(t *testing.T, cfg FanoutConfig, runs string) *FanoutReport {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rep, err := RunFanout(ctx, cfg, &out)
	t.Log(out.String())
	if err != nil {
		t.Fatalf("RunFanout: %v", err)
	}
	if want := len(strings.Split(runs, ",")); len(rep.Runs) != want {
		t.Fatalf("len(Runs) = %d, want %d (%s)", len(rep.Runs), want, runs)
	}
	return rep
}

// checkEveryChange fails t unless run r synced, timed every change of
// cfg at every Envoy, and saw no protocol violation.
func checkEveryChange(t *testing.T, cfg FanoutConfig, r FanoutRun) {
	t.Helper()
	if !r.Synced || r.ChangesDone != cfg.Changes || r.ChangesTimedOut != 0 {
		t.Errorf("%s: synced %v, changes done %d, timed out %d, want true, %d, 0", r.Mode, r.Synced, r.ChangesDone, r.ChangesTimedOut, cfg.Changes)
	}
	if r.ACK.N != cfg.Changes*cfg.Envoys || r.Complete.N != cfg.Changes {
		t.Errorf("%s: %d (change, Envoy) ACKs and %d completions timed, want %d and %d", r.Mode, r.ACK.N, r.Complete.N, cfg.Changes*cfg.Envoys, cfg.Changes)
	}
	if r.Violations != 0 {
		t.Errorf("%s: %d protocol violations: %v", r.Mode, r.Violations, r.ViolationSamples)
	}
}

func requireLinux(t *testing.T) {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc: Linux only")
	}
}

// TestFanout runs the benchmark at a tiny scale, once per protocol, and
// checks what must hold whatever the machine's speed: stream counts, every
// change reaching every Envoy, no protocol violation, the relay process
// measured. It asserts no latency.
func TestFanout(t *testing.T) {
	requireLinux(t)
	for _, p := range []envoy.Protocol{envoy.Delta, envoy.SotW} {
		t.Run(p.String(), func(t *testing.T) {
			cfg := tinyFanoutConfig(30, 3, 30, 3, 3)
			cfg.Protocols = []envoy.Protocol{p}
			cfg.StartRelay = testStartRelay(t)
			rep := runTinyFanout(t, cfg, "direct, relayed")
			for _, r := range rep.Runs {
				wantStreams := int64(cfg.Envoys)
				if r.Mode == Relayed {
					wantStreams = int64(cfg.Keys)
				}
				if r.UpstreamStreams.AfterSync != wantStreams || r.UpstreamStreams.AtEnd != wantStreams {
					t.Errorf("%s: upstream streams = %d after sync, %d at end, want %d", r.Mode, r.UpstreamStreams.AfterSync, r.UpstreamStreams.AtEnd, wantStreams)
				}
				checkEveryChange(t, cfg, r)
				if r.UpstreamBytesSync == 0 || r.EnvoyBytesSync == 0 || r.EnvoyBytesChanges == 0 {
					t.Errorf("%s: bytes upstream %d, Envoys %d (sync), Envoys %d (changes): want all > 0", r.Mode, r.UpstreamBytesSync, r.EnvoyBytesSync, r.EnvoyBytesChanges)
				}
				if r.Loadtest.Err != "" || r.Loadtest.RSSPeak == 0 {
					t.Errorf("%s: loadtest process figures %+v, want RSS and no error", r.Mode, r.Loadtest)
				}
				switch r.Mode {
				case Direct:
					if r.Relay != nil {
						t.Errorf("direct: relay figures %+v, want none", r.Relay)
					}
				case Relayed:
					switch {
					case r.Relay == nil:
						t.Errorf("relayed: no relay figures")
					case r.Relay.Err != "" || r.Relay.RSSPeak == 0 || r.Relay.RSSEnd == 0 || r.Relay.CPUSyncS+r.Relay.CPUChangesS <= 0:
						t.Errorf("relayed: relay figures %+v, want RSS > 0, CPU > 0 and no error", *r.Relay)
					}
				}
			}
			var relayedVerdicts int
			for _, v := range rep.Verdicts {
				if v.Protocol != p.String() {
					t.Errorf("verdict for %q in a %s run", v.Protocol, p)
				}
				relayedVerdicts++
			}
			if relayedVerdicts == 0 {
				t.Errorf("no verdicts")
			}
		})
	}
}

// TestChildEnds checks that a relay child never outlives what started it:
// Stop ends it, and so does EOF on its stdin (what it sees when the parent
// dies).
func TestChildEnds(t *testing.T) {
	requireLinux(t)
	start := testStartRelay(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// The relay dials its upstream lazily; nothing listens here.
	cfg := RelayChildConfig{Upstream: "127.0.0.1:1"}

	c, err := start(ctx, cfg)
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	st, err := c.Stat()
	if err != nil || st.RSS == 0 || st.PeakRSS < st.RSS {
		t.Errorf("Stat() = %+v, %v, want RSS > 0 and PeakRSS >= RSS", st, err)
	}
	if err := c.Stop(ctx); err != nil {
		t.Errorf("Stop: %v", err)
	}
	if err := c.Stop(ctx); err != nil {
		t.Errorf("second Stop: %v", err)
	}
	if _, err := ReadProcStat(c.Pid()); err == nil {
		t.Errorf("child %d still exists after Stop", c.Pid())
	}

	c, err = start(ctx, cfg)
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	c.stdin.Close() // as if the parent died
	select {
	case <-c.exited:
		if err := c.exitErr(); err != nil {
			t.Errorf("child exit on stdin EOF: %v, want status 0", err)
		}
	case <-time.After(30 * time.Second):
		t.Errorf("child still running 30s after its stdin closed")
	}
	c.mu.Lock()
	c.stopped = true // stdin already closed
	c.mu.Unlock()
	_ = c.Stop(ctx)
}

func TestParseProcStat(t *testing.T) {
	tests := []struct {
		name, in string
		want     time.Duration
		wantErr  bool
	}{
		{"plain", "1234 (loadtest) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 9 0 100 1000 200 18446744073709551615",
			3250 * time.Millisecond, false},
		{"spaces and parens in comm", "7 (a b) c)) R 1 7 7 0 -1 0 0 0 0 0 1 2 0 0 20 0 1 0 5 6 7", 30 * time.Millisecond, false},
		{"truncated", "7 (x) R 1 2 3", 0, true},
		{"no comm", "7 x R", 0, true},
		{"bad number", "7 (x) R 1 7 7 0 -1 0 0 0 0 0 zz 2 0", 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseProcStat([]byte(tt.in))
			if (err != nil) != tt.wantErr || got != tt.want {
				t.Errorf("parseProcStat(%q) = %v, %v, want %v, error %v", tt.in, got, err, tt.want, tt.wantErr)
			}
		})
	}
}

func TestParseProcStatus(t *testing.T) {
	tests := []struct {
		name, in  string
		rss, peak uint64
		wantErr   bool
	}{
		{"process", "Name:\tloadtest\nVmPeak:\t 9000 kB\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\nThreads:\t9\n", 1 << 20, 2 << 20, false},
		{"kernel thread", "Name:\tkthreadd\nThreads:\t1\n", 0, 0, true},
		{"bad unit", "VmHWM:\t 2 MB\nVmRSS:\t 1 MB\n", 0, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rss, peak, err := parseProcStatus([]byte(tt.in))
			if (err != nil) != tt.wantErr || rss != tt.rss || peak != tt.peak {
				t.Errorf("parseProcStatus(%q) = %d, %d, %v, want %d, %d, error %v", tt.in, rss, peak, err, tt.rss, tt.peak, tt.wantErr)
			}
		})
	}
}

func TestReadProcStatSelf(t *testing.T) {
	requireLinux(t)
	st, err := ReadProcStat(os.Getpid())
	if err != nil {
		t.Fatalf("ReadProcStat(self): %v", err)
	}
	if st.RSS == 0 || st.PeakRSS < st.RSS {
		t.Errorf("ReadProcStat(self) = %+v, want RSS > 0 and PeakRSS >= RSS", st)
	}
}

// TestFanoutFleetProcess runs the benchmark tiny with the fleet in a child
// process, the relay pinned to one CPU and the fleet to another (on a
// machine with two), and checks that every Envoy synced, that every
// change reached every Envoy through this process's Tracker (the child
// streams the ACKs), that no protocol rule broke, that each child ran
// only on its CPU, and that no child is left.
func TestFanoutFleetProcess(t *testing.T) {
	requireLinux(t)
	noChildLeft(t)
	relayCPUs, fleetCPUs, pinned := twoCPUs(t)
	cfg := tinyFanoutConfig(30, 3, 30, 3, 3)
	cfg.Protocols = []envoy.Protocol{envoy.Delta}
	cfg.FleetCommand, cfg.FleetStderr = testFleetCommand, os.Stderr
	cfg.RelayCPUs, cfg.FleetCPUs = relayCPUs, fleetCPUs
	// The relay's mask, read with another reader than the run's own.
	var relayCPUsSeen []string
	start := testStartRelay(t)
	cfg.StartRelay = func(ctx context.Context, rc RelayChildConfig) (*Child, error) {
		c, err := start(ctx, rc)
		if err == nil {
			s, err := ProcessCPUs(c.Pid())
			relayCPUsSeen = append(relayCPUsSeen, fmt.Sprintf("%s (%v)", s, err))
		}
		return c, err
	}
	rep := runTinyFanout(t, cfg, "direct, relayed")
	if !rep.Pinning.FleetProcess || rep.Pinning.RelayCPUs != relayCPUs.String() || rep.Pinning.FleetCPUs != fleetCPUs.String() {
		t.Errorf("Pinning = %+v, want a fleet process, relay on %q, fleet on %q", rep.Pinning, relayCPUs, fleetCPUs)
	}
	for _, r := range rep.Runs {
		checkEveryChange(t, cfg, r)
		if r.EnvoyBytesSync == 0 || r.EnvoyBytesChanges == 0 {
			t.Errorf("%s: Envoys' bytes %d (sync), %d (changes), want both > 0", r.Mode, r.EnvoyBytesSync, r.EnvoyBytesChanges)
		}
		switch {
		case r.Fleet == nil:
			t.Errorf("%s: no fleet process figures", r.Mode)
		case r.Fleet.Err != "" || r.Fleet.RSSPeak == 0 || r.Fleet.CPUSyncS+r.Fleet.CPUChangesS <= 0:
			t.Errorf("%s: fleet figures %+v, want RSS > 0, CPU > 0 and no error", r.Mode, *r.Fleet)
		case pinned && r.Fleet.CPUs != fleetCPUs.String():
			t.Errorf("%s: fleet child ran on CPUs %q, want %q", r.Mode, r.Fleet.CPUs, fleetCPUs)
		}
		if r.Mode == Relayed {
			switch {
			case r.Relay == nil:
				t.Errorf("relayed: no relay figures")
			case pinned && r.Relay.CPUs != relayCPUs.String():
				t.Errorf("relayed: relay child ran on CPUs %q, want %q", r.Relay.CPUs, relayCPUs)
			}
			if r.RelayCPUPerMBSyncMs <= 0 {
				t.Errorf("relayed: relay CPU per MB sent in the sync = %v, want > 0", r.RelayCPUPerMBSyncMs)
			}
		}
		for _, p := range []*report.Process{r.Relay, r.Fleet} {
			if p == nil || p.Pid == 0 {
				continue
			}
			if _, err := os.Stat(fmt.Sprintf("/proc/%d", p.Pid)); err == nil {
				t.Errorf("%s: child %d still exists after RunFanout", r.Mode, p.Pid)
			}
		}
	}
	if want := []string{relayCPUs.String() + " (<nil>)"}; pinned && (len(relayCPUsSeen) != 1 || relayCPUsSeen[0] != want[0]) {
		t.Errorf("relay child's CPUs read after its start: %q, want %q", relayCPUsSeen, want)
	}
}

// TestRelayChildProfiles drives RunRelayChild's profile commands: "profile
// start" and "profile stop" write the configured CPU profile and then the
// heap profile; "profile start PATH" profiles to PATH alone; EOF on its
// stdin ends it.
func TestRelayChildProfiles(t *testing.T) {
	dir := t.TempDir()
	cfg := RelayChildConfig{Upstream: "127.0.0.1:1", CPUProfile: dir + "/cpu.pprof", HeapProfile: dir + "/heap.pprof"}
	inR, inW := io.Pipe()
	done := make(chan error, 1)
	go func() { done <- RunRelayChild(t.Context(), cfg, inR, io.Discard, io.Discard) }()
	for _, c := range []string{childProfileStart, childProfileStop, childProfileStart + " " + dir + "/named.pprof", childProfileStop} {
		if _, err := io.WriteString(inW, " "+c+" \n"); err != nil {
			t.Fatalf("write %q: %v", c, err)
		}
	}
	inW.Close()
	if err := <-done; err != nil {
		t.Fatalf("RunRelayChild: %v", err)
	}
	for _, name := range []string{"cpu.pprof", "heap.pprof", "named.pprof"} {
		if st, err := os.Stat(dir + "/" + name); err != nil || st.Size() == 0 {
			t.Errorf("profile %s: %v, want a profile written", name, err)
		}
	}
	// Beside the heap profile, what it leaves out.
	if mem, err := os.ReadFile(dir + "/heap.mem.txt"); err != nil || !strings.Contains(string(mem), "goroutines ") || !strings.Contains(string(mem), "stacks ") {
		t.Errorf("heap.mem.txt: %v, %q: want the goroutines and stacks", err, mem)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 4 {
		t.Errorf("%d files written, want 4 (no heap profile for the named CPU profile)", len(ents))
	}
}
