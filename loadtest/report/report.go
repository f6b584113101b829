// Package report holds what the load tests report in common: latency
// summaries and the way they print, and the figures every benchmark's
// report is built of (the machine, latencies in milliseconds, a process's
// CPU and memory, where processes were pinned, the Envoys' reconnects and
// violations, the upstream's streams, verdicts on targets), each declared
// once with its JSON names.
package report

import (
	"fmt"
	"slices"
	"time"
)

// Latency summarises durations.
type Latency struct {
	N                  int
	P50, P95, P99, Max time.Duration
}

// Summarize sorts a copy of d and returns its percentiles by nearest rank:
// the P-th percentile of n samples is the ceil(P·n/100)-th smallest, the
// smallest sample with at least P % of the samples at or below it (P99 of
// 100 samples is the 99th, not the largest).
func Summarize(d []time.Duration) Latency {
	if len(d) == 0 {
		return Latency{}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	n := len(s)
	q := func(pct int) time.Duration { return s[max(1, (pct*n+99)/100)-1] }
	return Latency{N: n, P50: q(50), P95: q(95), P99: q(99), Max: s[n-1]}
}

// MS prints d for a table: "-" for 0, hundredths of a millisecond below
// one, else rounded to 100 µs.
func MS(d time.Duration) string {
	if d == 0 {
		return "-"
	}
	if d < time.Millisecond {
		return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond))
	}
	return d.Round(100 * time.Microsecond).String()
}
