package report

import (
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
