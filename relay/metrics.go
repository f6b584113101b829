package relay

import (
	"math"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// metrics are the relay's Prometheus metrics, named after istiod's pilot_*
// metrics under meshrelay_. No node id is ever a label.
type metrics struct {
	envoys             *prometheus.GaugeVec
	pushes             *prometheus.CounterVec
	pushBytes          *prometheus.CounterVec
	pushResources      *prometheus.CounterVec
	pushACK            *prometheus.HistogramVec
	converged          *prometheus.HistogramVec
	nacks              *prometheus.CounterVec
	streamErrors       *prometheus.CounterVec
	upstreamStreams    prometheus.Gauge
	upstreamWaiting    prometheus.Gauge
	awaitingToken      prometheus.Gauge
	upstreamReconnects prometheus.Counter
	restoredKeys       prometheus.Counter
	upstreamNACKs      *prometheus.CounterVec
	passthrough        *prometheus.CounterVec
	passthroughStreams prometheus.Gauge
	refused            *prometheus.CounterVec
	shed               *prometheus.CounterVec
	peerFallbacks      prometheus.Counter
	silentConfirms     prometheus.Counter
	claims             *prometheus.CounterVec
	handedOver         prometheus.Counter
	holds              *prometheus.CounterVec
	peerStreams        prometheus.Gauge
	peerClients        prometheus.Gauge
	authFailures       *prometheus.CounterVec
	divergenceChecks   *prometheus.CounterVec
	divergences        *prometheus.CounterVec
	divergenceOpen     prometheus.Gauge
	splitMerges        prometheus.Counter

	byType map[string]*typeMetrics // by type URL; "" for the rest

	// Totals for Stats, without a Gather.
	pushCount    atomic.Uint64
	bytesCount   atomic.Uint64
	upstreamOpen atomic.Int64
	peerOpen     atomic.Int64
	waitingOpen  atomic.Int64
}

// convergenceBuckets follow istiod's pilot_proxy_convergence_time, from 1 ms
// (its buckets start at 100 ms).
var convergenceBuckets = []float64{.001, .003, .01, .03, .1, .3, 1, 3, 10, 30}

func newMetrics(reg prometheus.Registerer, r *Relay) (*metrics, error) {
	m := &metrics{
		envoys: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "meshrelay_xds_clients", Help: "Connected downstream ADS streams, by protocol.",
		}, []string{"protocol"}),
		pushes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_pushes_total", Help: "Responses sent to downstream streams, by type.",
		}, []string{"type"}),
		pushBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_push_bytes_total", Help: "Bytes of responses sent downstream, by type.",
		}, []string{"type"}),
		pushResources: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_push_resources_total", Help: "Resources and removals sent downstream, by type.",
		}, []string{"type"}),
		pushACK: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "meshrelay_xds_push_ack_time_seconds",
			Help:    "Time from sending a response to its ACK, by type.",
			Buckets: convergenceBuckets,
		}, []string{"type"}),
		converged: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "meshrelay_proxy_convergence_time_seconds",
			Help: "Time from this relay's receipt of a version from its source to an Envoy's ACK of it, by type " +
				"(istiod's pilot_proxy_convergence_time measures to the send). Once per Envoy, type and version.",
			Buckets: convergenceBuckets,
		}, []string{"type"}),
		nacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_nacks_total", Help: "NACKs received from downstream streams, by type.",
		}, []string{"type"}),
		streamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_stream_errors_total", Help: "Downstream streams the relay ended with an error, by gRPC code.",
		}, []string{"code"}),
		upstreamStreams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_upstream_streams", Help: "Open aggregated ADS streams to the upstream (one per key).",
		}),
		upstreamWaiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_upstream_streams_waiting", Help: "Keys whose stream to the upstream waits its turn (--upstream-stream-rate).",
		}),
		awaitingToken: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_upstream_awaiting_token", Help: "Keys with no stream to the upstream because no member holds a token it would take (forward mode): they are served from cache until an Envoy brings one.",
		}),
		upstreamReconnects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_upstream_reconnects_total", Help: "Upstream streams that failed and were retried.",
		}),
		restoredKeys: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_restored_keys_total", Help: "Keys restored from persisted snapshots at start (warm start).",
		}),
		upstreamNACKs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_upstream_nacks_total", Help: "Upstream responses the relay refused, by type.",
		}, []string{"type"}),
		passthrough: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_passthrough_responses_total", Help: "Responses of uncached types passed through, by protocol.",
		}, []string{"protocol"}),
		passthroughStreams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_passthrough_streams", Help: "Open per-client upstream streams for uncached types.",
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_streams_refused_total", Help: "New downstream streams refused: rate (their identity's turn did not come), cold (upstream never reached), or share (the relay at its stream bound, their identity at its share).",
		}, []string{"reason"}),
		shed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_streams_moved_total", Help: "Downstream streams the relay ended (by closing their connection, but share) to move the client: rebalance, drain, token_expiry (forward mode: the Envoy reconnects with a fresh token), or share (evicted at the stream bound for another identity's share).",
		}, []string{"reason"}),
		peerFallbacks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_peer_fallbacks_total", Help: "Times a key's owner could not be reached and the relay subscribed to the upstream itself.",
		}),
		silentConfirms: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_source_silent_confirmations_total", Help: "Source streams (a SotW upstream, a peer relay) whose silence, not an answer of every type, ended the key's staleness.",
		}),
		claims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_sotw_claims_total", Help: "Versions SotW clients said they hold (version_info on a new stream) that the key's view does not: by where the relay learnt what they hold (history: its own key history; tier: another relay's; store: handed over by a relay that drained the client, in the snapshot store; unknown: nowhere, so the client may lose what its routes still use).",
		}, []string{"resolved"}),
		handedOver: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_sotw_versions_handed_over_total", Help: "Versions SotW Envoys held that the relay kept in the snapshot store as it drained them, for the relays they reconnect to.",
		}),
		holds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_make_before_break_overdue_total",
			Help: "Listeners and route configurations held back from an Envoy for longer than ResourceWaitTimeout because a cluster they use is not warm there: by type, and whether the cluster is the key's (held: it is on its way, so the resource waits on, a stall to look into) or not (sent: the upstream's own config names a cluster it does not serve, and Envoy answers 503 for it, as without the relay).",
		}, []string{"type", "outcome"}),
		peerStreams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_peer_streams", Help: "Open streams this relay holds to keys' owners (relay-to-relay, outgoing).",
		}),
		peerClients: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_peer_clients", Help: "Open streams of other relays subscribed to keys this relay owns (relay-to-relay, incoming).",
		}),
		authFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_auth_failures_total", Help: "Streams on the TLS xDS port refused for their credentials or identity: by reason (no_credentials, bad_token, expired, not_yet_valid, wrong_issuer, wrong_audience, untrusted_cert, no_spiffe_id, wrong_trust_domain, review_failed, review_denied, identity_mismatch, unproven_peer, throttled: a source address that kept failing, refused before verification).",
		}, []string{"reason"}),
		divergenceChecks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_divergence_checks_total", Help: "Divergence checks of aggregated keys (a second upstream stream presenting another member's node), by result: same, diverged (the key split), inconclusive (the check ended without a settled answer).",
		}, []string{"result"}),
		divergences: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_key_divergences_total", Help: "Divergence checks that found a member of a key given other config than the node the key presents, by type that differed: the key's profile is too coarse for this mesh, and the key split.",
		}, []string{"type"}),
		divergenceOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_divergence_check_streams", Help: "Open upstream streams of divergence checks (at most one per key, two per relay).",
		}),
		splitMerges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_key_split_merges_total", Help: "Splits of keys merged back by this relay's checks: a node the split moved was found given its key's config again, and the nodes it moved return to the key.",
		}),
	}
	keys := keyCollector{
		r:        r,
		keys:     prometheus.NewDesc("meshrelay_keys", "Aggregation keys held, by whether more than one stream (Envoys, and relays served the key) is joined to the key here (aggregated) or at most one.", []string{"aggregated"}, nil),
		stale:    prometheus.NewDesc("meshrelay_stale_keys", "Keys served from a cache no live upstream stream has confirmed.", nil, nil),
		bySource: prometheus.NewDesc("meshrelay_keys_by_source", "Keys by where their config comes from: upstream (owned), peer (the owner), fallback (the upstream, the owner being unreachable).", []string{"source"}, nil),
	}
	cs := []prometheus.Collector{
		m.envoys, m.pushes, m.pushBytes, m.pushResources, m.pushACK, m.converged, m.nacks, m.streamErrors,
		m.upstreamStreams, m.upstreamWaiting, m.awaitingToken, m.upstreamReconnects, m.restoredKeys, m.upstreamNACKs, m.passthrough, m.passthroughStreams,
		m.refused, m.shed, m.peerFallbacks, m.silentConfirms, m.claims, m.handedOver, m.holds, m.peerStreams, m.peerClients, m.authFailures,
		m.divergenceChecks, m.divergences, m.divergenceOpen, m.splitMerges, keys,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "meshrelay_cache_resources", Help: "Distinct resources held, shared by every key.",
		}, func() float64 { return float64(r.store.Len()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "meshrelay_cache_dropped_bytes", Help: "Bytes of resources the views dropped lately, kept for clients that still hold them (KeepDroppedBytes).",
		}, func() float64 { _, b := r.dropped.Held(); return float64(b) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "meshrelay_request_budget_bytes", Help: "Bytes of large requests being decoded and applied now (XDS.RequestBudgetBytes bounds them; a request past it waits).",
		}, func() float64 { return float64(func() int64 { n, _ := r.budget.InUse(); return n }()) }),
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	// Every label value known in advance has its series from the start,
	// at 0: increase() and rate() then see the first event too, and a
	// dashboard or alert querying the family finds it on a quiet relay.
	for _, reason := range []string{"rate", "cold", "share"} {
		m.refused.WithLabelValues(reason)
	}
	for _, result := range []string{"same", "diverged", "inconclusive"} {
		m.divergenceChecks.WithLabelValues(result)
	}
	for _, reason := range []string{"rebalance", "drain", "token_expiry", "share"} {
		m.shed.WithLabelValues(reason)
	}
	for _, typeURL := range []string{xds.TypeListener, xds.TypeRoute} {
		for _, outcome := range []string{"held", "sent"} {
			m.holds.WithLabelValues(xds.ShortType(typeURL), outcome)
		}
	}
	for _, reason := range []auth.Reason{auth.NoCredentials, auth.BadToken, auth.Expired, auth.NotYetValid, auth.WrongIssuer,
		auth.WrongAudience, auth.UntrustedCert, auth.NoSPIFFEID, auth.WrongTrustDomain, auth.ReviewFailed, auth.ReviewDenied,
		auth.IdentityMismatch, "throttled", "unproven_peer"} {
		m.authFailures.WithLabelValues(string(reason))
	}
	m.byType = make(map[string]*typeMetrics, len(xds.PushOrder)+1)
	for _, typeURL := range append([]string{""}, xds.PushOrder...) {
		t := xds.ShortType(typeURL)
		m.upstreamNACKs.WithLabelValues(t)
		if typeURL != "" {
			m.divergences.WithLabelValues(t)
		}
		m.byType[typeURL] = &typeMetrics{
			pushes:        m.pushes.WithLabelValues(t),
			pushBytes:     m.pushBytes.WithLabelValues(t),
			pushResources: m.pushResources.WithLabelValues(t),
			nacks:         m.nacks.WithLabelValues(t),
			pushACK:       m.pushACK.WithLabelValues(t),
			converged:     m.converged.WithLabelValues(t),
		}
	}
	return m, nil
}

