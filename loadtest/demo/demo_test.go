package demo

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/realenvoy/install"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestDemo runs the demo briefly, with a relay crashing and coming back on
// schedule and a command typed in, and checks that the tier converged with
// no protocol violation and one upstream stream per key.
func TestDemo(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Envoys, cfg.Keys = 40, 8
	// The schedule ends at 4 s; the rest is slack for a loaded machine (a
	// crash and a warm start each took seconds in full race runs on 2
	// cores, and an event not played before the end fails the test).
	cfg.Duration = 12 * time.Second
	cfg.Schedule = []Event{{At: 2 * time.Second, Action: "kill", Relay: 1}, {At: 4 * time.Second, Action: "start", Relay: 1}}
	cfg.Input = strings.NewReader("stop 7\nadd\nfly away\n")
	if os.Getenv("MESHRELAY_TEST_LOG") != "" {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	var out bytes.Buffer
	if err := Run(context.Background(), cfg, &out); err != nil {
		t.Fatalf("Run: %v\n%s", err, out.String())
	}
	t.Log(out.String())
	for _, want := range []string{
		"schedule: kill relay-1", "schedule: start relay-1",
		"command: add a relay", "command: stop relay-7: no relay-7", `command "fly away"`,
		"changes reached all their Envoys", "upstream streams at the end: 8 for 8 keys", "keys restored from etcd",
		"aggregation: 8 keys, 40 Envoys: 5.0 Envoys a key; 0 keys serve one Envoy",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q", want)
		}
	}
}

func TestParseSchedule(t *testing.T) {
	got, err := ParseSchedule("13s:start:1, 8s:kill:relay-1,16s:add")
	want := []Event{{8 * time.Second, "kill", 1}, {13 * time.Second, "start", 1}, {16 * time.Second, "add", 0}}
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("ParseSchedule = %v, %v; want %v", got, err, want)
	}
	if got, err := ParseSchedule(""); err != nil || len(got) != 0 {
		t.Errorf(`ParseSchedule("") = %v, %v; want nothing`, got, err)
	}
	for _, bad := range []string{"8s", "soon:kill:1", "8s:explode:1", "8s:kill", "8s:kill:x", "-1s:kill:1", "8s:kill:1:2"} {
		if _, err := ParseSchedule(bad); err == nil {
			t.Errorf("ParseSchedule(%q) succeeded, want an error", bad)
		}
	}
}

// TestDemoRealEnvoys: the demo with two real Envoys beside the simulated
// ones ends (once they have their config and the ledger has every Envoy
// current) showing each on a relay and a key, SYNCED, and answering a
// request sent through its own listener.
func TestDemoRealEnvoys(t *testing.T) {
	cfg := DefaultConfig()
	cfg.EnvoyBinary = install.EnvoyBinary(t)
	cfg.Envoys, cfg.Keys, cfg.RealEnvoys = 20, 4, 2
	cfg.Duration, cfg.Schedule, cfg.ChurnRate = 6*time.Second, nil, 0
	var out bytes.Buffer
	if err := Run(context.Background(), cfg, &out); err != nil {
		t.Fatalf("Run: %v\n%s", err, out.String())
	}
	t.Log(out.String())
	_, end, found := strings.Cut(out.String(), "real Envoys at the end:")
	if !found {
		t.Fatal("no final word on the real Envoys")
	}
	lines := strings.Split(end, "\n")
	for j := range cfg.RealEnvoys {
		prefix := fmt.Sprintf("real envoy-%d ", j)
		var last string
		for _, l := range lines {
			if strings.Contains(l, prefix) {
				last = l
			}
		}
		if !strings.Contains(last, "relay-") || !strings.Contains(last, "sidecar/") || !strings.Contains(last, " SYNCED ") || !strings.Contains(last, "GET 200 backend") {
			t.Errorf("the last line of %s is %q: want its relay, its key, SYNCED and GET 200 backend", prefix, last)
		}
	}
	if !strings.Contains(out.String(), "real Envoys: 2;") {
		t.Error("no summary of the real Envoys' requests")
	}
	// The ledger counts them with the others, every one on its key's
	// current version.
	all := cfg.Envoys + cfg.RealEnvoys
	if !strings.Contains(out.String(), fmt.Sprintf("%d of %d Envoys ACKed their key's current version", all, all)) {
		t.Error("the ledger does not have every Envoy, real ones included, on its key's current version")
	}
	// They joined the simulated Envoys' keys: one upstream stream per key.
	if !strings.Contains(out.String(), fmt.Sprintf("upstream streams at the end: %d for %d keys", cfg.Keys, cfg.Keys)) {
		t.Error("the real Envoys did not join the simulated ones' keys")
	}
}

// TestWarmWatchNote: a started relay's note gives the count it restored
// once it is ready (not before), or what it restored so far when it was
// stopped, when the wait is bounded, or when the demo ends.
func TestWarmWatchNote(t *testing.T) {
	t0 := time.Now()
	for _, tc := range []struct {
		name        string
		ready, gone bool
		after       time.Duration
		final       bool
		want        string
		done        bool
	}{
		{"loading", false, false, time.Second, false, "", false},
		{"ready", true, false, time.Second, false, "warm: 7 keys restored from etcd", true},
		{"stopped", false, true, time.Second, false, "stopped before it was ready; 7 keys restored from etcd by then", true},
		{"bound", false, false, warmBound, false, "not ready yet; 7 keys restored from etcd so far", true},
		{"end of the demo", false, false, time.Second, true, "not ready yet; 7 keys restored from etcd so far", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := &warmWatch{relay: "relay-1", started: t0,
				ready: func() bool { return tc.ready }, gone: func() bool { return tc.gone }, restored: func() int { return 7 }}
			got, done := w.note(t0.Add(tc.after), tc.final)
			if got != tc.want || done != tc.done {
				t.Errorf("note = %q, %v; want %q, %v", got, done, tc.want, tc.done)
			}
		})
	}
}
