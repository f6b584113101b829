package relay

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshrelay/meshrelay/relay/metrics"
)

// newMetrics registers the relay's metrics (relay/metrics) with the
// collectors of what only the relay reads: its keys and its cache.
func newMetrics(reg prometheus.Registerer, r *Relay) (*metrics.Metrics, error) {
	keys := keyCollector{
		r:        r,
		keys:     prometheus.NewDesc("meshrelay_keys", "Aggregation keys held, by whether more than one stream (Envoys, and relays served the key) is joined to the key here (aggregated) or at most one.", []string{"aggregated"}, nil),
		stale:    prometheus.NewDesc("meshrelay_stale_keys", "Keys served from a cache no live upstream stream has confirmed.", nil, nil),
		bySource: prometheus.NewDesc("meshrelay_keys_by_source", "Keys by where their config comes from: upstream (owned), peer (the owner), fallback (the upstream, the owner being unreachable).", []string{"source"}, nil),
	}
	return metrics.New(reg, keys,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "meshrelay_cache_resources", Help: "Distinct resources held, shared by every key.",
		}, func() float64 { return float64(r.store.Len()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "meshrelay_cache_dropped_bytes", Help: "Bytes of resources the views dropped lately, kept for clients that still hold them (KeepDroppedBytes).",
		}, func() float64 { _, b := r.cache.dropped.Held(); return float64(b) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "meshrelay_request_budget_bytes", Help: "Bytes of large requests being decoded and applied now (XDS.RequestBudgetBytes bounds them; a request past it waits).",
		}, func() float64 { return float64(func() int64 { n, _ := r.srv.budget.InUse(); return n }()) }),
	)
}

// keyCollector reports the keys held, the stale ones, and by source, in
// one pass over the keys per scrape that takes no key's lock (each reads
// atomics only).
type keyCollector struct {
	r                     *Relay
	keys, stale, bySource *prometheus.Desc
}

func (c keyCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.keys
	ch <- c.stale
	ch <- c.bySource
}

func (c keyCollector) Collect(ch chan<- prometheus.Metric) {
	keys := c.r.cache.heldKeys()
	counts := map[sourceKind]int{}
	stale, aggregated := 0, 0
	for _, k := range keys {
		counts[sourceKind(k.source.Load())]++
		if k.views.Load().Stale {
			stale++
		}
		if k.aggregated() {
			aggregated++
		}
	}
	ch <- prometheus.MustNewConstMetric(c.keys, prometheus.GaugeValue, float64(aggregated), "true")
	ch <- prometheus.MustNewConstMetric(c.keys, prometheus.GaugeValue, float64(len(keys)-aggregated), "false")
	ch <- prometheus.MustNewConstMetric(c.stale, prometheus.GaugeValue, float64(stale))
	for _, kind := range []sourceKind{sourceUpstream, sourcePeer, sourceFallback} {
		ch <- prometheus.MustNewConstMetric(c.bySource, prometheus.GaugeValue, float64(counts[kind]), kind.String())
	}
}