// typeMetrics are one type's metric children, looked up once: the hot path
// (a push or an ACK per stream per change) does no label hashing.
type typeMetrics struct {
	pushes, pushBytes, pushResources, nacks prometheus.Counter
	pushACK, converged                      prometheus.Observer
}

func (m *metrics) forType(typeURL string) *typeMetrics {
	if tm := m.byType[typeURL]; tm != nil {
		return tm
	}
	return m.byType[""]
}

// sent counts one downstream response of size bytes.
func (m *metrics) sent(typeURL string, resources, removed, size int) {
	tm := m.forType(typeURL)
	tm.pushes.Inc()
	tm.pushBytes.Add(float64(size))
	tm.pushResources.Add(float64(resources + removed))
	m.pushCount.Add(1)
	m.bytesCount.Add(uint64(size))
}

// latency is a lock-free log-bucketed histogram for quick quantiles (the
// demo's and loadtest's P50/P99) without gathering Prometheus metrics. Buckets
// grow by 2^(1/4) from 10 µs, so a quantile is within 19% of the true value.
type latency struct {
	counts [latencyBuckets]atomic.Uint64
}

const (
	latencyBuckets = 112 // 10 µs · 2^(111/4) ≈ 2.3 h
	latencyBase    = 10 * time.Microsecond
)

func (l *latency) observe(d time.Duration) {
	i := 0
	if d > latencyBase {
		i = int(4 * math.Log2(float64(d)/float64(latencyBase)))
	}
	l.counts[min(i, latencyBuckets-1)].Add(1)
}

// quantile returns the upper bound of the bucket holding quantile q, and the
// number of observations.
func (l *latency) quantile(q float64) (time.Duration, uint64) {
	var total uint64
	for i := range l.counts {
		total += l.counts[i].Load()
	}
	if total == 0 {
		return 0, 0
	}
	rank := uint64(math.Ceil(q * float64(total)))
	var seen uint64
	for i := range l.counts {
		seen += l.counts[i].Load()
		if seen >= rank && seen > 0 {
			return time.Duration(float64(latencyBase) * math.Exp2(float64(i+1)/4)), total
		}
	}
	return 0, total
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
	keys := c.r.heldKeys()
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
