package envoy

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
)

// bigWorld has n EDS clusters, one listener and one route using 10 of them.
func bigWorld(n int) world {
	w := world{
		clusters: make(map[string]uint32, n),
		routes:   map[string][]string{},
		lns:      map[string]string{"l1": "r1"},
	}
	for i := range n {
		w.clusters[fmt.Sprintf("outbound|8080||svc-%05d.ns.svc.cluster.local", i)] = uint32(10000 + i)
	}
	for i := range min(n, 10) {
		w.routes["r1"] = append(w.routes["r1"], fmt.Sprintf("outbound|8080||svc-%05d.ns.svc.cluster.local", i))
	}
	return w
}

func heapAlloc() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// BenchmarkEnvoyMemory measures the heap of idle simulated Envoys holding
// 1,000 clusters and their 1,000 load assignments, all sharing one gRPC
// connection to a go-control-plane upstream:
//
//	go test -run '^$' -bench EnvoyMemory -benchtime 1x ./loadtest/envoy/
//
// heap-B/envoy counts a connected Envoy with both ends of its stream (the
// upstream's per-stream state included); held-B/envoy counts what an Envoy
// keeps once the upstream is gone (its held state alone); goroutines/envoy
// counts every goroutine a connected Envoy adds to the process (gRPC's
// per-stream goroutines on both ends included).
func BenchmarkEnvoyMemory(b *testing.B) {
	const envoys, clusters = 200, 1000
	for _, p := range protocols {
		b.Run(p.String(), func(b *testing.B) {
			for range b.N {
				w := bigWorld(clusters)
				u := newUpstream(b, "snapshot", w)
				u.rec.mu.Lock()
				u.rec.quiet = true
				u.rec.mu.Unlock()
				base, baseG := heapAlloc(), runtime.NumGoroutine()

				es := make([]*Envoy, envoys)
				for i := range es {
					cfg := DefaultConfig()
					cfg.Node = &core.Node{Id: fmt.Sprintf("sidecar~10.0.%d.%d~app-%d.ns~ns.svc.cluster.local", i/250, i%250, i)}
					cfg.Protocol = p
					cfg.Conn = u.conn
					cfg.Backoff = Backoff{Base: time.Hour, Max: time.Hour}
					e, err := New(cfg)
					if err != nil {
						b.Fatal(err)
					}
					if err := e.Start(context.Background()); err != nil {
						b.Fatal(err)
					}
					es[i] = e
				}
				for _, e := range es {
					waitFor(b, e, "sync", synced(w))
				}
				connected, goroutines := heapAlloc(), runtime.NumGoroutine()

				u.stop()
				for _, e := range es {
					waitFor(b, e, "disconnected", func(v View) bool { return !v.Stats().Connected })
				}
				held := heapAlloc()
				for _, e := range es {
					if len(e.Violations()) > 0 {
						b.Fatalf("violations: %v", e.Violations())
					}
				}
				b.ReportMetric(float64(connected-base)/envoys, "heap-B/envoy")
				b.ReportMetric(float64(held-base)/envoys, "held-B/envoy")
				b.ReportMetric(float64(goroutines-baseG)/envoys, "goroutines/envoy")
				for _, e := range es {
					if err := e.Stop(context.Background()); err != nil {
						b.Fatal(err)
					}
				}
				runtime.KeepAlive(es)
			}
		})
	}
}
