package upstream_test

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

var benchSink *upstream.Upstream

// BenchmarkBuild30k builds the reference scenario, 30,000 ServiceEntries and
// 30,000 WorkloadEntries, with 10% namespace-local services. live-MB is the
// heap the last build keeps.
func BenchmarkBuild30k(b *testing.B) {
	for _, ns := range []int{1, 4, 10} {
		b.Run(fmt.Sprintf("namespaces=%d", ns), func(b *testing.B) {
			cfg := upstream.DefaultConfig()
			cfg.Scenario = upstream.Scenario{Services: 30000, Endpoints: 30000, Namespaces: ns, LocalFraction: 0.1}
			b.ReportAllocs()
			benchSink = nil
			runtime.GC()
			var before runtime.MemStats
			runtime.ReadMemStats(&before)
			for b.Loop() {
				u, err := upstream.New(cfg)
				if err != nil {
					b.Fatal(err)
				}
				benchSink = u
			}
			b.StopTimer()
			runtime.GC()
			var after runtime.MemStats
			runtime.ReadMemStats(&after)
			b.ReportMetric(float64(int64(after.HeapAlloc)-int64(before.HeapAlloc))/1e6, "live-MB")
			benchSink = nil
		})
	}
}
