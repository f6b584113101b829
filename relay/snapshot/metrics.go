package snapshot

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	store     *Store
	writes    *prometheus.CounterVec
	bytes     prometheus.Counter
	bases     prometheus.Counter
	deposed   prometheus.Counter
	reclaims  prometheus.Counter
	corrupt   prometheus.Counter
	gcDeleted prometheus.Counter
	lag       prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_snapshot_writes_total", Help: "Key snapshot writes to etcd, by result (ok, error, deposed).",
		}, []string{"result"}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_snapshot_written_bytes_total", Help: "Bytes of keys and values put to etcd.",
		}),
		bases: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_snapshot_bases_total", Help: "Base indexes written (first write of a key, or log compaction).",
		}),
		deposed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_snapshot_deposed_total", Help: "Writes refused because another relay claimed the key since.",
		}),
		reclaims: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_snapshot_reclaims_total", Help: "Keys claimed back from the relay that claimed them, the ring still saying this relay owns them after the snapshot reclaim delay.",
		}),
		corrupt: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_snapshot_unreadable_total", Help: "Key snapshots or types left out at load because records were missing or damaged.",
		}),
		gcDeleted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_snapshot_gc_deleted_total", Help: "Unreferenced resources and chunks deleted.",
		}),
		lag: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "meshrelay_snapshot_write_lag_seconds", Help: "From a key's views being handed over to their write committing.",
			Buckets: []float64{.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
		}),
	}
	if reg == nil {
		return m, nil
	}
	behindKeys := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "meshrelay_snapshot_behind_keys", Help: "Keys whose latest views are not in etcd yet (persistence is behind).",
	}, func() float64 { n, _ := m.store.Behind(); return float64(n) })
	behindAge := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "meshrelay_snapshot_behind_seconds", Help: "How long the oldest unwritten change has waited.",
	}, func() float64 { _, d := m.store.Behind(); return d.Seconds() })
	for _, c := range []prometheus.Collector{m.writes, m.bytes, m.bases, m.deposed, m.reclaims, m.corrupt, m.gcDeleted, m.lag, behindKeys, behindAge} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("snapshot: metrics: %w", err)
		}
	}
	return m, nil
}
