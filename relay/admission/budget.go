package admission

import (
	"context"
	"sync/atomic"

	"golang.org/x/sync/semaphore"
)

// Floor is the size from which a request takes its bytes from the
// relay's Budget: an ACK, or a SotW request's repeated names,
// never waits.
const Floor = 64 << 10

// Budget bounds the bytes of large requests the relay's streams
// decode and apply at once (XDS.RequestBudgetBytes): a Delta reconnect
// decodes its initial_resource_versions into a map several times its
// size, and a thousand of them at once would hold that many times over.
// A stream's handler takes a request's bytes before it decodes it and
// gives them back once it is applied, before writing to any client (serve),
// so the budget always comes back. A request that finds the budget spent
// waits, first come first served (x/sync's semaphore), and its client
// sends no more than its flow-control window meanwhile. Safe for
// concurrent use.
type Budget struct {
	size  int64
	sem   *semaphore.Weighted
	inUse atomic.Int64
	peak  atomic.Int64 // the most in use at once, for tests and metrics
}

// NewBudget returns a budget of bytes.
func NewBudget(bytes int64) *Budget {
	return &Budget{size: bytes, sem: semaphore.NewWeighted(bytes)}
}

// Take waits for n bytes of the budget (all of it for a request larger:
// the peer port's may be), or ctx. It returns the bytes taken (0 for a
// request under Floor), to give back with Put.
func (b *Budget) Take(ctx context.Context, n int) (int64, error) {
	if n < Floor {
		return 0, nil
	}
	w := min(int64(n), b.size)
	if err := b.sem.Acquire(ctx, w); err != nil {
		return 0, err
	}
	in := b.inUse.Add(w)
	for p := b.peak.Load(); in > p && !b.peak.CompareAndSwap(p, in); p = b.peak.Load() {
	}
	return w, nil
}

// Put gives back what Take took.
func (b *Budget) Put(n int64) {
	if n > 0 {
		b.inUse.Add(-n)
		b.sem.Release(n)
	}
}

// InUse returns the bytes taken now, and the most taken at once.
func (b *Budget) InUse() (now, peak int64) { return b.inUse.Load(), b.peak.Load() }
