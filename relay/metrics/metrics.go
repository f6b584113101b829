// Package metrics holds a relay's Prometheus metrics, named after
// istiod's pilot_* metrics under meshrelay_ (no node id is ever a label),
// and the totals its Stats read without a Gather. Every part of the relay
// counts into one Metrics; the collectors of what only the relay can read
// (its keys, its cache) are registered beside them (New's extra).
package metrics

import (
	"math"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Metrics are the relay's Prometheus metrics, named after istiod's pilot_*
// metrics under meshrelay_. No node id is ever a label.
type Metrics struct {
	Envoys             *prometheus.GaugeVec
	Pushes             *prometheus.CounterVec
	PushBytes          *prometheus.CounterVec
	PushResources      *prometheus.CounterVec
	PushACK            *prometheus.HistogramVec
	Converged          *prometheus.HistogramVec
	Nacks              *prometheus.CounterVec
	StreamErrors       *prometheus.CounterVec
	UpstreamStreams    prometheus.Gauge
	UpstreamWaiting    prometheus.Gauge
	AwaitingToken      prometheus.Gauge
	UpstreamReconnects prometheus.Counter
	RestoredKeys       prometheus.Counter
	UpstreamNACKs      *prometheus.CounterVec
	Passthrough        *prometheus.CounterVec
	PassthroughStreams prometheus.Gauge
	Refused            *prometheus.CounterVec
	Shed               *prometheus.CounterVec
	PeerFallbacks      prometheus.Counter
	SilentConfirms     prometheus.Counter
	Claims             *prometheus.CounterVec
	HandedOver         prometheus.Counter
	Holds              *prometheus.CounterVec
	PeerStreams        prometheus.Gauge
	PeerClients        prometheus.Gauge
	AuthFailures       *prometheus.CounterVec
	DivergenceChecks   *prometheus.CounterVec
	Divergences        *prometheus.CounterVec
	DivergenceOpen     prometheus.Gauge
	SplitMerges        prometheus.Counter

	byType map[string]*TypeMetrics // by type URL; "" for the rest

	// Totals for Stats, without a Gather.
	PushCount    atomic.Uint64
	BytesCount   atomic.Uint64
	UpstreamOpen atomic.Int64
	PeerOpen     atomic.Int64
	WaitingOpen  atomic.Int64
}

// convergenceBuckets follow istiod's pilot_proxy_convergence_time, from 1 ms
// (its buckets start at 100 ms).
var convergenceBuckets = []float64{.001, .003, .01, .03, .1, .3, 1, 3, 10, 30}

// New makes the relay's metrics and registers them, with extra: the
// collectors of what only the relay can read (its keys, its cache).
func New(reg prometheus.Registerer, extra ...prometheus.Collector) (*Metrics, error) {
	m := &Metrics{
		Envoys: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "meshrelay_xds_clients", Help: "Connected downstream ADS streams, by protocol.",
		}, []string{"protocol"}),
		Pushes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_pushes_total", Help: "Responses sent to downstream streams, by type.",
		}, []string{"type"}),
		PushBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_push_bytes_total", Help: "Bytes of responses sent downstream, by type.",
		}, []string{"type"}),
		PushResources: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_push_resources_total", Help: "Resources and removals sent downstream, by type.",
		}, []string{"type"}),
		PushACK: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "meshrelay_xds_push_ack_time_seconds",
			Help:    "Time from sending a response to its ACK, by type.",
			Buckets: convergenceBuckets,
		}, []string{"type"}),
		Converged: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "meshrelay_proxy_convergence_time_seconds",
			Help: "Time from this relay's receipt of a version from its source to an Envoy's ACK of it, by type " +
				"(istiod's pilot_proxy_convergence_time measures to the send). Once per Envoy, type and version.",
			Buckets: convergenceBuckets,
		}, []string{"type"}),
		Nacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_nacks_total", Help: "NACKs received from downstream streams, by type.",
		}, []string{"type"}),
		StreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_stream_errors_total", Help: "Downstream streams the relay ended with an error, by gRPC code.",
		}, []string{"code"}),
		UpstreamStreams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_upstream_streams", Help: "Open aggregated ADS streams to the upstream (one per key).",
		}),
		UpstreamWaiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_upstream_streams_waiting", Help: "Keys whose stream to the upstream waits its turn (--upstream-stream-rate).",
		}),
		AwaitingToken: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_upstream_awaiting_token", Help: "Keys with no stream to the upstream because no member holds a token it would take (forward mode): they are served from cache until an Envoy brings one.",
		}),
		UpstreamReconnects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_upstream_reconnects_total", Help: "Upstream streams that failed and were retried.",
		}),
		RestoredKeys: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_restored_keys_total", Help: "Keys restored from persisted snapshots at start (warm start).",
		}),
		UpstreamNACKs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_upstream_nacks_total", Help: "Upstream responses the relay refused, by type.",
		}, []string{"type"}),
		Passthrough: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_passthrough_responses_total", Help: "Responses of uncached types passed through, by protocol.",
		}, []string{"protocol"}),
		PassthroughStreams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_passthrough_streams", Help: "Open per-client upstream streams for uncached types.",
		}),
		Refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_streams_refused_total", Help: "New downstream streams refused: rate (their identity's turn did not come), cold (upstream never reached), or share (the relay at its stream bound, their identity at its share).",
		}, []string{"reason"}),
		Shed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_streams_moved_total", Help: "Downstream streams the relay ended (by closing their connection, but share) to move the client: rebalance, drain, token_expiry (forward mode: the Envoy reconnects with a fresh token), or share (evicted at the stream bound for another identity's share).",
		}, []string{"reason"}),
		PeerFallbacks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_peer_fallbacks_total", Help: "Times a key's owner could not be reached and the relay subscribed to the upstream itself.",
		}),
		SilentConfirms: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_source_silent_confirmations_total", Help: "Source streams (a SotW upstream, a peer relay) whose silence, not an answer of every type, ended the key's staleness.",
		}),
		Claims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_sotw_claims_total", Help: "Versions SotW clients said they hold (version_info on a new stream) that the key's view does not: by where the relay learnt what they hold (history: its own key history; tier: another relay's; store: handed over by a relay that drained the client, in the snapshot store; unknown: nowhere, so the client may lose what its routes still use).",
		}, []string{"resolved"}),
		HandedOver: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_sotw_versions_handed_over_total", Help: "Versions SotW Envoys held that the relay kept in the snapshot store as it drained them, for the relays they reconnect to.",
		}),
		Holds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_make_before_break_overdue_total",
			Help: "Listeners and route configurations held back from an Envoy for longer than ResourceWaitTimeout because a cluster they use is not warm there: by type, and whether the cluster is the key's (held: it is on its way, so the resource waits on, a stall to look into) or not (sent: the upstream's own config names a cluster it does not serve, and Envoy answers 503 for it, as without the relay).",
		}, []string{"type", "outcome"}),
		PeerStreams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_peer_streams", Help: "Open streams this relay holds to keys' owners (relay-to-relay, outgoing).",
		}),
		PeerClients: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_peer_clients", Help: "Open streams of other relays subscribed to keys this relay owns (relay-to-relay, incoming).",
		}),
		AuthFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_xds_auth_failures_total", Help: "Streams on the TLS xDS port refused for their credentials or identity: by reason (no_credentials, bad_token, expired, not_yet_valid, wrong_issuer, wrong_audience, untrusted_cert, no_spiffe_id, wrong_trust_domain, review_failed, review_denied, identity_mismatch, unproven_peer, throttled: a source address that kept failing, refused before verification).",
		}, []string{"reason"}),
		DivergenceChecks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_divergence_checks_total", Help: "Divergence checks of aggregated keys (a second upstream stream presenting another member's node), by result: same, diverged (the key split), inconclusive (the check ended without a settled answer).",
		}, []string{"result"}),
		Divergences: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshrelay_key_divergences_total", Help: "Divergence checks that found a member of a key given other config than the node the key presents, by type that differed: the key's profile is too coarse for this mesh, and the key split.",
		}, []string{"type"}),
		DivergenceOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshrelay_divergence_check_streams", Help: "Open upstream streams of divergence checks (at most one per key, two per relay).",
		}),
		SplitMerges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshrelay_key_split_merges_total", Help: "Splits of keys merged back by this relay's checks: a node the split moved was found given its key's config again, and the nodes it moved return to the key.",
		}),
	}
	cs := []prometheus.Collector{
		m.Envoys, m.Pushes, m.PushBytes, m.PushResources, m.PushACK, m.Converged, m.Nacks, m.StreamErrors,
		m.UpstreamStreams, m.UpstreamWaiting, m.AwaitingToken, m.UpstreamReconnects, m.RestoredKeys, m.UpstreamNACKs, m.Passthrough, m.PassthroughStreams,
		m.Refused, m.Shed, m.PeerFallbacks, m.SilentConfirms, m.Claims, m.HandedOver, m.Holds, m.PeerStreams, m.PeerClients, m.AuthFailures,
		m.DivergenceChecks, m.Divergences, m.DivergenceOpen, m.SplitMerges,
	}
	cs = append(cs, extra...)
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	// Every label value known in advance has its series from the start,
	// at 0: increase() and rate() then see the first event too, and a
	// dashboard or alert querying the family finds it on a quiet relay.
	for _, reason := range []string{"rate", "cold", "share"} {
		m.Refused.WithLabelValues(reason)
	}
	for _, result := range []string{"same", "diverged", "inconclusive"} {
		m.DivergenceChecks.WithLabelValues(result)
	}
	for _, reason := range []string{"rebalance", "drain", "token_expiry", "share"} {
		m.Shed.WithLabelValues(reason)
	}
	for _, typeURL := range []string{xds.TypeListener, xds.TypeRoute} {
		for _, outcome := range []string{"held", "sent"} {
			m.Holds.WithLabelValues(xds.ShortType(typeURL), outcome)
		}
	}
	for _, reason := range []auth.Reason{auth.NoCredentials, auth.BadToken, auth.Expired, auth.NotYetValid, auth.WrongIssuer,
		auth.WrongAudience, auth.UntrustedCert, auth.NoSPIFFEID, auth.WrongTrustDomain, auth.ReviewFailed, auth.ReviewDenied,
		auth.IdentityMismatch, "throttled", "unproven_peer"} {
		m.AuthFailures.WithLabelValues(string(reason))
	}
	m.byType = make(map[string]*TypeMetrics, len(xds.PushOrder)+1)
	for _, typeURL := range append([]string{""}, xds.PushOrder...) {
		t := xds.ShortType(typeURL)
		m.UpstreamNACKs.WithLabelValues(t)
		if typeURL != "" {
			m.Divergences.WithLabelValues(t)
		}
		m.byType[typeURL] = &TypeMetrics{
			Pushes:        m.Pushes.WithLabelValues(t),
			PushBytes:     m.PushBytes.WithLabelValues(t),
			PushResources: m.PushResources.WithLabelValues(t),
			NACKs:         m.Nacks.WithLabelValues(t),
			PushACK:       m.PushACK.WithLabelValues(t),
			Converged:     m.Converged.WithLabelValues(t),
		}
	}
	return m, nil
}

