package traffic

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/report"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// Tracker measures how long changes take to reach every Envoy that must get
// them: from the upstream publishing a resource at generation G to each
// Envoy ACKing that resource at generation G or later, or declaring it holds
// it to a new stream (it applied the response, but the stream broke before
// its ACK went out: the server learns it holds it from the declaration). Safe for concurrent
// use; Envoys report to it from their stream goroutines.
type Tracker struct {
	mu      sync.Mutex
	groups  map[string][]int // group → Envoy indexes
	pending map[string][]*tracked
	active  atomic.Int32 // len(pending) > 0, read without the lock
	// known finds a change tracked before (pending or recently done), so
	// that Track is idempotent; recent bounds the done ones it remembers.
	known  map[trackKey]*tracked
	recent []trackKey
	// early holds ACKs of names announced with Expect that arrived before
	// their change was tracked.
	early map[string][]earlyACK

	perEnvoy []time.Duration // one per (change, Envoy) ACK
	complete []time.Duration // one per change: until its last Envoy ACKed
	timedOut int
	// tracked and deliveries count the changes tracked and the (change,
	// Envoy) pairs they must reach.
	tracked, deliveries int
	limit               int // of perEnvoy and complete (KeepSamples)
}

type earlyACK struct {
	idx int
	gen uint64
	at  time.Time
}

type trackKey struct {
	typeURL, name string
	gen           uint64
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
	return &Tracker{groups: map[string][]int{}, pending: map[string][]*tracked{}, known: map[trackKey]*tracked{}, early: map[string][]earlyACK{}, limit: maxSamples}
}

// AddEnvoy registers Envoy idx of group, before its first event.
func (t *Tracker) AddEnvoy(idx int, group string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.groups[group] = append(t.groups[group], idx)
}

// Track starts timing c, and returns a channel that closes when every Envoy
// of the change's groups has ACKed it (at once, for a change no Envoy must
// get). To time a change without racing its arrival, call Track
// from the upstream's OnPublish hook; calling it again later with the same
// change returns the same channel.
func (t *Tracker) Track(c upstream.Change) <-chan struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	key := trackKey{c.TypeURL, c.Name, c.Generation}
	if tr, ok := t.known[key]; ok {
		return tr.done
	}
	tr := &tracked{typeURL: c.TypeURL, name: c.Name, gen: c.Generation, at: c.At, done: make(chan struct{})}
	t.known[key] = tr
	t.recent = append(t.recent, key)
	if len(t.recent) > maxRemembered {
		for _, k := range t.recent[:len(t.recent)/2] {
			if old := t.known[k]; old != nil && old.remaining == 0 {
				delete(t.known, k)
			}
		}
		t.recent = append(t.recent[:0], t.recent[len(t.recent)/2:]...)
	}
	n := 0
	for _, g := range c.Groups {
		for _, i := range t.groups[g] {
			n = max(n, i+1)
			tr.remaining++
		}
	}
	t.tracked++
	t.deliveries += tr.remaining
	if tr.remaining == 0 {
		close(tr.done)
		return tr.done
	}
	tr.seen = make([]uint64, (n+63)/64)
	t.pending[c.Name] = append(t.pending[c.Name], tr)
	early := t.early[c.TypeURL+"|"+c.Name]
	delete(t.early, c.TypeURL+"|"+c.Name)
	for _, a := range early {
		t.count(tr, a.idx, a.gen, a.at)
	}
	t.prune(c.Name)
	t.active.Store(int32(len(t.pending) + len(t.early)))
	return tr.done
}

// Expect announces that a change of typeURL/name is about to be published,
// for callers that learn of the change only once it is published (and may
// Track it after some Envoys already ACKed it): the ACKs that arrive in
// between are kept for Track. The OnPublish hook of the upstream is the
// simpler way.
func (t *Tracker) Expect(typeURL, name string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.early[typeURL+"|"+name]; !ok {
		t.early[typeURL+"|"+name] = nil
	}
	t.active.Store(int32(len(t.pending) + len(t.early)))
}

// count records Envoy idx's ACK of tr at generation gen; it reports whether
// that completed tr.
func (t *Tracker) count(tr *tracked, idx int, gen uint64, at time.Time) {
	w, b := idx/64, uint64(1)<<(idx%64)
	if gen < tr.gen || w >= len(tr.seen) || tr.seen[w]&b != 0 || tr.remaining == 0 {
		return
	}
	tr.seen[w] |= b
	tr.remaining--
	t.perEnvoy = appendBounded(t.perEnvoy, at.Sub(tr.at), t.limit)
	if tr.remaining == 0 {
		t.complete = appendBounded(t.complete, at.Sub(tr.at), t.limit)
		close(tr.done)
	}
}

// prune drops name's completed changes from pending.
func (t *Tracker) prune(name string) {
	kept := t.pending[name][:0]
	for _, tr := range t.pending[name] {
		if tr.remaining > 0 {
			kept = append(kept, tr)
		}
	}
	if len(kept) == 0 {
		delete(t.pending, name)
	} else {
		t.pending[name] = kept
	}
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
	clear(t.early)
	t.active.Store(int32(len(t.pending)))
}

// Observe records an Envoy's event.
func (t *Tracker) Observe(idx int, ev envoy.Event) {
	if (ev.Kind != envoy.ACKed && ev.Kind != envoy.Declared) || t.active.Load() == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, name := range ev.Names {
		var gen uint64
		if i < len(ev.Generations) {
			gen = ev.Generations[i]
		}
		if acks, ok := t.early[ev.TypeURL+"|"+name]; ok {
			t.early[ev.TypeURL+"|"+name] = append(acks, earlyACK{idx, gen, ev.At})
		}
		trs := t.pending[name]
		if len(trs) == 0 {
			continue
		}
		for _, tr := range trs {
			if tr.typeURL == ev.TypeURL {
				t.count(tr, idx, gen, ev.At)
			}
		}
		t.prune(name)
	}
	t.active.Store(int32(len(t.pending) + len(t.early)))
}

// maxRemembered bounds the changes Track remembers for idempotence.
const maxRemembered = 1 << 14

// maxSamples bounds the latencies a Tracker keeps by default; past it the
// older half is dropped, so a long demo's memory stays flat.
const maxSamples = 1 << 20

// KeepSamples sets how many latencies of each kind t keeps (default
// 1<<20, 8 MiB): a benchmark that must summarise every one sets it above
// what it will record.
func (t *Tracker) KeepSamples(n int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.limit = max(n, 1)
}

func appendBounded(s []time.Duration, d time.Duration, limit int) []time.Duration {
	if len(s) >= limit {
		s = append(s[:0], s[len(s)/2:]...)
	}
	return append(s, d)
}

// Results returns the per-Envoy ACK latencies (each Envoy's ACK of each
// change), the per-change completion latencies (until the last Envoy
// ACKed), and how many changes were given up on.
func (t *Tracker) Results() (perEnvoy, complete report.Latency, timedOut int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return report.Summarize(t.perEnvoy), report.Summarize(t.complete), t.timedOut
}

// Reset drops the recorded latencies and counts (not the pending
// changes).
func (t *Tracker) Reset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.perEnvoy, t.complete, t.timedOut, t.tracked, t.deliveries = nil, nil, 0, 0, 0
}

// Counts returns, since the last Reset, the changes tracked, the (change,
// Envoy) pairs they must reach, and the changes still pending (neither
// complete nor given up on).
func (t *Tracker) Counts() (tracked, deliveries, pending int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, trs := range t.pending {
		pending += len(trs)
	}
	return t.tracked, t.deliveries, pending
}
