package report

import (
	"encoding/json"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestSummarize checks the percentiles by nearest rank: the P-th of n
// sorted samples is the ceil(P·n/100)-th, so P99 of 1 … 100 ms is 99 ms
// (not the maximum) and the median of 1 … 20 ms is 10 ms.
func TestSummarize(t *testing.T) {
	ms := func(n int) []time.Duration {
		var d []time.Duration
		for i := n; i >= 1; i-- { // unsorted: summarize sorts a copy
			d = append(d, time.Duration(i)*time.Millisecond)
		}
		return d
	}
	for _, tc := range []struct {
		name string
		in   []time.Duration
		want Latency
	}{
		{"none", nil, Latency{}},
		{"one", ms(1), Latency{N: 1, P50: time.Millisecond, P95: time.Millisecond, P99: time.Millisecond, Max: time.Millisecond}},
		{"two", ms(2), Latency{N: 2, P50: time.Millisecond, P95: 2 * time.Millisecond, P99: 2 * time.Millisecond, Max: 2 * time.Millisecond}},
		{"20", ms(20), Latency{N: 20, P50: 10 * time.Millisecond, P95: 19 * time.Millisecond, P99: 20 * time.Millisecond, Max: 20 * time.Millisecond}},
		{"100", ms(100), Latency{N: 100, P50: 50 * time.Millisecond, P95: 95 * time.Millisecond, P99: 99 * time.Millisecond, Max: 100 * time.Millisecond}},
		{"1000", ms(1000), Latency{N: 1000, P50: 500 * time.Millisecond, P95: 950 * time.Millisecond, P99: 990 * time.Millisecond, Max: 1000 * time.Millisecond}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Summarize(tc.in); got != tc.want {
				t.Errorf("Summarize(%s) = %+v, want %+v", tc.name, got, tc.want)
			}
		})
	}
}

// TestMachineLines checks the two ways a machine is described: in full
// (fanout, ctrip) and without GOMAXPROCS (warmstart and chaos, whose
// reports hold it as a string).
func TestMachineLines(t *testing.T) {
	m := Machine{CPUs: 8, GOMAXPROCS: 6, GoVersion: "go1.24.1", OS: "linux/amd64", LoadAvg: "0.52 0.61 0.70"}
	if got, want := m.String(), "8 CPUs, GOMAXPROCS 6, go1.24.1, linux/amd64, load average at start 0.52 0.61 0.70"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	if got, want := m.Short(), "8 CPUs, go1.24.1, linux/amd64, load average at start 0.52 0.61 0.70"; got != want {
		t.Errorf("Short() = %q, want %q", got, want)
	}
	if got := ThisMachine(); got.CPUs <= 0 || got.GOMAXPROCS <= 0 || got.GoVersion == "" || got.OS == "" {
		t.Errorf("ThisMachine() = %+v, want every field but the load average set", got)
	}
}

func TestLatencyMs(t *testing.T) {
	l := Latency{N: 3, P50: 1500 * time.Microsecond, P95: 2 * time.Millisecond, P99: 3 * time.Millisecond, Max: time.Second}
	want := LatencyMs{N: 3, P50: 1.5, P95: 2, P99: 3, Max: 1000}
	if got := l.Ms(); got != want {
		t.Errorf("Ms() = %+v, want %+v", got, want)
	}
}

func TestUpstreamStreamsAre(t *testing.T) {
	for _, tc := range []struct {
		s    UpstreamStreams
		n    int
		want bool
	}{
		{UpstreamStreams{AfterSync: 50, AtEnd: 50}, 50, true},
		{UpstreamStreams{AfterSync: 50, AtEnd: 51}, 50, false},
		{UpstreamStreams{AfterSync: 49, AtEnd: 50}, 50, false},
		{UpstreamStreams{}, 0, true},
	} {
		if got := tc.s.Are(tc.n); got != tc.want {
			t.Errorf("%+v.Are(%d) = %v, want %v", tc.s, tc.n, got, tc.want)
		}
	}
}

// TestEmbeddedNames checks that Health and UpstreamStreams, embedded,
// put their fields at the level of the report that embeds them.
func TestEmbeddedNames(t *testing.T) {
	type run struct {
		UpstreamStreams
		Health
	}
	b, err := json.Marshal(run{UpstreamStreams{1, 2}, Health{Reconnects: 3, Violations: 4, ViolationSamples: []string{"x"}}})
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"upstream_streams":1,"upstream_streams_end":2,"envoy_reconnects":3,"violations":4,"violation_samples":["x"]}`
	if string(b) != want {
		t.Errorf("json.Marshal = %s, want %s", b, want)
	}
}

func TestJudge(t *testing.T) {
	if Judge(true) != "PASS" || Judge(false) != "FAIL" {
		t.Errorf("Judge(true), Judge(false) = %q, %q, want PASS, FAIL", Judge(true), Judge(false))
	}
}