// TypeMetrics are one type's metric children, looked up once: the hot path
// (a push or an ACK per stream per change) does no label hashing.
type TypeMetrics struct {
	Pushes, PushBytes, PushResources, NACKs prometheus.Counter
	PushACK, Converged                      prometheus.Observer
}

// ForType returns a type's metric children (those of the other types
// for a type URL the relay does not push).
func (m *Metrics) ForType(typeURL string) *TypeMetrics {
	if tm := m.byType[typeURL]; tm != nil {
		return tm
	}
	return m.byType[""]
}

// Sent counts one downstream response of size bytes.
func (m *Metrics) Sent(typeURL string, resources, removed, size int) {
	tm := m.ForType(typeURL)
	tm.Pushes.Inc()
	tm.PushBytes.Add(float64(size))
	tm.PushResources.Add(float64(resources + removed))
	m.PushCount.Add(1)
	m.BytesCount.Add(uint64(size))
}

// Latency is a lock-free log-bucketed histogram for quick quantiles (the
// demo's and loadtest's P50/P99) without gathering Prometheus metrics. Buckets
// grow by 2^(1/4) from 10 µs, so a quantile is within 19% of the true value.
type Latency struct {
	counts [latencyBuckets]atomic.Uint64
}

const (
	latencyBuckets = 112 // 10 µs · 2^(111/4) ≈ 2.3 h
	latencyBase    = 10 * time.Microsecond
)

// Observe counts one duration.
func (l *Latency) Observe(d time.Duration) {
	i := 0
	if d > latencyBase {
		i = int(4 * math.Log2(float64(d)/float64(latencyBase)))
	}
	l.counts[min(i, latencyBuckets-1)].Add(1)
}

// Quantile returns the upper bound of the bucket holding quantile q, and the
// number of observations.
func (l *Latency) Quantile(q float64) (time.Duration, uint64) {
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
