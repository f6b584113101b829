package ledger

import (
	"fmt"
	"testing"
	"time"
)

// benchTracker is one relay's ledger of envoys Envoys over keys keys, each
// synced and ACKed on CDS and EDS, with a history of versions EDS versions
// per key over a view of names names.
func benchTracker(b *testing.B, envoys, keys, names, versions int) (*Tracker, []*Envoy, [2]Hash) {
	b.Helper()
	tr, err := NewTracker(TrackerConfig{ForgetAfter: time.Minute, MaxDetail: 1024, Converged: func(string, time.Duration) {}})
	if err != nil {
		b.Fatal(err)
	}
	bld := Tree[int]{}.Edit()
	for i := range names {
		bld.Set(fmt.Sprint("svc-", i), h(fmt.Sprint(i)), 0)
	}
	trees := []Tree[int]{bld.Tree()}
	for v := 1; v < versions; v++ {
		bb := trees[v-1].Edit()
		bb.Set(fmt.Sprint("svc-", v%names), h(fmt.Sprint("v", v)), 0)
		trees = append(trees, bb.Tree())
	}
	now := time.Now()
	for k := range keys {
		key := fmt.Sprint("key-", k)
		cdsH, _ := NewHistory[int](DefaultHistoryConfig())
		v, _ := cdsH.Record(trees[0], now, Order{})
		tr.Recorded(key, cds, cdsH, v)
		edsH, _ := NewHistory[int](DefaultHistoryConfig())
		for _, t := range trees {
			v, _ := edsH.Record(t, now, Order{})
			tr.Recorded(key, eds, edsH, v)
		}
	}
	last, prev := trees[len(trees)-1].Root(), trees[max(0, len(trees)-2)].Root()
	var es []*Envoy
	for i := range envoys {
		e := tr.Connect(fmt.Sprint("node-", i), fmt.Sprint("key-", i%keys), now)
		for _, t := range []struct {
			typeURL string
			root    Hash
		}{{cds, trees[0].Root()}, {eds, last}} {
			e.Sent(t.typeURL, now)
			e.Synced(t.typeURL, t.root, now)
			e.Answered(t.typeURL, Answer{Version: "v", Latest: true, At: now})
		}
		es = append(es, e)
	}
	return tr, es, [2]Hash{prev, last}
}

// BenchmarkACK is the bookkeeping of a whole response: sent, synced and
// ACKed, each ACK moving the Envoy to another version (and observing its
// latency). It bounds an ACK's own cost from above (issue 5: ≤ 2 µs);
// timing the ACK alone here would time the benchmark's timer calls.
func BenchmarkACK(b *testing.B) {
	_, es, roots := benchTracker(b, 10_000, 100, 1000, 100)
	now := time.Now()
	for i := 0; b.Loop(); i++ {
		e := es[i%len(es)]
		e.Sent(eds, now)
		e.Synced(eds, roots[(i/len(es))%2], now)
		e.Answered(eds, Answer{Version: "v", Latest: true, At: now})
	}
}

// BenchmarkConvergence10k is the in-process convergence query over 10,000
// Envoys (issue 5: ≤ 1 ms).
func BenchmarkConvergence10k(b *testing.B) {
	tr, _, _ := benchTracker(b, 10_000, 100, 1000, 100)
	now := time.Now()
	for b.Loop() {
		if c := tr.Convergence(Scope{}, now); c.Envoys != 10_000 {
			b.Fatalf("Convergence = %+v", c)
		}
	}
}

// BenchmarkSummary10k builds what a relay sends its peers for a tier-wide
// query (in full and in brief), and merges it.
func BenchmarkSummary10k(b *testing.B) {
	tr, _, _ := benchTracker(b, 10_000, 100, 1000, 100)
	now := time.Now()
	for _, d := range []struct {
		name   string
		detail Detail
	}{{"full", Full}, {"brief", Brief}} {
		b.Run(d.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				tr.Summary(Scope{}, now, d.detail)
			}
		})
		b.Run(d.name+"/merged", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if c := tr.Summary(Scope{}, now, d.detail).Convergence(); c.Envoys != 10_000 {
					b.Fatalf("Convergence = %+v", c)
				}
			}
		})
	}
}

// BenchmarkVerdicts judges the ACKed roots of 10,000 Envoys for one
// resource: a proof per distinct root per key.
func BenchmarkVerdicts(b *testing.B) {
	tr, _, _ := benchTracker(b, 10_000, 100, 1000, 100)
	for b.Loop() {
		if _, err := tr.Verdicts(Scope{}, eds, "svc-99", h("v99")); err != nil {
			b.Fatal(err)
		}
	}
}
