package envoy

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// failingConn is a grpc.ClientConnInterface whose streams never open.
type failingConn struct {
	mu       sync.Mutex
	attempts []time.Time
}

func newFailingConn() *failingConn { return &failingConn{} }

func (c *failingConn) Invoke(context.Context, string, any, any, ...grpc.CallOption) error {
	return status.Error(codes.Unavailable, "down")
}

func (c *failingConn) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	c.mu.Lock()
	c.attempts = append(c.attempts, time.Now())
	c.mu.Unlock()
	return nil, status.Error(codes.Unavailable, "down")
}

// TestBackoffDelaySeeded: with Config.Rand, the same seed draws the same
// delays, within the same bounds.
func TestBackoffDelaySeeded(t *testing.T) {
	b := Backoff{Base: 100 * time.Millisecond, Max: time.Second}
	draw := func(seed uint64) []time.Duration {
		rng := rand.New(rand.NewPCG(seed, 1))
		var out []time.Duration
		for n := range 8 {
			d := backoffDelay(b, n, rng)
			if lo := min(b.Base<<n, b.Max) / 2; d < lo || d >= 2*lo {
				t.Fatalf("backoffDelay(%+v, %d, seeded) = %v, want in [%v, %v)", b, n, d, lo, 2*lo)
			}
			out = append(out, d)
		}
		return out
	}
	if a, b := draw(7), draw(7); !slices.Equal(a, b) {
		t.Fatalf("seed 7 drew %v, then %v", a, b)
	}
	if a, b := draw(7), draw(8); slices.Equal(a, b) {
		t.Fatalf("seeds 7 and 8 drew the same delays %v", a)
	}
}

func TestBackoffDelay(t *testing.T) {
	b := Backoff{Base: 100 * time.Millisecond, Max: time.Second}
	tests := []struct {
		n        int
		min, max time.Duration
	}{
		{0, 50 * time.Millisecond, 100 * time.Millisecond},
		{1, 100 * time.Millisecond, 200 * time.Millisecond},
		{3, 400 * time.Millisecond, 800 * time.Millisecond},
		{4, 500 * time.Millisecond, time.Second},
		{1000, 500 * time.Millisecond, time.Second},
	}
	for _, tt := range tests {
		for i := 0; i < 100; i++ {
			if d := backoffDelay(b, tt.n, nil); d < tt.min || d >= tt.max {
				t.Fatalf("backoffDelay(%+v, %d) = %v, want in [%v, %v)", b, tt.n, d, tt.min, tt.max)
			}
		}
	}
}

// TestReconnectBackoff: against a server that is always down, attempts are
// spaced by the jittered exponential backoff, and Stop ends them.
func TestReconnectBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		conn := newFailingConn()
		cfg := DefaultConfig()
		cfg.Node = &core.Node{Id: testNodeID}
		cfg.Conn = conn
		cfg.Backoff = Backoff{Base: time.Second, Max: 8 * time.Second}
		e, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Start(t.Context()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Minute) // fake time
		synctest.Wait()
		if err := e.Stop(t.Context()); err != nil {
			t.Fatal(err)
		}
		conn.mu.Lock()
		at := conn.attempts
		conn.mu.Unlock()
		// Delays: [0.5,1) [1,2) [2,4) [4,8) then [4,8) each: about 10 in 60s.
		if len(at) < 8 || len(at) > 16 {
			t.Fatalf("%d attempts in a minute, want 8..16", len(at))
		}
		for i := 1; i < len(at); i++ {
			d := min(cfg.Backoff.Base<<(i-1), cfg.Backoff.Max)
			if gap := at[i].Sub(at[i-1]); gap < d/2 || gap >= d {
				t.Errorf("gap before attempt %d = %v, want in [%v, %v)", i, gap, d/2, d)
			}
		}
		if st := e.Stats(); st.Connected || st.Reconnects != 0 {
			t.Errorf("Stats() = %+v, want never connected", st)
		}
	})
}

// TestSleep: sleep waits the full duration, or returns early on cancel.
func TestSleep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		if !sleep(t.Context(), 3*time.Second) || time.Since(start) != 3*time.Second {
			t.Errorf("sleep(3s) returned after %v", time.Since(start))
		}
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		start = time.Now()
		if sleep(ctx, time.Hour) || time.Since(start) != time.Second {
			t.Errorf("sleep(1h) with a 1s context returned after %v", time.Since(start))
		}
	})
}
