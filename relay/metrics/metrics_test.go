package metrics_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/meshrelay/meshrelay/relay/metrics"
	"github.com/meshrelay/meshrelay/relay/xds"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestNewRegistersEverySeriesAtZero: the families whose label values are
// known in advance exist from the start, at 0, so increase() and alerts
// see the first event; a response counted lands under its type, and
// the extra collectors are registered beside.
func TestNewRegistersEverySeriesAtZero(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	extra := prometheus.NewGauge(prometheus.GaugeOpts{Name: "meshrelay_test_extra", Help: "An extra collector."})
	m, err := metrics.New(reg, extra)
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]int{
		"meshrelay_xds_streams_refused_total":       3, // rate, cold, share
		"meshrelay_xds_streams_moved_total":         4,
		"meshrelay_divergence_checks_total":         3,
		"meshrelay_make_before_break_overdue_total": 4,
		"meshrelay_test_extra":                      1,
	} {
		if got, err := testutil.GatherAndCount(reg, name); err != nil || got != want {
			t.Errorf("%s: %d series (%v), want %d", name, got, err, want)
		}
	}
	m.Sent(xds.TypeCluster, 3, 1, 1000)
	m.Sent("type.googleapis.com/some.Unknown", 1, 0, 10)
	if got := testutil.ToFloat64(m.PushResources.WithLabelValues(xds.ShortType(xds.TypeCluster))); got != 4 {
		t.Errorf("cluster resources pushed = %v, want 4", got)
	}
	if m.PushCount.Load() != 2 || m.BytesCount.Load() != 1010 {
		t.Errorf("totals = %d pushes, %d bytes; want 2, 1010", m.PushCount.Load(), m.BytesCount.Load())
	}
	if _, err := metrics.New(reg); err == nil {
		t.Error("registering twice on one registry succeeded")
	}
}

// TestLatencyQuantiles: a quantile is the upper bound of its bucket,
// within 19 % above the true value.
func TestLatencyQuantiles(t *testing.T) {
	var l metrics.Latency
	if q, n := l.Quantile(0.5); q != 0 || n != 0 {
		t.Fatalf("empty: %v of %d, want 0 of 0", q, n)
	}
	for i := 1; i <= 100; i++ {
		l.Observe(time.Duration(i) * time.Millisecond)
	}
	for _, c := range []struct {
		q    float64
		true time.Duration
	}{{0.5, 50 * time.Millisecond}, {0.99, 99 * time.Millisecond}} {
		got, n := l.Quantile(c.q)
		if n != 100 || got < c.true || got > c.true*119/100 {
			t.Errorf("Quantile(%v) = %v of %d, want within [%v, %v] of 100", c.q, got, n, c.true, c.true*119/100)
		}
	}
}
