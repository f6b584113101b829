package relay

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestBackoffSeeded: keys given Config.Rand draw their backoff from it, so
// that the same seed gives the same waits (a simulation replays a seed),
// and every wait stays in [d/2, d].
func TestBackoffSeeded(t *testing.T) {
	draw := func(seed uint64) []time.Duration {
		c := &keyCache{cfg: keyConfig{Upstream: UpstreamConfig{BackoffInitial: 250 * time.Millisecond, BackoffMax: 4 * time.Second}}, rand: newRand(rand.NewPCG(seed, 1))}
		b := c.newBackoff()
		var out []time.Duration
		for d := c.cfg.Upstream.BackoffInitial; len(out) < 8; d = min(2*d, c.cfg.Upstream.BackoffMax) {
			w := b.next()
			if w < d/2 || w > d {
				t.Fatalf("wait %d = %v, want in [%v, %v]", len(out), w, d/2, d)
			}
			out = append(out, w)
		}
		return out
	}
	if a, b := draw(3), draw(3); !slices.Equal(a, b) {
		t.Fatalf("seed 3 drew %v, then %v", a, b)
	}
	if a, b := draw(3), draw(4); slices.Equal(a, b) {
		t.Fatalf("seeds 3 and 4 drew the same waits %v", a)
	}
}
