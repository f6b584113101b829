package loadtest

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// Tracker measures how long changes take to reach every Envoy that must get
// them: from the upstream publishing a resource at generation G to each
// Envoy ACKing that resource at generation G or later. Safe for concurrent
// use; Envoys report to it from their stream goroutines.
type Tracker struct {
	mu      sync.Mutex
	groups  map[string][]int // group → Envoy indexes
	pending map[string][]*tracked
	active  atomic.Int32 // len(pending) > 0, read without the lock

	perEnvoy []time.Duration // one per (change, Envoy) ACK
	complete []time.Duration // one per change: until its last Envoy ACKed
	timedOut int
}

type tracked struct {
	typeURL, name string
	gen           uint64
	at            time.Time
	remaining     int
	seen          []uint64 // bitset over Envoy indexes
	done          chan struct{}
}

// NewTracker returns an empty Tracker.
func NewTracker() *Tracker {
	return &Tracker{groups: map[string][]int{}, pending: map[string][]*tracked{}}
}

func (t *Tracker) addEnvoy(idx int, group string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.groups[group] = append(t.groups[group], idx)
}

// Track starts timing c. The returned channel closes when every Envoy of the
// change's groups has ACKed it (it never closes for a change no Envoy must
// get; see Forget).
func (t *Tracker) Track(c upstream.Change) <-chan struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	tr := &tracked{typeURL: c.TypeURL, name: c.Name, gen: c.Generation, at: c.At, done: make(chan struct{})}
	n := 0
	for _, g := range c.Groups {
		for _, i := range t.groups[g] {
			n = max(n, i+1)
			tr.remaining++
		}
	}
	if tr.remaining == 0 {
		return tr.done
	}
	tr.seen = make([]uint64, (n+63)/64)
	t.pending[c.Name] = append(t.pending[c.Name], tr)
	t.active.Store(int32(len(t.pending)))
	return tr.done
}

// Forget stops waiting for changes older than cutoff, counting them as
// timed out.
func (t *Tracker) Forget(cutoff time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for name, trs := range t.pending {
		kept := trs[:0]
		for _, tr := range trs {
			if tr.at.Before(cutoff) {
				t.timedOut++
				continue
			}
			kept = append(kept, tr)
		}
		if len(kept) == 0 {
			delete(t.pending, name)
		} else {
			t.pending[name] = kept
		}
	}
	t.active.Store(int32(len(t.pending)))
}

// observe records an Envoy's event.
func (t *Tracker) observe(idx int, ev envoy.Event) {
	if ev.Kind != envoy.ACKed || t.active.Load() == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, name := range ev.Names {
		trs := t.pending[name]
		if len(trs) == 0 {
			continue
		}
		var gen uint64
		if i < len(ev.Generations) {
			gen = ev.Generations[i]
		}
		kept := trs[:0]
		for _, tr := range trs {
			w, b := idx/64, uint64(1)<<(idx%64)
			if tr.typeURL == ev.TypeURL && gen >= tr.gen && w < len(tr.seen) && tr.seen[w]&b == 0 {
				tr.seen[w] |= b
				tr.remaining--
				t.perEnvoy = appendBounded(t.perEnvoy, ev.At.Sub(tr.at))
				if tr.remaining == 0 {
					t.complete = appendBounded(t.complete, ev.At.Sub(tr.at))
					close(tr.done)
					continue
				}
			}
			kept = append(kept, tr)
		}
		if len(kept) == 0 {
			delete(t.pending, name)
		} else {
			t.pending[name] = kept
		}
	}
	t.active.Store(int32(len(t.pending)))
}

// maxSamples bounds the latencies a Tracker keeps; past it the older half is
// dropped, so a long demo's memory stays flat.
const maxSamples = 1 << 20

func appendBounded(s []time.Duration, d time.Duration) []time.Duration {
	if len(s) >= maxSamples {
		s = append(s[:0], s[len(s)/2:]...)
	}
	return append(s, d)
}

// Latency summarises durations.
type Latency struct {
	N                  int
	P50, P95, P99, Max time.Duration
}

func summarize(d []time.Duration) Latency {
	if len(d) == 0 {
		return Latency{}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	q := func(p float64) time.Duration { return s[min(len(s)-1, int(p*float64(len(s))))] }
	return Latency{N: len(s), P50: q(0.50), P95: q(0.95), P99: q(0.99), Max: s[len(s)-1]}
}

// Results returns the per-Envoy ACK latencies (each Envoy's ACK of each
// change), the per-change completion latencies (until the last Envoy
// ACKed), and how many changes were given up on.
func (t *Tracker) Results() (perEnvoy, complete Latency, timedOut int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return summarize(t.perEnvoy), summarize(t.complete), t.timedOut
}

// Reset drops the recorded latencies (not the pending changes).
func (t *Tracker) Reset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.perEnvoy, t.complete, t.timedOut = nil, nil, 0
}
