package realistio

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestBenchTiny runs the benchmark against the real istiod at its
// smallest (4 sidecars of 2 workloads, 20 ServiceEntries) and checks
// what it found, not how fast: every sidecar synced in full, direct and
// through the tier; the tier opened at most one stream to istiod per
// key; the edit reached every sidecar both times.
func TestBenchTiny(t *testing.T) {
	bins := binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cfg := DefaultBenchConfig()
	cfg.Sidecars, cfg.Workloads, cfg.Services = 4, 2, 20
	cfg.Settle = 500 * time.Millisecond
	cfg.SyncTimeout, cfg.ChangeTimeout = 2*time.Minute, time.Minute
	cfg.Binaries, cfg.Dir, cfg.Log = bins, t.TempDir(), testLog{t}
	res, err := Bench(ctx, cfg)
	if res != nil {
		var out strings.Builder
		PrintBench(&out, res)
		t.Logf("\n%s", out.String())
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, run := range []struct {
		name string
		r    BenchRun
	}{{"direct", res.Direct}, {"relayed", res.Relayed}} {
		if run.r.Synced != cfg.Sidecars {
			t.Errorf("%s: %d sidecars synced, want %d", run.name, run.r.Synced, cfg.Sidecars)
		}
		if run.r.ChangeReached != cfg.Sidecars {
			t.Errorf("%s: the edit reached %d sidecars, want %d", run.name, run.r.ChangeReached, cfg.Sidecars)
		}
	}
	if got := res.Direct.IstiodStreams; got != cfg.Sidecars {
		t.Errorf("direct: istiod counts %d streams, want one per sidecar (%d)", got, cfg.Sidecars)
	}
	if got := res.Relayed.IstiodStreamsEnd; got > cfg.Workloads || got == 0 {
		t.Errorf("relayed: istiod counts %d streams after the edit, want 1..%d (one per key at most)", got, cfg.Workloads)
	}
	if got := res.Relayed.Keys; got != cfg.Workloads {
		t.Errorf("relayed: the relays own %d keys, want %d (one per workload)", got, cfg.Workloads)
	}
}

// testLog writes each line to the test's log.
type testLog struct{ t *testing.T }

func (l testLog) Write(b []byte) (int, error) {
	l.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// sumMetric reads a Prometheus text page: every sample of the metric,
// not those of a metric its name prefixes, filtered by label.
func TestSumMetric(t *testing.T) {
	page := `# HELP pilot_xds Number of endpoints connected to this pilot using XDS.
# TYPE pilot_xds gauge
pilot_xds{version="1.31.0"} 3
pilot_xds{version="unknown"} 2
pilot_xds_pushes{type="cds"} 40
meshrelay_keys_by_source{source="peer"} 4
meshrelay_keys_by_source{source="upstream"} 6
meshrelay_ring_members 3
`
	for _, tt := range []struct {
		metric, label string
		want          float64
	}{
		{"pilot_xds", "", 5},
		{"meshrelay_keys_by_source", `source="upstream"`, 6},
		{"meshrelay_ring_members", "", 3},
		{"absent", "", 0},
	} {
		got, err := sumMetric(strings.NewReader(page), tt.metric, tt.label)
		if err != nil || got != tt.want {
			t.Errorf("sumMetric(%q, %q) = %v, %v, want %v", tt.metric, tt.label, got, err, tt.want)
		}
	}
}
