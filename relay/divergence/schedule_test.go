package divergence

import (
	"math/rand/v2"
	"testing"
	"time"
)

// every is the relay's default interval between a key's checks
// (relay.Config.Keys.DivergenceInterval).
const every = 10 * time.Minute

func draw(d time.Duration) time.Duration { return rand.N(d) }

// TestSplitRecheckedSoonThenLessOften: a key of a node of its own since a
// split is checked again within splitRecheck, not at a random point of the
// whole interval (a split made during a fault is merged back soon after
// it ends), and then less and less often while the split is proven
// again, up to the interval; a re-check without an answer keeps the pace.
func TestSplitRecheckedSoonThenLessOften(t *testing.T) {
	var s Schedule[string]
	m := "envoy-0"
	members := []string{m}
	local := func(string) bool { return true }
	start := time.Now()
	if _, ok := s.RecheckDue(start, every, members, local, draw); !ok { // the first tick after the split draws the first re-check's time
		if _, ok := s.RecheckDue(start.Add(splitRecheck+time.Nanosecond), every, members, local, draw); !ok {
			t.Fatalf("first re-check not due %v after the split", splitRecheck)
		}
	}
	for _, step := range []struct {
		proven bool
		wait   time.Duration
	}{
		{true, splitRecheck}, {true, 2 * splitRecheck}, {false, 4 * splitRecheck}, {false, 4 * splitRecheck},
		{true, 4 * splitRecheck}, {true, 8 * splitRecheck}, {true, 16 * splitRecheck}, {true, every}, {true, every},
	} {
		at := time.Now()
		s.RecheckDone(m, step.proven, every, at)
		if _, ok := s.RecheckDue(at.Add(step.wait-time.Second), every, members, local, draw); ok {
			t.Fatalf("re-check due before %v", step.wait)
		}
		if _, ok := s.RecheckDue(at.Add(step.wait+time.Second), every, members, local, draw); !ok {
			t.Fatalf("re-check not due after %v", step.wait)
		}
	}
}
