package relay

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"
)

// Waits drawn at random: the upstream's backoff, and the random source
// (Config.Rand) a simulation replays.

// backoff is a jittered exponential backoff ("full jitter" on the upper
// half: each wait is uniform in [d/2, d], d doubling up to the maximum).
type backoff struct {
	initial, max, cur time.Duration
	rand              *rand.Rand // Config.Rand's; nil: the global source
}

func (b *backoff) next() time.Duration {
	if b.cur == 0 {
		b.cur = b.initial
	} else {
		b.cur = min(2*b.cur, b.max)
	}
	half := b.cur / 2
	return half + randN(b.rand, half+1)
}

// lockedSource serialises calls to Config.Rand.
type lockedSource struct {
	mu  sync.Mutex
	src rand.Source
}

func (s *lockedSource) Uint64() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.src.Uint64()
}

// randN is rand.N drawn from r (the global source if r is nil).
func randN[D ~int64](r *rand.Rand, n D) D {
	if r == nil {
		return rand.N(n)
	}
	return D(r.Int64N(int64(n)))
}

// shuffle is rand.Shuffle drawn from r (the global source if r is nil).
func shuffle(r *rand.Rand, n int, swap func(i, j int)) {
	if r == nil {
		rand.Shuffle(n, swap)
		return
	}
	r.Shuffle(n, swap)
}

func (b *backoff) reset() { b.cur = 0 }

// sleepCtx waits d or until ctx ends, and reports whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// newBackoff returns a backoff of the upstream's settings.
func (c *keyCache) newBackoff() *backoff {
	return &backoff{initial: c.cfg.Upstream.BackoffInitial, max: c.cfg.Upstream.BackoffMax, rand: c.rand}
}
